"""gateway.memory: glibc's free heap pages go back to the system; the arena cap is accepted; the trim loop
runs until cancelled."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest

from gateway import memory

glibc = pytest.mark.skipif(memory._libc() is None, reason="not glibc's malloc")

# a process that fills its heap with 4 KB blocks, frees all but every 64th (the kept ones pin pages
# scattered over the heap, so nothing is released by free itself), then trims; prints RSS in MB each time
_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from gateway import memory

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    memory.limit_arenas(2)
    base = rss_mb()
    blocks = [bytes(4000) + str(k).encode() for k in range(60_000)]
    full = rss_mb()
    kept = blocks[::64]
    del blocks
    freed = rss_mb()
    released = memory.trim()
    print(base, full, freed, rss_mb(), released, len(kept))
""")


@glibc
def test_trim_gives_freed_heap_pages_back() -> None:
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", _CHILD, repo], capture_output=True, text=True, check=True).stdout
    base, full, freed, trimmed, released, _ = out.split()
    base, full, freed, trimmed = float(base), float(full), float(freed), float(trimmed)
    assert full - base > 200, out  # ~240 MB of blocks
    assert freed - base > 150, out  # free() alone keeps nearly all of it (the kept blocks pin the pages)
    assert released == "True" and trimmed - base < 0.3 * (freed - base), out


@glibc
def test_the_arena_cap_is_accepted() -> None:
    assert memory.limit_arenas(2) is True


async def test_trim_loop_runs_until_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(memory, "trim", lambda: calls.append(1) or True)
    monkeypatch.setattr(memory, "_libc", lambda: object())
    task = asyncio.ensure_future(memory.trim_loop(0.01))
    while len(calls) < 3:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    count = len(calls)
    await asyncio.sleep(0.05)
    assert len(calls) == count
