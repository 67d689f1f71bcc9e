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

import pytest

from tests.agentrl.processes import alive, commands, descendants
from tests.conftest import free_port

pytestmark = pytest.mark.slow


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
        started = descendants(proc.pid)
        running = commands(started)
        for role in ("engine", "gateway", "train"):
            assert f"agentrl {role}" in running, running

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
    while any(alive(pid) for pid in started) and time.monotonic() < guard:
        time.sleep(0.1)
    assert not [pid for pid in started if alive(pid)], commands({pid for pid in started if alive(pid)})
    assert not list((out / "trainer" / "sync").glob("v*"))
