"""Weight updates over HTTP against a real engine process: from disk, refused updates, and a gloo broadcast
from a second process playing the trainer."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import REPO
from tests.engine.conftest import reference_logprobs
from tests.engine_hooks import engine_state, held_decoding, wait_for, wait_held

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 30, 2, 198, 1, 4093]
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def url(engine_url):
    return engine_url


@pytest.fixture(scope="module")
def eos_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model rewired to always predict EOS: layers add nothing, the final norm keeps one dimension,
    and in that (tied) embedding dimension every token is positive and EOS is by far the largest."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, 0] = 1.0
        emb[EOS, 0] = 100.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    out = tmp_path_factory.mktemp("eos_model")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def other_shape_dir(tiny_model_dir, tmp_path_factory) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.hidden_size, config.intermediate_size = 32, 64
    out = tmp_path_factory.mktemp("other_shape")
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def greedy(url: str, **extra) -> dict:
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, **extra}}
    response = httpx.post(url + "/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def version(url: str) -> str:
    return httpx.get(url + "/get_model_info").json()["weight_version"]


def update_from_disk(url: str, path, **extra) -> httpx.Response:
    return httpx.post(url + "/update_weights_from_disk", json={"model_path": str(path), **extra}, timeout=120)


def test_refused_updates_keep_the_old_weights(url, tmp_path, other_shape_dir, tiny_model_dir):
    before = greedy(url)
    start = version(url)
    missing = update_from_disk(url, tmp_path / "nope")
    assert missing.status_code == 400
    assert missing.json()["success"] is False and "not a directory" in missing.json()["message"]
    (tmp_path / "empty").mkdir()
    assert "no *.safetensors" in update_from_disk(url, tmp_path / "empty").json()["message"]
    wrong = update_from_disk(url, other_shape_dir)
    assert wrong.status_code == 400 and "shape mismatch" in wrong.json()["message"]
    bad_version = update_from_disk(url, tiny_model_dir, weight_version="v-next")
    assert bad_version.status_code == 400 and "integer versions" in bad_version.json()["message"]
    assert version(url) == start
    assert greedy(url)["output_ids"] == before["output_ids"]


def test_update_from_disk_changes_outputs_bumps_the_version_and_stops_on_eos(url, eos_model_dir, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    before = greedy(url)
    start = int(version(url))
    ok = update_from_disk(url, eos_model_dir)
    assert ok.status_code == 200 and ok.json()["success"] is True
    assert version(url) == str(start + 1)
    after = greedy(url)
    assert after["output_ids"] == [EOS]
    assert after["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    assert after["meta_info"]["weight_version"] == str(start + 1) and after["text"] == ""
    # ignore_eos keeps going; logprobs match the new weights
    cont = greedy(url, ignore_eos=True)
    assert cont["output_ids"] == [EOS] * 6 and cont["meta_info"]["finish_reason"]["type"] == "length"
    new_model = AutoModelForCausalLM.from_pretrained(eos_model_dir, dtype=torch.float32).eval()
    ref = reference_logprobs(new_model, PROMPT, cont["output_ids"])
    got = [lp for lp, _, _ in cont["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(ref, got)) < 1e-4

    # an explicit weight_version is taken as given; the original weights serve again
    back = update_from_disk(url, tiny_model_dir, weight_version="10")
    assert back.json()["success"] is True and version(url) == "10"
    assert greedy(url)["output_ids"] == before["output_ids"]


def test_a_request_in_flight_finishes_under_one_version(url, eos_model_dir, tiny_model_dir):
    """Without a pause, the update waits for running requests; every token of a request has one version."""
    start_version = int(version(url))
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 120, "ignore_eos": True}}
    results = {}
    worker = threading.Thread(target=lambda: results.setdefault(
        "long", httpx.post(url + "/generate", json=body, timeout=120).json()))
    updates: dict = {}
    updater = threading.Thread(target=lambda: updates.setdefault("r", update_from_disk(url, eos_model_dir)))
    with held_decoding(url, 10):  # the update reaches the scheduler while the request is provably running
        worker.start()
        wait_held(url)
        updater.start()
        wait_for(lambda: engine_state(url)["num_pending_weight_updates"] == 1, "the update to wait for the drain")
    updater.join(timeout=120)
    assert updates["r"].json()["success"] is True
    worker.join(timeout=60)
    long = results["long"]
    assert long["meta_info"]["finish_reason"] == {"type": "length", "length": 120}  # not aborted
    assert long["meta_info"]["weight_version"] == str(start_version)
    assert EOS not in long["output_ids"]  # no token came from the EOS weights
    assert version(url) == str(start_version + 1)
    update_from_disk(url, tiny_model_dir)  # restore for the next test


def test_broadcast_update_from_a_trainer_process(url, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    before = greedy(url)
    push = subprocess.run(
        [sys.executable, "-m", "tests.engine.push_weights", url, str(tiny_model_dir), str(tmp_path), "42"],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    assert push.returncode == 0, push.stdout + push.stderr
    assert version(url) == "42"  # two buckets, one version
    after = greedy(url)
    old_lp = [lp for lp, _, _ in before["meta_info"]["output_token_logprobs"]]
    new_lp = [lp for lp, _, _ in after["meta_info"]["output_token_logprobs"]]
    # the random tiny model tends to repeat its input token under both weights, so compare probabilities
    assert after["output_ids"] != before["output_ids"] or max(abs(a - b) for a, b in zip(old_lp, new_lp)) > 1e-2
    assert after["meta_info"]["weight_version"] == "42"

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    from safetensors.torch import load_file

    model.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=False)
    model.tie_weights()
    ref = reference_logprobs(model, PROMPT, after["output_ids"])
    got = [lp for lp, _, _ in after["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(ref, got)) < 1e-4
    destroy = {"group_name": "test_group"}
    assert httpx.post(url + "/destroy_weights_update_group", json=destroy).json()["success"] is True
    assert httpx.post(url + "/destroy_weights_update_group", json=destroy).json()["success"] is False
    assert update_from_disk(url, tiny_model_dir).json()["success"] is True  # restore for other tests


def test_update_weight_version_relabels_the_same_weights(url):
    """SGLang's ``/update_weight_version`` (what the trainer sends for a step it skipped): outputs unchanged,
    later tokens carry the new version; a version that is not an integer is refused and changes nothing."""
    before, old = greedy(url), version(url)
    new = str(int(old) + 5)
    try:
        resp = httpx.post(url + "/update_weight_version", json={"new_version": new, "abort_all_requests": False},
                          timeout=60)
        assert resp.status_code == 200 and resp.json()["success"] is True, resp.text
        assert version(url) == new
        after = greedy(url)
        assert after["output_ids"] == before["output_ids"]
        assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
        assert after["meta_info"]["weight_version"] == new
        bad = httpx.post(url + "/update_weight_version", json={"new_version": "v-next"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["success"] is False and version(url) == new
    finally:
        httpx.post(url + "/update_weight_version", json={"new_version": old}, timeout=60)
    assert version(url) == old


def test_a_retracted_request_survives_a_disk_push_and_reports_both_versions(url, eos_model_dir, tiny_model_dir):
    """Over HTTP, what a push without a gateway does (``DirectControl``): pause ``retract`` with a streamed
    request running, load new weights (the EOS model), continue: the request is not aborted but finishes
    with the new weights' EOS, and its last chunk's ``weight_versions`` spans name both versions, which the
    gateway's client turns into one version per token."""
    from gateway.engine_client import parse_output

    start = int(version(url))
    body = {"input_ids": PROMPT, "stream": True, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 400}}
    chunks: list[dict] = []

    def read() -> None:
        import json

        with httpx.stream("POST", url + "/generate", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[len("data: "):]))

    reader = threading.Thread(target=read)
    try:
        with held_decoding(url, 3):  # armed before the story starts: it is running at 3 tokens when the pause lands
            reader.start()
            wait_held(url)
            assert httpx.post(url + "/pause_generation", json={"mode": "retract"}, timeout=60).status_code == 200
        # cumulative chunks, only the newest of those queued is sent: wait for the one holding 3 tokens
        wait_for(lambda: chunks and len(chunks[-1]["output_ids"]) >= 3, "the streamed chunk with 3 tokens")
        held = len(chunks[-1]["output_ids"])
        assert held == 3
        assert update_from_disk(url, eos_model_dir, flush_cache=False).json()["success"] is True
    finally:
        httpx.post(url + "/continue_generation", json={}, timeout=60)
    reader.join(60)
    try:
        last = chunks[-1]
        meta = last["meta_info"]
        assert meta["finish_reason"] == {"type": "stop", "matched": EOS}  # finished normally, by the new weights
        assert meta["num_retractions"] == 1 and last["output_ids"][-1] == EOS
        n = len(last["output_ids"])
        cut = meta["weight_versions"][0]["end"]
        assert cut >= held and EOS not in last["output_ids"][:cut]
        assert meta["weight_versions"] == [{"version": str(start), "start": 0, "end": cut},
                                           {"version": str(start + 1), "start": cut, "end": n}]
        assert meta["weight_version"] == str(start + 1)
        assert parse_output(last).versions == [start] * cut + [start + 1] * (n - cut)
    finally:
        update_from_disk(url, tiny_model_dir)  # restore for the next test
