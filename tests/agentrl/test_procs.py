"""Children of a supervisor (``agentrl up``, the tests' fixtures) die with it, whatever signal ended it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

SUPERVISOR = """
import sys, time
from pathlib import Path
from agentrl.procs import Processes
procs = Processes(Path(sys.argv[1]))
child = procs.start("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
print(child.proc.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for init to reap it counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_children_die_when_their_supervisor_is_killed(tmp_path: Path, sig: signal.Signals) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(tmp_path)], stdout=subprocess.PIPE,
                                  env=env, text=True)
    child_pid = 0
    try:
        assert supervisor.stdout is not None
        child_pid = int(supervisor.stdout.readline())
        assert _alive(child_pid)
        supervisor.send_signal(sig)  # SIGTERM's default action also skips every __exit__
        supervisor.wait(timeout=30)
        deadline = time.monotonic() + 20
        while _alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child_pid), f"child {child_pid} outlived its supervisor killed by {sig.name}"
    finally:
        supervisor.kill()
        supervisor.wait()
        if child_pid and _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)
