"""bench/chaos.py in its shortest form, bounded by counts: 20 agents on two gateway replicas (PostgreSQL +
Redis of the bench's own), two engines and the trainer; five faults (kill -9 or SIGSTOP of a random part),
each injected once 25 more turns were acknowledged; the run stops once the faults are over, 150 turns are
acknowledged, 4 groups are trained and the trainer has stepped after the last recovery. The history's
invariants (bench/chaos_check.py) must all hold. The timeout is only a hang guard."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_chaos_short_form_has_no_violations(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    done = subprocess.run([sys.executable, str(REPO / "bench" / "chaos.py"), "--seed", "36", "--agents", "20",
                           "--faults", "5", "--every-turns", "25", "--turns", "150", "--groups", "4",
                           "--down", "1,4", "--hang-s", "2000", "--out", str(tmp_path / "chaos")],
                          capture_output=True, text=True, timeout=2300, cwd=REPO)
    history = tmp_path / "chaos" / "history.jsonl"
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
    assert re.search(r"^0 violation\(s\)", done.stdout, flags=re.MULTILINE), done.stdout[-3000:]
    events = [json.loads(line) for line in history.read_text().splitlines()]
    faults = [e for e in events if e["k"] == "fault"]
    assert len(faults) == 5 and len([e for e in events if e["k"] == "recover"]) == 5
    assert sum(e["k"] == "turn" for e in events) >= 150
    assert len({g for e in events if e["k"] == "train" for g in e["groups"]}) >= 4
    assert sum(e["k"] == "db_turn" for e in events) >= 150  # the store was read back
