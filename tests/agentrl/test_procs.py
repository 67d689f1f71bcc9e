"""Children of a supervisor (``agentrl up``, the tests' fixtures) die with it, whatever signal ended it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.agentrl.processes import alive
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
        assert alive(child_pid)
        supervisor.send_signal(sig)  # SIGTERM's default action also skips every __exit__
        supervisor.wait(timeout=30)
        deadline = time.monotonic() + 120  # a hang guard: the child exits on its parent-death signal
        while alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(child_pid), f"child {child_pid} outlived its supervisor killed by {sig.name}"
    finally:
        supervisor.kill()
        supervisor.wait()
        if child_pid and alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)
