"""bench/lora_push.py on CPU: full and adapter pushes (disk and tensor handles) to a real engine process on the
tiny shape; the engine serves each pushed adapter with the trainer's logprobs at the pushed version."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_lora_push_bench_cpu_mode(tmp_path):
    cmd = [sys.executable, str(REPO / "bench" / "lora_push.py"), "--model-shape", "tiny", "--repeats", "1",
           "--ranks", "4", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": "", "AGENTRL_HOME": str(tmp_path / "home")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {r["variant"]: r for r in json.loads((tmp_path / "lora_push.json").read_text())["rows"]}
    assert set(rows) == {"full disk", "full tensor", "lora4 disk", "lora4 tensor"}
    assert all(r["seconds"] > 0 for r in rows.values())
    assert rows["lora4 disk"]["bytes"] < 0.01 * rows["full disk"]["bytes"]
    assert rows["lora4 disk"]["logprob_gap"] < 1e-4 and rows["lora4 tensor"]["logprob_gap"] < 1e-4
