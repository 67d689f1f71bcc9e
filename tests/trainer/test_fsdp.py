"""FSDP2 on CPU: a GRPO step on two gloo processes equals the same step on one process; a rank dying first
does not hang the others."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, free_port

WORKER = Path(__file__).with_name("fsdp_worker.py")


def _torchrun(nproc: int, script: Path, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``script`` on ``nproc`` gloo ranks under torchrun (its output captured)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)


def _run(nproc: int, out: Path, budget: int) -> dict:
    proc = _torchrun(nproc, WORKER, str(out), str(budget), timeout_s=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_two_process_step_equals_one_process_step(tmp_path, tiny_model_dir):
    from tests.trainer.fsdp_worker import one_step

    one = one_step(budget=4096)  # in this process (a one-process group), the whole batch in one micro-batch
    two = _run(2, tmp_path / "two.pt", budget=40)  # two ranks, several micro-batches each
    assert two["world_size"] == 2
    m1, m2 = one["metrics"], two["metrics"]
    assert m2["actor/loss"] == pytest.approx(m1["actor/loss"], abs=1e-6)
    assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-5)
    assert m2["batch/loss_tokens"] == m1["batch/loss_tokens"]
    assert m2["actor/entropy"] == pytest.approx(m1["actor/entropy"], rel=1e-5)
    assert one["weights"].keys() == two["weights"].keys()
    changed = 0
    base = {}
    from safetensors.torch import load_file

    base = load_file(str(tiny_model_dir / "model.safetensors"))
    for name, w1 in one["weights"].items():
        w2 = two["weights"][name]
        # AdamW moves each element by about lr (1e-3) whatever its gradient's size, so an element whose gradient
        # is near eps turns the two runs' different reduction orders into a visible difference: bound every
        # element by 1% of lr, and all but a rare few (and the mean) far tighter.
        diff = (w1 - w2).abs()
        assert diff.max() <= 1e-5, f"{name}: max diff {diff.max():.2e}"
        assert (diff > 1e-6).sum() <= max(1, diff.numel() // 1000), f"{name}: {(diff > 1e-6).sum()} elements > 1e-6"
        assert diff.mean() <= 1e-8, f"{name}: mean diff {diff.mean():.2e}"
        changed += int(not torch.equal(w1, base[name]))
    assert changed == len(one["weights"])  # the step did update every tensor


DIES = """
import sys
from trainer.model import close_distributed, init_distributed
info = init_distributed("cpu")
if info.rank == 1:
    sys.exit(3)  # this rank dies before the end of the run
close_distributed(finished=True)  # the other waits at the barrier for a rank that never comes
print(f"rank {info.rank} left the barrier", flush=True)
"""


def test_a_rank_dying_before_the_closing_barrier_does_not_leave_the_others_waiting(tmp_path):
    """``close_distributed(finished=True)`` meets the other ranks at a barrier. When one rank dies first,
    torchrun stops the rank waiting there and fails the job at once, naming the rank that died, instead of
    the job hanging until the process group's timeout (30 minutes)."""
    worker = tmp_path / "dies.py"
    worker.write_text(DIES)
    proc = _torchrun(2, worker, timeout_s=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "left the barrier" not in out
    root_cause = out.split("Root Cause", 1)[-1]
    assert "local_rank: 1" in root_cause and "exitcode  : 3" in root_cause, out[-3000:]
