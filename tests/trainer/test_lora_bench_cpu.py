"""bench/lora.py on CPU: the GPU benchmark's code path (full fine-tuning and two LoRA ranks, each variant in its
own process) on the tiny model; its check (every variant's first step sees the base model) must pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_lora_bench_cpu_mode(tmp_path, tiny_model_dir):
    cmd = [sys.executable, str(REPO / "bench" / "lora.py"), "--device", "cpu", "--model", "tiny", "--rows", "2",
           "--seq-len", "32", "--agent-rows", "4", "--agent-min", "10", "--agent-max", "40", "--steps", "2",
           "--variants", "full,lora4,lora8", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "lora_bench.json").read_text())
    by_name = {r["variant"]: r for r in result["results"]}
    assert list(by_name) == ["full", "lora4", "lora8"]
    assert all(b["tokens_per_s"] > 0 for r in by_name.values() for b in r["batches"].values())
    # rank 8 has twice rank 4's adapter, and both are a small part of the model and of its push
    assert by_name["lora8"]["trainable_params"] == 2 * by_name["lora4"]["trainable_params"]
    assert by_name["lora8"]["push_bytes"] < 0.1 * by_name["full"]["push_bytes"]
    assert by_name["full"]["trainable_params"] == by_name["full"]["total_params"]
    adapter = by_name["lora4"]["trainable_params"]  # AdamW: two float32 moments each, and a step count per tensor
    assert 8 * adapter <= by_name["lora4"]["optimizer_state_bytes"] <= 8 * adapter + 4 * 28
    assert len(result["checks"]) == 4 and all(c["ok"] for c in result["checks"]), result["checks"]
    assert (tmp_path / "lora_bench.md").read_text().count("| lora8 |") == 2
