"""bench/memtrace.py's census and diff in this process: what a test allocates between two census files is
found by source line and by type, and the in-process caches are counted."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

from bench.memtrace import caches, census, diff


def _line(text: str) -> int:
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if text in line)


class Held:
    def __init__(self, i: int) -> None:
        self.payload = bytearray(1000 + i % 7)


def test_diff_names_the_line_and_type_that_grew(tmp_path: Path) -> None:
    caches([])  # imports the gateway modules whose caches it counts, before the tracing
    tracemalloc.start(5)
    try:
        census(tmp_path, 0)
        held = [Held(i) for i in range(5000)]  # ~5 MB of payloads
        census(tmp_path, 1)
    finally:
        tracemalloc.stop()
    got = diff(tmp_path, 0, 1)
    top = got["lines_grew"][0]
    assert top["where"] == f"{__file__}:{_line('bytearray(1000')}" and top["grew_kb"] > 4500
    assert f"{__file__}:{_line('held = [Held(i)')}" in top["stack"], top  # allocated for the list
    assert got["types_grew"]["Held"] == 5000
    assert got["traced_mb"][1] - got["traced_mb"][0] > 4.5
    assert "normalize._plain_link" in got["caches"]
    assert json.loads((tmp_path / "census-1.json").read_text())["rss_mb"] > 0
    del held
