"""Run a command of ``agentrl``, trace its allocations from the first SIGUSR1 on, and at each SIGUSR1 write
what its memory holds.

    python bench/memtrace.py --out DIR [--frames 10] -- gateway --db ... (the ``agentrl`` arguments)

Tracing starts at the first signal, not at start-up: importing torch and transformers under tracemalloc
takes minutes. Allocations made before it are not seen, so compare censuses taken after it. Each SIGUSR1
writes ``DIR/snap-N.tracemalloc`` (a ``tracemalloc`` snapshot) and ``DIR/census-N.json``: RSS,
the bytes tracemalloc traces (Python's allocators) beside glibc's own count (``mallinfo2``: bytes in use and
bytes free but kept), the number of live objects of each type, asyncio tasks, and the entries of each
in-process cache of the gateway. :func:`diff` compares two of them. ``bench/soak.py --trace-memory`` uses
it to say what grows between the warm-up and the end of a soak.

Tracing slows the traced process (every allocation is recorded), so a traced soak says where memory
goes, not how fast the gateway is; the soak's RSS figure comes from an untraced run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import gc
import json
import signal
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def malloc_info() -> dict[str, float]:
    """glibc's heap in MB: ``in_use`` (malloc'd, mmapped blocks included), ``free_kept`` (freed, not returned)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    mb = 1024 * 1024
    return {"arena_mb": info.arena / mb, "mmapped_mb": info.hblkhd / mb, "in_use_mb": (info.uordblks + info.hblkhd) / mb,
            "free_kept_mb": info.fordblks / mb}


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def caches(objects: list[Any]) -> dict[str, Any]:
    """Entries of each in-process cache of the gateway, found among the live objects."""
    from gateway.binding import ImplicitIndex
    from gateway.chat import normalize
    from gateway.chat.template import ChatTemplate
    from gateway.engine_client import EngineRouter
    from gateway.lifecycle import InFlight
    from gateway.store.api import Store

    out: dict[str, Any] = {"normalize._plain_link": normalize._plain_link.cache_info().currsize,
                           "normalize._long_links": len(normalize._long_links),
                           "normalize._long_links.chars": normalize._long_links.chars}
    for obj in objects:
        kind = type(obj)
        if kind is Store:
            out.update({"store.seqs": len(obj._seqs._items), "store.seq_tokens": obj._seqs.tokens,
                        "store.turns": len(obj._turns._items), "store.sessions": len(obj._sessions),
                        "store.chains": len(obj._chains)})
        elif kind is ImplicitIndex:
            out["implicit_index.local"] = len(obj._local)
        elif kind is ChatTemplate:
            out["template.segments"] = obj._segment_ids.cache_info().currsize
        elif kind is EngineRouter:
            out["router.affinity"] = len(obj._affinity)
        elif kind is InFlight:
            out["inflight.local"] = len(obj._local)
            out["inflight.members"] = len(obj._members)
        elif kind.__module__ == "sqlalchemy.engine.base" and kind.__name__ == "Engine":
            compiled = obj._compiled_cache
            out["sqlalchemy.compiled"] = out.get("sqlalchemy.compiled", 0) + (len(compiled) if compiled else 0)
        elif kind.__module__ == "asyncpg.connection" and kind.__name__ == "Connection":
            out["asyncpg.connections"] = out.get("asyncpg.connections", 0) + 1
            out["asyncpg.statements"] = out.get("asyncpg.statements", 0) + len(obj._stmt_cache)
        elif kind.__module__ == "redis.asyncio.connection" and kind.__name__ == "Connection":
            out["redis.connections"] = out.get("redis.connections", 0) + 1
    return out


def census(out: Path, index: int) -> None:
    started = time.perf_counter()
    tracemalloc.take_snapshot().dump(str(out / f"snap-{index}.tracemalloc"))
    objects = gc.get_objects()
    types = collections.Counter(type(o).__qualname__ for o in objects)
    try:
        tasks = len(asyncio.all_tasks(asyncio.get_running_loop()))
    except RuntimeError:
        tasks = None
    current, peak = tracemalloc.get_traced_memory()
    data = {"at": time.time(), "rss_mb": rss_mb(), "traced_mb": current / 2**20, "traced_peak_mb": peak / 2**20,
            "tracemalloc_own_mb": tracemalloc.get_tracemalloc_memory() / 2**20,
            "malloc": malloc_info(), "gc_objects": len(objects), "asyncio_tasks": tasks, "caches": caches(objects),
            "types": dict(types.most_common(300))}
    del objects
    data["took_s"] = time.perf_counter() - started
    (out / f"census-{index}.json").write_text(json.dumps(data, indent=1))


def diff(out: Path, first: int, second: int, *, top: int = 25) -> dict[str, Any]:
    """What grew from census/snapshot ``first`` to ``second``: traced bytes by source line (with the
    allocating stack of the largest), object counts by type, cache entries."""
    a = json.loads((out / f"census-{first}.json").read_text())
    b = json.loads((out / f"census-{second}.json").read_text())
    old = tracemalloc.Snapshot.load(str(out / f"snap-{first}.tracemalloc"))
    new = tracemalloc.Snapshot.load(str(out / f"snap-{second}.tracemalloc"))
    by_line = new.compare_to(old, "lineno")
    # the largest growing stack of each allocating line (a traceback's last frame is the allocation)
    by_stack: dict[str, tracemalloc.StatisticDiff] = {}
    for stat in new.compare_to(old, "traceback")[: 20 * top]:
        by_stack.setdefault(str(stat.traceback[-1]), stat)
    lines = []
    for stat in by_line[:top]:
        frame = stat.traceback[0]
        stack = by_stack.get(str(frame))
        lines.append({"where": f"{frame.filename}:{frame.lineno}", "grew_kb": stat.size_diff / 1024,
                      "now_kb": stat.size / 1024, "blocks_grew": stat.count_diff,
                      "stack": [f"{f.filename}:{f.lineno}" for f in reversed(stack.traceback)] if stack else []})
    types = {k: b["types"].get(k, 0) - a["types"].get(k, 0) for k in set(a["types"]) | set(b["types"])}
    return {
        "rss_mb": [a["rss_mb"], b["rss_mb"]], "traced_mb": [a["traced_mb"], b["traced_mb"]],
        "malloc": [a["malloc"], b["malloc"]], "gc_objects": [a["gc_objects"], b["gc_objects"]],
        "asyncio_tasks": [a["asyncio_tasks"], b["asyncio_tasks"]],
        "caches": {k: [a["caches"].get(k), b["caches"].get(k)] for k in sorted(set(a["caches"]) | set(b["caches"]))},
        "types_grew": dict(sorted(((k, v) for k, v in types.items() if v), key=lambda kv: -abs(kv[1]))[:top]),
        "lines_grew": lines,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the snapshots and census files")
    parser.add_argument("--frames", type=int, default=10, help="stack frames kept per allocation")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the agentrl arguments")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    taken = iter(range(1_000_000))

    def on_signal(*_: Any) -> None:
        if not tracemalloc.is_tracing():
            tracemalloc.start(args.frames)
        census(out, next(taken))

    signal.signal(signal.SIGUSR1, on_signal)

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from agentrl.cli import main as agentrl_main

    return agentrl_main(command)


if __name__ == "__main__":
    sys.exit(main())
