"""bench/two_gpu.py on CPU: the two-GPU run's code path with gloo, the tiny model and two processes.

The same command that runs on two GPUs (``--device cuda``) runs here with ``--device cpu --model tiny``: a
2-rank FSDP2 GRPO step against a 1-rank one, and disk + broadcast pushes to a real engine process with the
raw-broadcast floor, the version check and the logprob check. Every check the script makes must pass.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_two_gpu_bench_cpu_mode(tmp_path, tiny_model_dir):
    cmd = [sys.executable, str(REPO / "bench" / "two_gpu.py"), "--device", "cpu", "--model", "tiny",
           "--rows", "4", "--seq-len", "32", "--steps", "1", "--pushes", "1", "--gen-tokens", "8",
           "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    result = json.loads((tmp_path / "two_gpu.json").read_text())
    assert (tmp_path / "two_gpu.md").read_text().startswith("## Two-GPU run")
    checks = {c["check"]: c for c in result["checks"]}
    assert all(c["ok"] for c in checks.values()), [c for c in checks.values() if not c["ok"]]
    # the step ran on 2 ranks and on 1 and was compared (loss, grad norm, entropy, loss tokens)
    one, two = result["step"]["1 rank"], result["step"]["2 ranks"]
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert sum(k.startswith("step:") for k in checks) == 4
    assert two["loss_tokens"] == one["loss_tokens"] > 0 and one["grad_norm"] > 0
    # every push mode and both floors were timed; the engine ended at version 1 (disk) + 1 (tensor handles)
    # + 2 (broadcast, the first one forming the group) = 4
    modes = [r["mode"] for r in result["push"]]
    assert any(m.startswith("floor: raw gloo broadcast") for m in modes)
    assert any(m.startswith("disk") for m in modes)
    assert sum(m.startswith("broadcast (gloo") for m in modes) == 2
    assert all(math.isfinite(r["seconds"]) and r["seconds"] > 0 for r in result["push"])
    assert any(m.startswith("tensor handles (/update_weights_from_tensor)") for m in modes)
    assert checks["after tensor pushes (v2): engine weight version"]["ok"]
    assert checks["after broadcast pushes (v4): engine weight version"]["ok"]
    assert any("output differs" in k and k.startswith("after disk") for k in checks)
