"""bench/lifecycle_moves.py end to end on SQLite (small): both scenarios run, each tick in a child process,
with this tree as its own base, and each tick moves every seeded session."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_bench_moves_every_seeded_session_in_each_tree() -> None:
    done = subprocess.run([sys.executable, str(REPO / "bench" / "lifecycle_moves.py"), "--db", "sqlite",
                           "--sessions", "40", "--runs", "1", "--base", str(REPO)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(r"^(abandon|idle)\s+r0 (this|base)\s+tick .* abandoned\s+(\d+) finished\s+(\d+)", done.stdout,
                      flags=re.MULTILINE)
    assert sorted(rows) == [("abandon", "base", "40", "0"), ("abandon", "this", "40", "0"),
                            ("idle", "base", "0", "40"), ("idle", "this", "0", "40")], done.stdout
    assert re.search(r"^abandon  median: .* -> base / this: [\d.]+x wall", done.stdout, flags=re.MULTILINE)
