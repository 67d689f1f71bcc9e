"""Weight sync against a real engine process: logprob agreement, disk and broadcast pushes, refusal."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.trainer.conftest import engine_generate, engine_version, trainer_logprobs
from tests.trainer.helpers import full, synthetic_rows
from trainer.config import TrainerSettings
from trainer.model import load_model
from trainer.step import train_step
from trainer.weight_sync import BroadcastSync, DirectControl, DiskSync, TensorSync, WeightSyncError, push_weights

PROMPT = [1, 9690, 198, 2683, 314, 253, 1345, 30, 2, 198, 1, 520, 9531, 198]
GAP = 1e-4


@pytest.fixture(scope="module")
def model(tiny_model_dir, dist_info):
    return load_model(tiny_model_dir)


def _train_a_step(model, dist_info, seed):
    """A real GRPO step, plus weight noise so that even greedy outputs of a random tiny model change."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    settings = TrainerSettings(engine_urls=["unused"], micro_batch_tokens=4096, max_grad_norm=0)
    train_step(model, optimizer, synthetic_rows(n_groups=2, group_size=3, seed=seed), settings, dist_info, version=0)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)


def _assert_engine_serves(model, url, version):
    assert engine_version(url) == version
    out = engine_generate(url, PROMPT, 12, seed=3)
    assert out["version"] == version
    gap = (trainer_logprobs(model, PROMPT, out["output_ids"]) - torch.tensor(out["logprobs"])).abs().max().item()
    assert gap < GAP, f"engine-vs-trainer logprob gap {gap:.2e} at version {version}"


def test_logprob_gap_at_the_same_version(model, trainer_engine):
    # the engine starts on the tiny model's weights at version 0, as does the trainer
    _assert_engine_serves(model, trainer_engine, 0)


@pytest.mark.parametrize("mode", ["disk", "broadcast", "tensor"])
def test_push_changes_outputs_bumps_version_and_matches_trainer(mode, model, trainer_engine, dist_info, tmp_path,
                                                                tiny_model_dir):
    before_version = engine_version(trainer_engine)
    before = engine_generate(trainer_engine, PROMPT, 12, temperature=0.0)["output_ids"]
    _train_a_step(model, dist_info, seed=len(mode))
    client = httpx.Client(timeout=120)
    if mode == "disk":
        transport = DiskSync(sync_dir=tmp_path / "sync", source_dir=tiny_model_dir, client=client)
    elif mode == "tensor":  # on CPU the handles are shared-memory files; on a GPU, CUDA IPC handles
        transport = TensorSync(client=client)
    else:
        transport = BroadcastSync(client=client, bucket_bytes=2 * 2**20)  # several buckets
    version = before_version + 1
    result = push_weights(model, version, info=dist_info, transport=transport,
                          control=DirectControl([trainer_engine], client=client))
    assert result.attempts == 1 and result.bytes > 10 * 2**20
    after = engine_generate(trainer_engine, PROMPT, 12, temperature=0.0)["output_ids"]
    assert after != before
    _assert_engine_serves(model, trainer_engine, version)
    if mode != "disk":  # a second push (broadcast: reuses the group; tensor: a fresh buffer)
        _train_a_step(model, dist_info, seed=7)
        push_weights(model, version + 1, info=dist_info, transport=transport,
                     control=DirectControl([trainer_engine], client=client))
        _assert_engine_serves(model, trainer_engine, version + 1)


def test_refused_update_retries_then_stops_and_the_old_version_keeps_serving(model, trainer_engine, dist_info,
                                                                            tmp_path, tiny_model_dir):
    """Two engines, one refuses (404): retried, then rolled back and resumed on the old version."""
    old = engine_version(trainer_engine)
    old_weights = {k: v.clone() for k, v in model.state_dict().items()}
    client = httpx.Client(timeout=120)
    transport = DiskSync(sync_dir=tmp_path / "sync", source_dir=tiny_model_dir, client=client)
    push_weights(model, old + 1, info=dist_info, transport=transport,  # the served copy is on disk
                 control=DirectControl([trainer_engine], client=client))
    old += 1

    class TwoEngines(DirectControl):
        def engines(self) -> list[str]:
            return [trainer_engine, trainer_engine + "/no-such-engine"]

    _train_a_step(model, dist_info, seed=11)
    with pytest.raises(WeightSyncError, match=f"version {old + 1} failed after 2 attempt.*keep serving version {old}"):
        push_weights(model, old + 1, info=dist_info, transport=transport, retries=2, backoff_s=0.1,
                     control=TwoEngines([trainer_engine], client=client))
    # the engine that took the new weights was rolled back: old version, old weights
    assert engine_version(trainer_engine) == old
    new_weights = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(old_weights)
    _assert_engine_serves(model, trainer_engine, old)
    model.load_state_dict(new_weights)


def test_tensor_update_refuses_foreign_pickles_and_unknown_names(trainer_engine, model):
    """/update_weights_from_tensor: only named torch tensors may be unpickled; names are checked first."""
    import base64
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    version = engine_version(trainer_engine)
    evil = base64.b64encode(pickle.dumps([("model.norm.weight", print)])).decode()
    r = httpx.post(f"{trainer_engine}/update_weights_from_tensor", json={"serialized_named_tensors": [evil]}, timeout=60)
    assert r.status_code == 400 and "refused to unpickle builtins.print" in r.json()["message"]
    torch.multiprocessing.set_sharing_strategy("file_system")  # a CPU tensor any process can open by name
    buf = io.BytesIO()
    ForkingPickler(buf).dump([("model.no_such.weight", torch.zeros(3).share_memory_())])
    r = httpx.post(f"{trainer_engine}/update_weights_from_tensor",
                   json={"serialized_named_tensors": [base64.b64encode(buf.getvalue()).decode()], "weight_version": "99"},
                   timeout=60)
    assert r.status_code == 400 and "unknown parameter names" in r.json()["message"]
    r = httpx.post(f"{trainer_engine}/update_weights_from_tensor", json={"serialized_named_tensors": ["%%%"]}, timeout=60)
    assert r.status_code == 400 and "base64" in r.json()["message"]
    assert engine_version(trainer_engine) == version  # nothing was applied


# SGLang 0.5.19 io_struct.UpdateWeightsFromTensorReqInput (and BaseReq's rid/http_worker_ipc): the HTTP body
SGLANG_TENSOR_FIELDS = {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
                        "weight_version", "disable_draft_model", "torch_empty_cache", "rid", "http_worker_ipc"}


def test_tensor_sync_speaks_sglangs_update_weights_from_tensor(model, dist_info):
    """The body TensorSync sends is SGLang's; SGLang's 400 {"success": false, "message"} is an error."""
    import base64
    import pickle

    import respx

    base = "http://sglang.test"
    with httpx.Client() as http, respx.mock:
        route = respx.post(f"{base}/update_weights_from_tensor").mock(
            return_value=httpx.Response(200, json={"success": True, "message": "Success"}))
        # the release and its TP ranks (one tensor payload per rank; 0.5.19: no weight-update session)
        respx.get(f"{base}/server_info").mock(return_value=httpx.Response(200, json={"version": "0.5.19",
                                                                                      "tp_size": 1}))
        sync = TensorSync(client=http)
        staged = sync.stage(model, 4, dist_info)
        updated: list[str] = []
        sync.send([base], 4, staged, updated, flush_cache=False)
        body = json.loads(route.calls.last.request.content)
        assert set(body) <= SGLANG_TENSOR_FIELDS and updated == [base]
        assert body["weight_version"] == "4" and body["load_format"] is None and body["flush_cache"] is False
        named = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))  # ForkingPickler output
        state = {k: full(v) for k, v in model.state_dict().items()}
        assert [n for n, _ in named] == [n for n in state if n != "lm_head.weight"]
        assert all(torch.equal(t, state[n]) for n, t in named)
        route.mock(return_value=httpx.Response(400, json={"success": False, "message": "Failed: shape mismatch"}))
        with pytest.raises(WeightSyncError, match="shape mismatch"):
            sync.send([base], 5, staged, [], flush_cache=True)
        sync.committed(staged)


@pytest.mark.parametrize("tags", [["kv_cache"], ["kv_cache", "weights", "cuda_graph"]])
def test_engines_release_memory_during_the_step_and_take_it_back_before_the_push(tags, model, trainer_engine,
                                                                                 dist_info):
    from trainer.weight_sync import engines_released

    client = httpx.Client(timeout=120)
    control = DirectControl([trainer_engine], client=client)
    with engines_released(tags, 0, info=dist_info, control=control, client=client, engine_kind="sglang") as timings:
        info = httpx.get(f"{trainer_engine}/get_server_info", timeout=10).json()["internal_states"][0]
        assert info["memory_released"] == sorted(tags)
        refused = httpx.post(f"{trainer_engine}/generate", json={"input_ids": PROMPT}, timeout=30)
        assert refused.status_code == 503
        _train_a_step(model, dist_info, seed=11)
    assert set(timings) == {"engine/release_s", "engine/resume_memory_s"}
    info = httpx.get(f"{trainer_engine}/get_server_info", timeout=10).json()["internal_states"][0]
    assert info["memory_released"] == [] and info["paused"] is not None  # still paused for the push
    push_weights(model, 1, info=dist_info, transport=TensorSync(client=client), control=control)
    _assert_engine_serves(model, trainer_engine, 1)


def test_a_failed_step_gives_the_engines_memory_and_generation_back(trainer_engine, dist_info):
    from trainer.weight_sync import engines_released

    client = httpx.Client(timeout=120)
    control = DirectControl([trainer_engine], client=client)
    with pytest.raises(RuntimeError, match="step failed"):
        with engines_released(["kv_cache"], 0, info=dist_info, control=control, client=client):
            raise RuntimeError("step failed")
    info = httpx.get(f"{trainer_engine}/get_server_info", timeout=10).json()["internal_states"][0]
    assert info["memory_released"] == [] and info["paused"] is None
    assert engine_generate(trainer_engine, PROMPT, 3)["version"] == 0
    # an engine that cannot release (unknown tag on its side) fails the step before it starts, generating
    with pytest.raises(WeightSyncError, match="cannot release"):
        with engines_released(["not_a_tag"], 0, info=dist_info, control=control, client=client):
            pytest.fail("the step must not run")
    assert httpx.get(f"{trainer_engine}/get_server_info", timeout=10).json()["internal_states"][0]["paused"] is None


def test_disk_pushes_overwrite_the_oldest_unserved_directory_in_place(model, dist_info, tmp_path, tiny_model_dir):
    """Steady state: push N rewrites the file of push N-2 (not served, not the rollback target) in place."""
    from safetensors.torch import load_file

    def engine(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"success": True, "message": "ok", "status": "ok"})

    client = httpx.Client(transport=httpx.MockTransport(engine))
    disk = DiskSync(sync_dir=tmp_path / "sync", source_dir=tiny_model_dir, client=client)
    control = DirectControl(["http://engine"], client=client)
    inodes = {}
    for version in (1, 2, 3):
        with torch.no_grad():
            model.get_input_embeddings().weight.add_(1.0)
        push_weights(model, version, info=dist_info, transport=disk, control=control)
        inodes[version] = (tmp_path / "sync" / f"v{version}" / "model.safetensors").stat().st_ino
        assert disk.served_path == tmp_path / "sync" / f"v{version}"
    assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["v2", "v3"]
    assert inodes[3] == inodes[1] and inodes[2] != inodes[1]  # v1's file became v3's
    saved = load_file(str(tmp_path / "sync" / "v3" / "model.safetensors"))
    from trainer.model import iter_full_tensors

    full = dict(iter_full_tensors(model))
    assert set(saved) == set(full)
    for name, value in full.items():
        assert torch.equal(saved[name], value.to(saved[name].dtype)), name
    assert (tmp_path / "sync" / "v3" / "config.json").is_file()
