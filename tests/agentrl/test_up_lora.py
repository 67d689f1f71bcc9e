"""`agentrl up --lora-rank R` end to end on the tiny model: the trainer trains and pushes only a peft adapter,
the embedded engine serves it to every request (``--default-lora``), and the final evaluation is sampled
from the trained adapter (its recorded logprobs are base + adapter's, not the base model's)."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gateway.conftest import full_sequences, read_turns

pytestmark = pytest.mark.slow

STEPS = 2


def model_logprobs(model: torch.nn.Module, full: list[int], n_out: int) -> list[float]:
    from trainer.model import token_logprobs

    ids = torch.tensor([full])
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    return lp[0, len(full) - 1 - n_out:].tolist()


def test_up_lora_pushes_the_adapter_and_evaluates_with_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "run"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "question": f"What is {i} + {i}?"}) + "\n" for i in range(4)))
    cmd = [sys.executable, "-m", "agentrl", "up", "--model", "tiny", "--lora-rank", "4", "--lora-alpha", "32",
           "--agent", "tests.agentrl.spread_agent:episode", "--dataset", str(tasks), "--out-dir", str(out),
           "--steps", str(STEPS), "--batch-groups", "1", "--group-size", "4", "--eval-limit", "2",
           "--concurrency", "4", "--lr", "1e-2"]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stdout[-6000:]
    assert "peft adapter" in done.stdout

    summary = json.loads((out / "summary.json").read_text())
    assert summary["lora"] == {"rank": 4, "alpha": 32.0, "targets": "all-linear", "name": "policy"}
    checkpoint = Path(summary["checkpoint"])
    assert (checkpoint / "adapter_config.json").is_file() and (checkpoint / "adapter_model.safetensors").is_file()
    assert not (checkpoint / "model.safetensors").exists()  # the frozen base is not copied
    assert json.loads((checkpoint / "adapter_config.json").read_text())["r"] == 4

    metrics = [json.loads(x) for x in (out / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == list(range(1, STEPS + 1))
    assert not any(m.get("skipped") for m in metrics), metrics  # every step trained and pushed
    # the engine loaded the adapter: once at the trainer's start (zero), then once per step
    engine_log = (out / "logs" / "engine.log").read_text(errors="replace")
    loads = re.findall(r"LoRA adapter 'policy' \(rank 4, .*\) from \S+/trainer/sync/policy-v(\d+) ", engine_log)
    assert loads == [str(v) for v in range(STEPS + 1)], engine_log[-3000:]

    db = out / "gateway.db"
    with sqlite3.connect(db) as conn:
        ids = [row[0] for row in conn.execute("select id from interactions order by created_at")]
    url = f"sqlite+aiosqlite:///{db}"
    turns, fulls = read_turns(url, ids), full_sequences(url, ids)
    last = [k for k, t in enumerate(turns) if set(t.output_versions) == {STEPS}]
    assert last, [t.output_versions for t in turns]  # the evaluation after training

    from trainer.lora import LoraSpec
    from trainer.model import load_model

    trained = load_model(tiny_model_dir, lora=LoraSpec(4, 32.0, ("all-linear",)), adapter=checkpoint)
    base = load_model(tiny_model_dir)
    for k in last:  # sampled from base + the trained adapter, not from the base model
        n = len(turns[k].output_ids)
        recorded = list(turns[k].output_logprobs)
        assert model_logprobs(trained, fulls[k], n) == pytest.approx(recorded, abs=1e-3), k
        assert model_logprobs(base, fulls[k], n) != pytest.approx(recorded, abs=1e-4), k
