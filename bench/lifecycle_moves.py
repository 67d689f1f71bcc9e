"""One lifecycle tick that must move many sessions at once, this tree against another (``--base``).

Two scenarios, each a database seeded once with bulk SQL (``bench/soak.py``'s seeding) and copied afresh for
every measured tick:

- ``abandon``: ``--sessions`` active sessions without a reward, all past the group timeout (what a
  single-turn agent that never posts a reward leaves behind, one session per request): the tick abandons
  them all and gives their budget back;
- ``idle``: ``--sessions`` active sessions with a reward, past the idle timeout, in group ids of 8: the tick
  finishes them and exports each group.

Each tick runs in a child process of the tree measured (``PYTHONPATH`` = that tree), trees interleaved,
``--runs`` times; printed: the median wall and CPU time of the tick and the ratio base / this tree.

    python bench/lifecycle_moves.py [--sessions 20000] [--runs 3] [--db postgres|sqlite] [--base DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # after PYTHONPATH: a child imports the gateway of the tree it measures

from bench import gateway as bench  # noqa: E402
from bench.soak import seed  # noqa: E402

SCENARIOS = {"abandon": None, "idle": 1.0}  # the seeded sessions' reward


async def child(db: str, redis_url: str | None) -> dict[str, float]:
    """One tick, two hours after the seeded sessions' last activity; its times and what it moved."""
    from gateway.lifecycle import ExportSettings, TrajectoryService
    from gateway.store import Store

    prefix = f"agentrl-bench-moves:{uuid.uuid4().hex[:8]}:"
    store = await Store.open(db, redis_url=redis_url, redis_prefix=prefix, migrate=False)
    svc = TrajectoryService(store, ExportSettings())
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        await svc.tick(now=time.time() + 7200)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        await svc.stop()
        await store.close()
        if redis_url:
            bench.clear_redis_prefix(prefix)
    return {"wall_s": wall, "cpu_s": cpu, "abandoned": svc.stats.sessions_abandoned,
            "idle_finished": svc.stats.idle_finished, "groups_exported": svc.stats.groups_exported}


async def make_template(db: str, n: int, reward: float | None) -> None:
    from gateway.store import Store

    store = await Store.open(db)  # migrates
    try:
        await seed(store, 1, n, prefix="s-", status="active", t0=time.time() - 60, groups=False, reward=reward)
    finally:
        await store.close()


def run_tick(tree: Path, db: str, redis_url: str | None) -> dict[str, float]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", db] + (["--redis", redis_url] if redis_url else [])
    done = subprocess.run(argv, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True,
                          text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"tick in {tree} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--db", choices=("postgres", "sqlite"), default="postgres")
    parser.add_argument("--scenarios", default="abandon,idle")
    parser.add_argument("--base", default=None, help="another source tree, measured interleaved with this one")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--redis", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(child(args.child, args.redis))))
        return 0
    trees = {"this": REPO} | ({"base": Path(args.base).resolve()} if args.base else {})
    redis_url = bench.REDIS_URL if args.db == "postgres" else None
    m = bench.machine()
    print(f"machine: {m['cores']} cores, {m['cpu']}; {m['uptime']}")
    print(f"lifecycle tick over {args.sessions} sessions to move ({args.db}{' + Redis' if redis_url else ''}), "
          f"median of {args.runs} runs, trees: {', '.join(f'{k}={v}' for k, v in trees.items())}")
    work = Path(tempfile.mkdtemp(prefix="agentrl-bench-moves-"))
    try:
        for scenario in args.scenarios.split(","):
            tag = uuid.uuid4().hex[:8]
            template = f"agentrl_bench_moves_{tag}"
            if args.db == "postgres":
                asyncio.run(bench.pg_admin(f'CREATE DATABASE "{template}"'))
                asyncio.run(make_template(bench.pg_url(template), args.sessions, SCENARIOS[scenario]))
            else:
                asyncio.run(make_template(f"sqlite+aiosqlite:///{work / f'{scenario}.db'}", args.sessions,
                                          SCENARIOS[scenario]))
            results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
            try:
                for run in range(args.runs):
                    for name, tree in trees.items():
                        if args.db == "postgres":
                            copy = f"{template}_{name}_{run}"
                            asyncio.run(bench.pg_admin(f'CREATE DATABASE "{copy}" TEMPLATE "{template}"'))
                            db = bench.pg_url(copy)
                        else:
                            shutil.copy(work / f"{scenario}.db", work / "copy.db")
                            db = f"sqlite+aiosqlite:///{work / 'copy.db'}"
                        try:
                            got = run_tick(tree, db, redis_url)
                        finally:
                            if args.db == "postgres":
                                asyncio.run(bench.pg_admin(f'DROP DATABASE IF EXISTS "{copy}" WITH (FORCE)'))
                        results[name].append(got)
                        print(f"{scenario:8s} r{run} {name:5s} tick {got['wall_s']:7.2f} s wall {got['cpu_s']:7.2f} s CPU "
                              f"abandoned {got['abandoned']:6.0f} finished {got['idle_finished']:6.0f} "
                              f"groups exported {got['groups_exported']:5.0f}", flush=True)
            finally:
                if args.db == "postgres":
                    asyncio.run(bench.pg_admin(f'DROP DATABASE IF EXISTS "{template}" WITH (FORCE)'))
            med = {name: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s")}
                   for name, rs in results.items()}
            line = "  ".join(f"{name} {v['wall_s']:.2f} s wall / {v['cpu_s']:.2f} s CPU" for name, v in med.items())
            if "base" in med:
                line += (f"  -> base / this: {med['base']['wall_s'] / med['this']['wall_s']:.1f}x wall, "
                         f"{med['base']['cpu_s'] / med['this']['cpu_s']:.1f}x CPU")
            print(f"{scenario:8s} median: {line}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
