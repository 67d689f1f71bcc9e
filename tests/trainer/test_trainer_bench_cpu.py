"""bench/trainer.py on CPU: the GPU benchmark's code path (naive step, unpacked step, our step, the
one-rank FSDP2 step) on the tiny model, in a subprocess; its packed-vs-unpacked checks must pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_trainer_bench_cpu_mode(tmp_path, tiny_model_dir):
    cmd = [sys.executable, str(REPO / "bench" / "trainer.py"), "--device", "cpu", "--model", "tiny",
           "--rows", "4", "--seq-len", "32", "--agent-rows", "8", "--agent-min", "10", "--agent-max", "40",
           "--steps", "2", "--variants", "naive,unpacked,ours,ours-fsdp", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "trainer_bench.json").read_text())
    for batch in ("uniform", "agent"):
        variants = result["results"][batch]
        assert all(isinstance(variants[v], dict) and variants[v]["tokens_per_s"] > 0
                   for v in ("naive", "unpacked", "ours", "ours-fsdp")), variants
        # the same step with and without FSDP2 on one rank: same numbers (float32 on CPU)
        assert variants["ours"]["first"]["loss"] == pytest.approx(variants["ours-fsdp"]["first"]["loss"], rel=1e-6)
    packed = [c for c in result["checks"] if "packed" in c["check"]]
    assert len(packed) == 8 and all(c["ok"] for c in packed), packed
