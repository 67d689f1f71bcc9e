"""LoRA training (trainer/lora.py): only the adapter trains and has optimizer state, on the float32 path and on
the one-rank bf16 shadow path; checkpoints are peft's layout (peft loads them and computes the same logits);
resume restores adapter and optimizer; merging gives an HF checkpoint with the same logits; an adapter push
(disk and tensor handles) to a real engine process serves the trainer's logprobs at the new version."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from agentrl.settings import SettingsError
from tests.trainer.conftest import engine_generate, engine_version, trainer_logprobs
from tests.trainer.helpers import synthetic_rows
from trainer import checkpoint, lora
from trainer.config import TrainerSettings
from trainer.lora_push import AdapterSync, push_adapter
from trainer.model import build_optimizer, load_model
from trainer.step import train_step
from trainer.weight_sync import DirectControl, WeightSyncError

PROMPT = [1, 9690, 198, 2683, 314, 253, 1345, 30, 2, 198, 1, 520, 9531, 198]
IDS = torch.tensor([PROMPT])


def lora_settings(**extra) -> TrainerSettings:
    return TrainerSettings(engine_urls=["unused"], micro_batch_tokens=4096, lora_rank=4, lora_alpha=8, lr=5e-2,
                           **extra)


def trained(tiny_model_dir, dist_info, steps: int = 2, **extra):
    """A LoRA model, its optimizer and settings after ``steps`` GRPO steps on synthetic batches."""
    settings = lora_settings(**extra)
    torch.manual_seed(0)
    model = load_model(tiny_model_dir, lora=settings.lora, dtype=settings.dtype)
    optimizer = build_optimizer(model, settings, dist_info.device)
    for step in range(steps):
        train_step(model, optimizer, synthetic_rows(seed=step), settings, dist_info, version=step)
    return model, optimizer, settings


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model(input_ids=IDS).logits.float()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_only_the_adapter_trains_and_has_optimizer_state(dtype, tiny_model_dir, dist_info):
    from safetensors.torch import load_file

    from trainer import shadow

    model, optimizer, _ = trained(tiny_model_dir, dist_info, dtype=dtype)
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    names = {id(p): n for n, p in model.named_parameters()}
    stateful = [names[id(p)] for p in optimizer.state]
    adapter = [n for n in names.values() if lora.is_adapter_name(n)]
    assert sorted(stateful) == sorted(adapter) and len(adapter) == 2 * 7 * 2  # A and B of 7 linears in 2 layers
    for name, value in model.state_dict().items():
        if lora.is_adapter_name(name):
            continue
        original = base[name.replace(".base_layer", "").replace("lm_head.", "model.embed_tokens.")]  # (tied)
        assert torch.equal(value.float(), original.to(value.dtype).float()), name  # the base never moves
        assert value.dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]  # no fp32 copy in bf16
    changed = [n for n, p in model.named_parameters() if lora.is_adapter_name(n) and p.abs().sum() > 0 and ".lora_B." in n]
    assert len(changed) == 14  # B starts at zero; two steps moved every B
    if dtype == "bfloat16":  # the shadow holds bf16 leaves of the adapter's float32 masters only
        held = shadow.get(model)
        assert len(held.masters) == len(adapter) and all(m.dtype == torch.float32 for m in held.masters)


def test_targets_rank_and_alpha_are_what_was_asked(tiny_model_dir):
    model = load_model(tiny_model_dir, lora=lora.LoraSpec(8, 16.0, ("q_proj", "v_proj")))
    config = lora.config_of(model)
    assert (config.r, config.lora_alpha, sorted(config.target_modules)) == (8, 16.0, ["q_proj", "v_proj"])
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if lora.is_adapter_name(n)}
    assert adapted == {"q_proj", "v_proj"}
    with pytest.raises(ValueError, match="no linear module of that name"):
        load_model(tiny_model_dir, lora=lora.LoraSpec(8, 16.0, ("qkv",)))
    for bad in ({"lora_rank": -1}, {"lora_rank": 4, "lora_alpha": 0}, {"lora_rank": 4, "sync_mode": "broadcast"}):
        with pytest.raises(SettingsError):
            TrainerSettings(engine_urls=["x"], **bad).validate()


def test_checkpoint_is_pefts_layout_resumes_and_merges(tiny_model_dir, dist_info, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, optimizer, settings = trained(tiny_model_dir, dist_info)
    state = checkpoint.TrainerState(step=2, version=2)
    path = checkpoint.save(tmp_path / "ckpt", state, model, optimizer, dist_info, source_dir=tiny_model_dir)
    assert (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file()
    assert not (path / "model.safetensors").exists()  # the frozen base is not copied into every checkpoint
    saved = json.loads((path / "adapter_config.json").read_text())
    assert (saved["peft_type"], saved["r"], saved["lora_alpha"], saved["base_model_name_or_path"]) == \
        ("LORA", 4, 8, str(tiny_model_dir))

    # peft itself loads it and computes what the trainer's model computes
    by_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                        str(path)).eval()
    model.eval()
    assert (logits(by_peft) - logits(model)).abs().max() < 1e-5
    assert (logits(by_peft) - logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir))).abs().max() > 1e-3

    # resume: the adapter and the optimizer state come back; the next step is the same as without the save
    again = load_model(tiny_model_dir, lora=settings.lora, adapter=lora.resume_adapter(path, settings.lora))
    again_opt = build_optimizer(again, settings, dist_info.device)
    checkpoint.load_optimizer(path, again, again_opt)
    for m, o in ((model, optimizer), (again, again_opt)):
        m.train()
        train_step(m, o, synthetic_rows(seed=7), settings, dist_info, version=2)
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), again.named_parameters()):
        assert n1 == n2 and torch.allclose(p1, p2, atol=1e-7), n1
    with pytest.raises(SettingsError, match="rank 4"):
        lora.resume_adapter(path, lora.LoraSpec(8, 8.0))
    with pytest.raises(SettingsError, match="holds a LoRA adapter"):
        lora.resume_adapter(path, None)

    # merge: a plain HF checkpoint with the base + adapter's logits (the engines' full-weight path loads it)
    merged = lora.merge(path, tiny_model_dir, tmp_path / "merged")
    plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    assert not any("lora" in n for n, _ in plain.named_parameters())
    assert (logits(plain) - logits(by_peft)).abs().max() < 1e-4
    assert (merged / "tokenizer.json").is_file()


@pytest.fixture
def engine(trainer_engine):
    """The trainer tests' engine; the adapters a test loads are unloaded afterwards."""
    yield trainer_engine
    for card in httpx.get(trainer_engine + "/v1/models").json()["data"]:
        if card.get("parent"):
            httpx.post(trainer_engine + "/unload_lora_adapter", json={"lora_name": card["id"]})


def generate_with(url: str, adapter: str, n: int = 12) -> dict:
    resp = httpx.post(f"{url}/generate", json={
        "input_ids": PROMPT, "return_logprob": True, "lora_path": adapter,
        "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True}},
        timeout=120)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    return {"output_ids": body["output_ids"], "version": int(body["meta_info"]["weight_version"]),
            "logprobs": [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]]}


@pytest.mark.parametrize("mode", ["disk", "tensor"])
def test_an_adapter_push_serves_the_trainers_logprobs_at_the_new_version(mode, engine, tiny_model_dir, dist_info,
                                                                          tmp_path):
    model, _, _ = trained(tiny_model_dir, dist_info, steps=0)
    client = httpx.Client(timeout=120)
    transport = AdapterSync("policy", mode, tmp_path / "sync", client)
    control = DirectControl([engine], client=client)
    start = engine_version(engine)
    base = engine_generate(engine, PROMPT, 12, seed=3)
    push_adapter(model, start, info=dist_info, transport=transport, control=control)  # v0: B = 0, the base
    assert generate_with(engine, "policy")["output_ids"] == base["output_ids"]

    settings = lora_settings()
    optimizer = build_optimizer(model, settings, dist_info.device)
    for step in range(3):
        train_step(model, optimizer, synthetic_rows(seed=step), settings, dist_info, version=step)
    result = push_adapter(model, start + 1, info=dist_info, transport=transport, control=control)
    assert result.bytes == lora.adapter_bytes(model) < 0.05 * sum(p.numel() * 4 for p in model.parameters())
    out = generate_with(engine, "policy")
    assert out["version"] == start + 1 == engine_version(engine)
    model.eval()
    gap = (trainer_logprobs(model, PROMPT, out["output_ids"]) - torch.tensor(out["logprobs"])).abs().max().item()
    assert gap < 1e-4, f"engine-vs-trainer logprob gap {gap:.2e}"
    assert max(abs(a - b) for a, b in zip(out["logprobs"], base["logprobs"])) > 1e-3  # the adapter moved them
    assert engine_generate(engine, PROMPT, 12, seed=3)["output_ids"] == base["output_ids"]  # the base still serves
    if mode == "disk":  # the served adapter is a peft directory, kept with the one before it
        assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["policy-v%d" % start, "policy-v%d" % (start + 1)]


def test_a_refused_adapter_push_keeps_the_old_adapter_and_version(engine, tiny_model_dir, dist_info, tmp_path):
    model, _, _ = trained(tiny_model_dir, dist_info, steps=2)
    client = httpx.Client(timeout=120)
    transport = AdapterSync("policy", "disk", tmp_path / "sync", client)
    control = DirectControl([engine], client=client)
    start = engine_version(engine)
    push_adapter(model, start + 1, info=dist_info, transport=transport, control=control)
    served = generate_with(engine, "policy")
    bad = AdapterSync("policy", "disk", tmp_path / "sync", client)
    bad.served = transport.served

    def corrupt(model_, version, info):  # a staged directory the engine cannot read
        target = tmp_path / "sync" / f"policy-v{version}"
        target.mkdir(parents=True)
        (target / "adapter_config.json").write_text("{not json")
        (target / "adapter_model.safetensors").write_bytes(b"")
        return target

    bad.stage = corrupt
    with pytest.raises(WeightSyncError, match="keep serving version"):
        push_adapter(model, start + 2, info=dist_info, transport=bad, control=control, retries=2, backoff_s=0)
    assert engine_version(engine) == start + 1
    again = generate_with(engine, "policy")
    assert again["output_ids"] == served["output_ids"] and again["version"] == start + 1
    assert httpx.get(engine + "/get_server_info").json()["internal_states"][0]["paused"] is None  # resumed


def test_export_model_writes_the_adapter_or_the_merged_model(tiny_model_dir, dist_info, tmp_path):
    import subprocess
    import sys

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.conftest import REPO

    model, optimizer, _ = trained(tiny_model_dir, dist_info)
    ckpt = checkpoint.save(tmp_path / "ckpt", checkpoint.TrainerState(step=2, version=2), model, optimizer,
                           dist_info, source_dir=tiny_model_dir)

    def export(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "agentrl", "export-model", "--checkpoint", str(ckpt), *args],
                              cwd=REPO, capture_output=True, text=True, timeout=300)

    done = export("--out", str(tmp_path / "adapter"))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    done = export("--out", str(tmp_path / "merged"), "--merge", "--model", "tiny")
    assert done.returncode == 0, done.stderr
    by_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                        str(tmp_path / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert (logits(merged) - logits(by_peft)).abs().max() < 1e-4
    refused = export("--out", str(tmp_path / "merged"), "--merge")  # not empty
    assert refused.returncode == 2 and "not empty" in refused.stderr
    full = subprocess.run([sys.executable, "-m", "agentrl", "export-model", "--checkpoint", str(tmp_path / "merged"),
                           "--out", str(tmp_path / "again"), "--merge"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert full.returncode == 2 and "nothing to merge" in full.stderr


class GatewayThenEngine(httpx.BaseTransport):
    """The gateway faked at the HTTP boundary (tests/trainer/test_loop.py's FakeGateway, host ``gw``); every other
    host is real HTTP (the engine process)."""

    def __init__(self, gateway) -> None:
        self.fake, self.real = httpx.MockTransport(gateway.handler), httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return (self.fake if request.url.host == "gw" else self.real).handle_request(request)


@pytest.mark.slow
def test_train_with_lora_pushes_adapters_checkpoints_them_and_resumes(engine, tiny_model_dir, dist_info, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from agentrl.settings import load as load_settings
    from tests.trainer.test_loop import FakeGateway
    from trainer.loop import train

    def settings(**extra):
        return load_settings(TrainerSettings, env={}, gateway="http://gw", admin_key="k", model="tiny",
                             engine_urls=[engine], sync_mode="disk", checkpoint_dir=str(tmp_path / "ckpt"),
                             lr=5e-2, group_size=3, batch_groups=2, micro_batch_tokens=4096, lease_wait_s=0.01,
                             max_idle_s=0.05, lora_rank=4, lora_alpha=8, **extra)

    gw = FakeGateway([synthetic_rows(2, 3, seed=1), synthetic_rows(2, 3, seed=2)])
    with httpx.Client(transport=GatewayThenEngine(gw), timeout=120) as http:
        state = train(settings(steps=2, save_every=1), http=http)
    assert (state.step, state.version) == (2, 2) and gw.acked == ["lease-1", "lease-2"]
    pauses = [path for path, _ in gw.admin if path in ("/admin/pause", "/admin/resume")]
    assert pauses == ["/admin/pause", "/admin/resume"] * 3  # the first adapter at start, then one per step
    ckpt = checkpoint.latest(tmp_path / "ckpt")
    assert lora.is_adapter_dir(ckpt) and not (ckpt / "model.safetensors").exists()

    # the engine serves the checkpoint's adapter at the trainer's version (each push sets it, whatever it was)
    assert engine_version(engine) == 2
    out = generate_with(engine, "policy")
    assert out["version"] == 2
    trained_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                              str(ckpt)).eval()
    gap = (trainer_logprobs(trained_model, PROMPT, out["output_ids"]) - torch.tensor(out["logprobs"])).abs().max()
    assert gap < 1e-4

    # resume: the adapter and the step count come back, the adapter is pushed again before training goes on
    gw2 = FakeGateway([synthetic_rows(2, 3, seed=3)])
    with httpx.Client(transport=GatewayThenEngine(gw2), timeout=120) as http:
        state = train(settings(steps=1), http=http)
    assert (state.step, state.version) == (3, 3) and engine_version(engine) == 3
    metrics = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == [1, 2, 3]
    assert all(m["sync/seconds"] > 0 for m in metrics)
    with pytest.raises(SettingsError, match="holds a LoRA adapter"):  # full fine-tuning cannot resume an adapter
        train(load_settings(TrainerSettings, env={}, gateway="http://gw", admin_key="k", model="tiny",
                            sync_mode="none", checkpoint_dir=str(tmp_path / "ckpt")), http=httpx.Client())
