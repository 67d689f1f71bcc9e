"""docs/own-agent.md, run: every code block of the tutorial, in order, on the tiny model (MODEL=tiny).

Real processes throughout: `agentrl up --agent`, `agentrl eval`, `agentrl serve` and a program using
`agentrl.client`, each starting its own engine, gateway and trainer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.run_markdown import blocks, script_of

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "own-agent.md"


def test_every_code_block_is_run_or_is_output():
    kinds = [(lang, attrs) for lang, attrs, _ in blocks(PAGE.read_text())]
    _, used = script_of(PAGE)
    assert used == len(kinds), f"blocks that would not run: {kinds}"


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_tutorial_end_to_end_on_the_tiny_model(tmp_path, tiny_model_dir):
    script, _ = script_of(PAGE)
    (tmp_path / "tutorial.sh").write_text(script)
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "MODEL": "tiny", "PYTHONUNBUFFERED": "1", "PATH": bin_dir + os.pathsep + os.environ["PATH"],
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run(["bash", "tutorial.sh"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=1450)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]

    summary = json.loads((tmp_path / "runs/tutorial/summary.json").read_text())
    assert summary["steps"] == 2 and summary["eval_before"]["mean_reward"] is not None
    checkpoint = Path(summary["checkpoint"])
    assert (checkpoint / "config.json").is_file() and any(checkpoint.glob("*.safetensors"))
    metrics = [json.loads(line) for line in (tmp_path / "runs/tutorial/trainer/metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["batch/sessions"] == 8 for m in metrics)
    assert all(len(m["batch/group_ids"]) == 2 for m in metrics)
    assert any(not m.get("skipped") for m in metrics)  # the shaping reward varies: at least one step trained

    report = json.loads((tmp_path / "runs/tutorial-eval/eval.json").read_text())
    assert report["tasks"] == 8 and report["difference"]["tasks_compared"] == 8
    assert report["checkpoint"]["model"] == str(checkpoint.resolve())
    assert len(report["difference"]["ci95"]) == 2

    served = [json.loads(line) for line in (tmp_path / "runs/served/trainer/metrics.jsonl").read_text().splitlines()]
    assert len(served) == 1 and served[0]["batch/task_ids"] == ["task-0", "task-1"]
    assert "task-0 [[(None," in output  # the client's program printed each episode's posted reward
