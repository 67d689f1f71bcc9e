"""LoRA under FSDP2 on CPU: a GRPO step of the adapter on two gloo processes equals the step on one process,
only the adapter has optimizer state, and the two ranks write one checkpoint in peft's layout."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.test_fsdp import _torchrun

WORKER = """
import sys
import torch
from engine.models import tiny_dir
from tests.trainer.helpers import synthetic_rows
from trainer import checkpoint, lora
from trainer.config import TrainerSettings
from trainer.model import build_optimizer, close_distributed, init_distributed, load_model
from trainer.step import train_step

def one_step(budget, out_dir=None):
    info = init_distributed("cpu")
    torch.manual_seed(0)
    settings = TrainerSettings(engine_urls=["unused"], micro_batch_tokens=budget, is_cap=2.0, lora_rank=4,
                               lora_alpha=8, lr=1e-2)
    model = load_model(tiny_dir(), lora=settings.lora)
    optimizer = build_optimizer(model, settings, info.device)
    for step in range(2):  # B starts at zero: the second step moves A too
        metrics = train_step(model, optimizer, synthetic_rows(n_groups=3, group_size=3, seed=step), settings, info,
                             version=step)
    adapter = dict(lora.adapter_tensors(model, to_cpu=True))
    stateful = len(optimizer.state)
    if out_dir is not None:
        checkpoint.save(out_dir, checkpoint.TrainerState(step=2, version=2), model, optimizer, info, source_dir=None)
    return {"metrics": metrics, "adapter": adapter, "stateful": stateful, "world_size": info.world_size,
            "rank": info.rank}

if __name__ == "__main__":
    result = one_step(int(sys.argv[2]), sys.argv[3])
    if result["rank"] == 0:
        torch.save(result, sys.argv[1])
    close_distributed(finished=True)
"""


@pytest.mark.slow
def test_two_process_lora_step_equals_one_process_step(tmp_path):
    import importlib.util

    from safetensors.torch import load_file

    worker = tmp_path / "lora_worker.py"
    worker.write_text(WORKER)
    spec = importlib.util.spec_from_file_location("lora_worker", worker)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    one = module.one_step(4096)  # this process (a one-process group), the whole batch in one micro-batch

    proc = _torchrun(2, worker, str(tmp_path / "two.pt"), "40", str(tmp_path / "ckpt"), timeout_s=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    two = torch.load(tmp_path / "two.pt", weights_only=False)
    assert two["world_size"] == 2
    assert one["stateful"] == len(one["adapter"]) == 28  # A and B of 7 linears x 2 layers; nothing else
    assert two["stateful"] == 28  # rank 0's AdamW: its shards of the same 28 adapter tensors, no base weight
    m1, m2 = one["metrics"], two["metrics"]
    assert m2["actor/loss"] == pytest.approx(m1["actor/loss"], abs=1e-6)
    assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-5)
    assert one["adapter"].keys() == two["adapter"].keys()
    for key, t1 in one["adapter"].items():
        # AdamW moves each element by about lr (1e-2) whatever its gradient's size, so an element whose gradient
        # is near eps turns the two runs' reduction orders into a visible difference (as in test_fsdp.py): every
        # element within 1% of lr, all but a rare few within 0.1%, and the mean far tighter
        diff = (t1 - two["adapter"][key]).abs()
        assert diff.max() <= 1e-4, f"{key}: max diff {diff.max():.2e}"
        assert (diff > 1e-5).sum() <= max(1, diff.numel() // 1000), key
        assert diff.mean() <= 1e-7, f"{key}: mean diff {diff.mean():.2e}"
    assert all(t.abs().sum() > 0 for t in one["adapter"].values())  # both steps together moved A and B

    saved = tmp_path / "ckpt" / "step_000002"
    assert (saved / "adapter_config.json").is_file() and (saved / "optimizer").is_dir()
    on_disk = load_file(str(saved / "adapter_model.safetensors"))
    assert on_disk.keys() == two["adapter"].keys()
    assert all(torch.equal(on_disk[k], two["adapter"][k]) for k in on_disk)
