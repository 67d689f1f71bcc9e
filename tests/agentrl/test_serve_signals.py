"""`agentrl serve` stops everything on SIGTERM as on Ctrl-C: real engine, gateway and trainer processes.

Before, SIGTERM ended `serve` at once (Python's default action runs no ``finally``), and its gateway ran on
for ~15 s with a traceback until the parent-death signal reached it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _descendants(root: int) -> set[int]:
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _names(pids: set[int]) -> str:
    out = []
    for pid in sorted(pids):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            out.append(f"{pid}: {cmdline[:120]}")
        except OSError:
            pass
    return "\n".join(out)


def test_serve_stops_every_process_on_sigterm_and_exits_cleanly(tmp_path, tiny_model_dir):
    out = tmp_path / "served"
    proc = subprocess.Popen([sys.executable, "-m", "agentrl", "serve", "--model", "tiny", "--port", str(free_port()),
                             "--out-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        for line in proc.stdout:  # until it says it is ready (or ends: then the output says why)
            lines.append(line)
            if "agentrl serve: ready" in line:
                break
        assert "agentrl serve: ready" in "".join(lines), "".join(lines)[-4000:]
        started = _descendants(proc.pid)
        commands = _names(started)
        for role in ("engine", "gateway", "train"):
            assert f"agentrl {role}" in commands, commands

        proc.send_signal(signal.SIGTERM)
        rest = proc.stdout.read()
        assert proc.wait(timeout=120) == 0, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "stopped; every process it started has been stopped" in rest
    assert "Traceback" not in rest, rest
    # every process it started, and theirs, is gone (the hang guard only bounds a failure)
    guard = time.monotonic() + 60
    while any(_alive(pid) for pid in started) and time.monotonic() < guard:
        time.sleep(0.1)
    assert not [pid for pid in started if _alive(pid)], _names({pid for pid in started if _alive(pid)})
    assert not list((out / "trainer" / "sync").glob("v*"))
