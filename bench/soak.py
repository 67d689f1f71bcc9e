"""Soak: 1,000 concurrent simulated agents for 2 minutes, and the lifecycle tick at 1k vs 100k finished sessions.

1. **Soak.** One gateway process (PostgreSQL + Redis by default, ``--db sqlite`` for SQLite) over the
   instant stand-in upstream; ``wrk`` runs ``--agents`` connections, each an agent running 20-turn sessions
   with a growing history (``bench/wrk/chat.lua``, one connection per wrk thread), in implicit mode, for
   ``--seconds`` (120), each agent waiting up to 600 s for an answer (the openai SDK's default timeout).
   Reported: requests, errors (must be 0: connect/read/write errors, timeouts, non-200 answers), the gateway's
   RSS after the warm-up and at the end (target: within 10%), and the lifecycle's last tick time during the
   load. The warm-up is the ramp: the gateway takes the agents' connections off its listen queue as its
   event loop has time, so under this load it holds all of them only some seconds in (37-112 s in earlier
   runs). The soak therefore measures ``--seconds`` from the moment it holds them all (within ``--ramp``,
   90 s; wrk is then stopped), and also reports RSS at a fixed ``--warmup`` (20 s) into the load. RSS is
   sampled every second; the window's growth compares the median of its first 20 s with that of its last
   20 s, one cycle of the gateway's heap trim each (a single sample reads high or low by where in that
   cycle it falls: +15.7 % against +8 % for the same end RSS in two runs of 2026-12-03).
2. **Tick vs history.** In this process, on a fresh SQLite file and a fresh PostgreSQL database (+ Redis):
   seed finished (consumed) sessions with bulk SQL (each with one turn and, every 8th, a closed group),
   plus 1,000 live active sessions, and time ``TrajectoryService.tick()`` at 1k and at 100k finished
   sessions (median of ``--ticks``). Every SELECT the tick ran is shown with its plan (``EXPLAIN`` /
   ``EXPLAIN QUERY PLAN``): a scan of ``sessions``, ``interactions`` or ``session_groups`` would read the
   history at every tick.

    python bench/soak.py [--agents 1000] [--seconds 120] [--skip-soak] [--skip-tick] [--history 1000,100000]

Writes ``docs/bench/soak.json`` (``--out DIR``): each part with the date and machine of its run (``tick_run``,
``soak_run``); a part skipped (``--skip-soak`` / ``--skip-tick``) keeps the file's last result for it. ``--trace-memory DIR`` runs the
soaked gateway under tracemalloc (``bench/memtrace.py``) and prints what its memory gained after the warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # before bench/, whose gateway.py would shadow the gateway package

from agentrl.procs import Processes  # noqa: E402
from gateway.metrics import cache_gauges  # noqa: E402
from gateway.workers import TRIM_MEMORY_S as TRIM_EVERY_S  # noqa: E402
from tests.conftest import free_port  # noqa: E402


def _bench() -> Any:
    """bench/gateway.py's helpers (its file name is the gateway package's; load it under another name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gateway", REPO / "bench" / "gateway.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gateway"] = module
    spec.loader.exec_module(module)
    return module


bench = _bench()


CLIENT_TIMEOUT_S = 600  # the openai SDK's default request timeout: what an agent waits before giving up


def open_fds(pid: int) -> int:
    """File descriptors the process holds: its accepted connections among them (a connection still in the
    listen queue is not one yet)."""
    try:
        return len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except OSError:
        return 0


def agent_connections(pid: int, port: int) -> int:
    """The clients' connections the process has accepted on ``port``: its socket descriptors whose TCP
    entry is an established connection with that local port (its database and Redis connections, and
    connections still waiting in the listen queue, are not counted)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                inodes.add(fields[9])
    held = 0
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                held += 1
    except OSError:
        return 0
    return held


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


# ------------------------------------------------------------------------------------------ soak

def soak(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from engine.models import tiny_dir

    out: dict[str, Any] = {"agents": args.agents, "seconds": args.seconds, "warmup_s": args.warmup, "settle_s": args.settle,
                           "db": args.db, "load_before": bench.loadavg()}
    with bench.pg_database("soak") as pg, Processes(work / "logs") as procs:  # the processes stop first
        up_port = free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        child = procs.start("standin", [sys.executable, str(REPO / "tests" / "standin.py"), "--port", str(up_port),
                                        "--tokenizer", str(tiny_dir())])
        procs.wait_healthy(child, upstream + "/health", timeout_s=120)
        prefix = f"agentrl-soak:{uuid.uuid4().hex[:8]}:"
        if args.db == "sqlite":
            db, extra = f"sqlite+aiosqlite:///{work}/soak.db", []
        else:
            db, extra = pg, ["--redis", bench.REDIS_URL, "--redis-prefix", prefix]
        traced = Path(args.trace_memory) if args.trace_memory else None
        if traced is None:
            base, pid = bench.start_gateway(procs, "gateway", upstream, db, *extra)
        else:
            base, pid = start_traced_gateway(procs, upstream, db, extra, traced)
        samples: list[tuple[float, float, int]] = []  # (seconds, RSS MB, open file descriptors)
        stop = threading.Event()
        # a traced gateway starts tracing and writes what it holds before the load, then when every agent is
        # connected (the window's start), 3 s before the window ends and 10 s after the load (census 0 to 3)
        census = [1, 2] if traced else []
        if traced is not None:
            signal_census(pid, traced, 0)

        t0 = time.monotonic()  # the load's start: samples and the ramp are timed from here

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.monotonic() - t0, rss_mb(pid), open_fds(pid)))
                stop.wait(1.0)

        out["rss_idle_mb"] = rss_mb(pid)
        port = int(base.rsplit(":", 1)[1])
        argv = bench.wrk_argv(base + "/v1/chat/completions", concurrency=args.agents,
                              duration_s=args.ramp + args.settle + args.seconds, mode="session", turns=args.turns, stream=False,
                              key=bench.AGENT, tag=uuid.uuid4().hex[:6], timeout_s=CLIENT_TIMEOUT_S)
        settle = f" and {args.settle:g} s more" if args.settle else ""
        print(f"soak: {args.agents} agents x {args.turns}-turn sessions for {args.seconds:g} s once all are "
              f"connected (at most {args.ramp:g} s){settle} on {args.db} ...", flush=True)
        wrk = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ramp: list[float] = []  # when the gateway held every agent's connection

        def stop_wrk_after_the_window() -> None:
            while not stop.wait(0.5):
                if not ramp and samples and agent_connections(pid, port) >= args.agents:
                    ramp.append(time.monotonic() - t0)
                    print(f"soak: all agents connected after {ramp[0]:.0f} s; the window starts "
                          f"{args.settle:g} s from now and lasts {args.seconds:g} s", flush=True)
                    if census:
                        os.kill(pid, signal.SIGUSR1)  # census 1
                        census.pop(0)
                if ramp and "caches_at_window_start" not in out and time.monotonic() - t0 >= ramp[0] + args.settle:
                    out["caches_at_window_start"] = caches(base)
                if ramp and census and time.monotonic() - t0 >= ramp[0] + args.settle + args.seconds - 3:
                    os.kill(pid, signal.SIGUSR1)  # census 2
                    census.pop(0)
                if ramp and samples[-1][0] >= ramp[0] + args.settle + args.seconds:
                    wrk.send_signal(signal.SIGINT)  # wrk stops and prints its results
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        stopper = threading.Thread(target=stop_wrk_after_the_window, daemon=True)
        stopper.start()
        try:
            stdout, stderr = wrk.communicate(timeout=args.ramp + args.settle + args.seconds + 300)
            if wrk.returncode != 0:
                raise RuntimeError(f"wrk failed ({wrk.returncode}): {stderr[-2000:]}")
            result = bench.parse_wrk(stdout)
        finally:
            stop.set()
            sampler.join()
            stopper.join()
        out["all_connected_at_s"] = ramp[0] if ramp else None
        out["rss_end_mb"] = rss_mb(pid)
        out["caches_at_end"] = caches(base)
        if traced is not None:
            out["memory"] = traced_growth(pid, traced)
        stats = httpx.get(base + "/v1/trajectories/stats", headers={"Authorization": f"Bearer {bench.ADMIN}"},
                          timeout=60).json()
        out["last_tick_ms_under_load"] = stats["stats"]["last_tick_ms"]
        out["answers_by_status"] = answers_by_status(base)
        out["store"] = bench.recorded(db)
    if args.db != "sqlite":  # once the gateway is gone: its lifecycle tick failed on the vanished stream
        bench.clear_redis_prefix(prefix)
    after = [mb for t, mb, _ in samples if t >= args.warmup]
    out.update(wrk=result, rss_after_warmup_mb=after[0] if after else None,
               rss_last_sample_mb=samples[-1][1] if samples else None, rss_max_mb=max(mb for _, mb, _ in samples),
               rss_samples=samples[:: max(1, len(samples) // 60)], load_after=bench.loadavg())
    if out["rss_after_warmup_mb"]:
        out["rss_growth"] = out["rss_last_sample_mb"] / out["rss_after_warmup_mb"] - 1
    # The gateway takes connections off the listen queue as its loop has time: under this load it holds all
    # the agents' connections only some time into the run, and each one it holds is a request in progress.
    held = [(t, mb) for t, mb, fds in samples if fds >= max(f for _, _, f in samples) - 5]
    if held:
        out["all_connections_held_at_s"], out["rss_when_all_held_mb"] = held[0]
        out["rss_growth_after_all_held"] = out["rss_last_sample_mb"] / held[0][1] - 1
    start = out["all_connected_at_s"]
    if start is not None:  # the soak proper: --seconds with every agent connected (after --settle)
        start += args.settle
        window = [(t, mb) for t, mb, _ in samples if start <= t <= start + args.seconds + 1]
        out["window_s"] = window[-1][0] - window[0][0]
        out["rss_window_first_sample_mb"], out["rss_window_last_sample_mb"] = window[0][1], window[-1][1]
        # RSS saws up and down with the gateway's heap trims (every TRIM_EVERY_S): one sample depends on where
        # in that cycle it falls, so each end of the window is the median of its first / last cycle's samples
        head = [mb for t, mb in window if t <= window[0][0] + TRIM_EVERY_S]
        tail = [mb for t, mb in window if t >= window[-1][0] - TRIM_EVERY_S]
        out["rss_window_start_mb"], out["rss_window_end_mb"] = statistics.median(head), statistics.median(tail)
        out["rss_growth_window"] = out["rss_window_end_mb"] / out["rss_window_start_mb"] - 1
    return out


def caches(base: str) -> dict[str, dict[str, float]]:
    """The gateway's in-process caches from /metrics: ``{cache: {"entries": n, "fill": share of its bound}}``
    (a fill of 1: that cache's memory has stopped growing)."""
    text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {bench.ADMIN}"}, timeout=120).text
    return cache_gauges(text)


def answers_by_status(base: str) -> dict[str, int]:
    """The gateway's own count of its answers by status (``agentrl_gateway_requests_total``), all routes.
    A 408 for headers that came too late is answered before any route and is not counted here."""
    text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {bench.ADMIN}"}, timeout=60).text
    out: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("agentrl_gateway_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            status = labels.split('status="', 1)[1].split('"', 1)[0]
            out[status] = out.get(status, 0) + int(float(value))
    return out


def start_traced_gateway(procs: Processes, upstream: str, db: str, extra: list[str], out: Path) -> tuple[str, int]:
    """The soak's gateway under ``bench/memtrace.py`` (tracemalloc; SIGUSR1 writes a snapshot and a census)."""
    port = free_port()
    child = procs.start("gateway", [sys.executable, str(REPO / "bench" / "memtrace.py"), "--out", str(out), "--",
                                    "gateway", "--engine-url", upstream, "--db", db, "--port", str(port),
                                    "--admin-key", bench.ADMIN, "--agent-key", bench.AGENT, "--log-level", "warning",
                                    *extra])
    base = f"http://127.0.0.1:{port}"
    procs.wait_healthy(child, base + "/health", timeout_s=300)
    return base, child.proc.pid


def wait_census(out: Path, index: int) -> None:
    deadline = time.monotonic() + 300
    while not (out / f"census-{index}.json").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the traced gateway wrote no census-{index}.json in {out}")
        time.sleep(0.5)


def signal_census(pid: int, out: Path, index: int) -> None:
    """Ask the traced gateway for census ``index`` and wait until it is written."""
    os.kill(pid, signal.SIGUSR1)
    wait_census(out, index)


def traced_growth(pid: int, out: Path) -> dict[str, Any]:
    """What the traced gateway's memory gained from the warm-up to the end of the load (census 1 -> 2, what
    the soak's RSS figure compares), and what it still held 10 s after the load that it did not hold before
    the load (census 0 -> 3: what stays)."""
    from bench.memtrace import diff

    wait_census(out, 2)
    time.sleep(10)
    signal_census(pid, out, 3)
    growth = {"warmup_to_end": diff(out, 1, 2), "idle_before_to_idle_after": diff(out, 0, 3)}
    for name, d in growth.items():
        print(f"memory {name}: RSS {d['rss_mb'][0]:.0f} -> {d['rss_mb'][1]:.0f} MB, traced {d['traced_mb'][0]:.1f} -> "
              f"{d['traced_mb'][1]:.1f} MB, glibc {d['malloc'][0]} -> {d['malloc'][1]}, gc objects "
              f"{d['gc_objects'][0]} -> {d['gc_objects'][1]}, tasks {d['asyncio_tasks'][0]} -> {d['asyncio_tasks'][1]}")
        print(f"  caches: {d['caches']}")
        print(f"  types: {d['types_grew']}")
        for line in d["lines_grew"][:15]:
            print(f"  {line['grew_kb']:+9.0f} KB ({line['blocks_grew']:+d} blocks, now {line['now_kb']:.0f} KB) "
                  f"{line['where']}  <- {' <- '.join(line['stack'][1:4])}")
    return growth


# ------------------------------------------------------------------------------------------ tick vs history

SEED_SESSIONS = """
WITH RECURSIVE g(x) AS (SELECT CAST(:lo AS INTEGER) UNION ALL SELECT x + 1 FROM g WHERE x < CAST(:hi AS INTEGER))
INSERT INTO sessions (id, key_hash, group_id, task_id, metadata, status, is_eval, reward, version, created_at,
                      finished_at, last_activity_at)
SELECT CAST(:p AS VARCHAR) || x, CAST(:p AS VARCHAR) || 'k' || x, CAST(:p AS VARCHAR) || 'g' || (x / 8), NULL, '{}', CAST(:status AS VARCHAR), false, CAST(:reward AS FLOAT), 3,
       CAST(:t0 AS FLOAT) + x * 0.001, CASE WHEN CAST(:status AS VARCHAR) = 'consumed' THEN CAST(:t0 AS FLOAT) + x * 0.001 + 5 ELSE NULL END, CAST(:t0 AS FLOAT) + x * 0.001 + 5
FROM g
"""
SEED_TURNS = """
WITH RECURSIVE g(x) AS (SELECT CAST(:lo AS INTEGER) UNION ALL SELECT x + 1 FROM g WHERE x < CAST(:hi AS INTEGER))
INSERT INTO interactions (id, session_id, parent_id, created_at, request, response_message, prompt_ids, bridge_len,
                          output_ids, output_logprobs, output_versions, finish_reason, reward, chain_hash,
                          request_hash, root_reason, timings)
SELECT CAST(:p AS VARCHAR) || 't' || x, CAST(:p AS VARCHAR) || x, NULL, CAST(:t0 AS FLOAT) + x * 0.001, '{}', '{}', :blob, 0, :blob, :blob, :blob, 'stop', 1.0,
       CAST(:p AS VARCHAR) || 'c' || x, CAST(:p AS VARCHAR) || 'r' || x, 'first_turn', '{}'
FROM g
"""
SEED_GROUPS = """
WITH RECURSIVE g(x) AS (SELECT CAST(:lo AS INTEGER) UNION ALL SELECT x + 1 FROM g WHERE x < CAST(:hi AS INTEGER))
INSERT INTO session_groups (id, size, places, created, status, task_id, metadata, created_at)
SELECT CAST(:p AS VARCHAR) || 'g' || x, 8, 8, 8, 'closed', NULL, '{}', CAST(:t0 AS FLOAT) + x * 0.008 FROM g
"""


async def seed(store: Any, lo: int, hi: int, *, prefix: str, status: str, t0: float, groups: bool,
               reward: float | None = 1.0) -> None:
    """Sessions ``prefix`` + ``lo``..``hi`` in ``status`` (group ids of 8), created from ``t0`` a millisecond
    apart; consumed ones with a turn each, ``groups`` adds their (closed) group rows."""
    import sqlalchemy as sa

    params = {"lo": lo, "hi": hi, "p": prefix, "t0": t0}
    async with store.engine.begin() as conn:
        await conn.execute(sa.text(SEED_SESSIONS), {**params, "status": status, "reward": reward})
        if status == "consumed":
            await conn.execute(sa.text(SEED_TURNS), {**params, "blob": b"\x01\x00\x00\x00"})
        if groups:
            await conn.execute(sa.text(SEED_GROUPS), {**params, "lo": lo // 8 + 1, "hi": hi // 8})


def capture_selects(store: Any) -> list[tuple[str, Any]]:
    """Every SELECT run on the store's engines from now on, with its parameters."""
    from sqlalchemy import event

    seen: list[tuple[str, Any]] = []

    def before(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            seen.append((statement, parameters))

    for engine in {id(store._engine): store._engine, id(store.engine): store.engine}.values():
        event.listen(engine.sync_engine, "before_cursor_execute", before)
    return seen


async def explain(store: Any, statements: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    sqlite = store.engine.dialect.name == "sqlite"
    plans = []
    seen_sql = set()
    for statement, params in statements:
        if statement in seen_sql or "FROM" not in statement.upper():
            continue
        seen_sql.add(statement)
        async with store.engine.connect() as conn:
            prefix = "EXPLAIN QUERY PLAN " if sqlite else "EXPLAIN "
            rows = (await conn.exec_driver_sql(prefix + statement, params)).all()
        plan = [str(r[-1]) if sqlite else str(r[0]) for r in rows]
        text = " ".join(plan)
        scans = [t for t in ("sessions", "interactions", "session_groups")
                 if (f"SCAN {t}" in text and f"SCAN {t} USING" not in text) or f"Seq Scan on {t}" in text]
        plans.append({"sql": " ".join(statement.split())[:300], "plan": plan, "history_scans": scans})
    return plans


async def tick_vs_history(db: str, redis_url: str | None, history: list[int], ticks: int, live: int) -> dict[str, Any]:
    from gateway.lifecycle import ExportSettings, TrajectoryService
    from gateway.store import Store

    prefix = f"agentrl-soak-tick:{uuid.uuid4().hex[:8]}:"
    store = await Store.open(db, redis_url=redis_url, redis_prefix=prefix)
    svc = TrajectoryService(store, ExportSettings())
    out: dict[str, Any] = {"db": db.split("://")[0], "live_active_sessions": live, "at": []}
    t0 = time.time() - 86_400
    try:
        await seed(store, 1, live, prefix="live-", status="active", t0=time.time() - 10, groups=False)
        seeded = 0
        for n in history:
            await seed(store, seeded + 1, n, prefix="hist-", status="consumed", t0=t0, groups=True)
            seeded = n
            if store.engine.dialect.name == "postgresql":
                async with store.engine.connect() as conn:
                    await conn.exec_driver_sql("ANALYZE")
            await svc.tick()  # warm
            selects = capture_selects(store)
            times = []
            for _ in range(ticks):
                start = time.perf_counter()
                await svc.tick()
                times.append((time.perf_counter() - start) * 1000)
            plans = await explain(store, list(selects)) if n == history[-1] else []
            out["at"].append({"finished_sessions": n, "tick_ms_median": statistics.median(times),
                              "tick_ms_max": max(times), "plans": plans})
            print(f"  {out['db']:18s} {n:7d} finished sessions: tick {statistics.median(times):7.2f} ms median "
                  f"(max {max(times):.2f}) over {ticks} ticks", flush=True)
    finally:
        await svc.stop()
        await store.close()
        if redis_url:
            bench.clear_redis_prefix(prefix)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--warmup", type=float, default=20.0, help="also report RSS growth from this long into the load")
    parser.add_argument("--ramp", type=float, default=90.0,
                        help="at most this long for the gateway to hold every agent's connection; --seconds count from then")
    parser.add_argument("--settle", type=float, default=0.0,
                        help="let the load run this long after every agent is connected before the window starts "
                             "(the in-process caches fill meanwhile; 0: the window starts at once)")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--db", choices=("postgres", "sqlite"), default="postgres", help="the soaked gateway's store")
    parser.add_argument("--history", default="1000,100000", help="finished sessions to seed, cumulative")
    parser.add_argument("--ticks", type=int, default=20)
    parser.add_argument("--skip-soak", action="store_true")
    parser.add_argument("--skip-tick", action="store_true")
    parser.add_argument("--out", default=str(REPO / "docs" / "bench"))
    parser.add_argument("--trace-memory", metavar="DIR",
                        help="run the soaked gateway under tracemalloc (bench/memtrace.py, slower) and report what "
                             "its memory gained after the warm-up; snapshots go to DIR")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="agentrl-soak-"))
    info = bench.machine()
    print(f"machine: {info['cores']} cores, {info['cpu']}; {info['uptime']}", flush=True)
    payload: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": info}
    if not args.skip_tick:
        history = [int(n) for n in args.history.split(",")]
        print("lifecycle tick vs finished sessions in the store:", flush=True)
        payload["tick"] = [asyncio.run(tick_vs_history(f"sqlite+aiosqlite:///{work}/tick.db", None, history,
                                                       args.ticks, 1000))]
        with bench.pg_database("tick") as pg:
            payload["tick"].append(asyncio.run(tick_vs_history(pg, bench.REDIS_URL, history, args.ticks, 1000)))
        for got in payload["tick"]:
            for plan in got["at"][-1]["plans"]:
                print(f"  [{got['db']}] {plan['sql'][:110]}\n      plan: {' | '.join(plan['plan'])[:300]}")
            scans = [p for p in got["at"][-1]["plans"] if p["history_scans"]]
            print(f"  [{got['db']}] SELECTs of one tick that scan a history table: {len(scans)}")
    if not args.skip_soak:
        s = payload["soak"] = soak(args, work)
        w = s["wrk"]
        print(f"soak: {w['requests']} requests in {w['seconds']:.0f} s ({w['rps']:.1f} req/s), errors {w['errors']} "
              f"{w['error_kinds'] or ''}, "
              f"p50 {w['p50_ms']:.1f} ms, p99 {w['p99_ms']:.1f} ms; turns recorded {s['store']['turns']} in "
              f"{s['store']['sessions']} sessions")
        warm = (f"{s['rss_after_warmup_mb']:.0f} MB" if s["rss_after_warmup_mb"] else "n/a")
        print(f"soak: gateway RSS idle {s['rss_idle_mb']:.0f} MB, {args.warmup:g} s into the load {warm}, at the end "
              f"{s['rss_last_sample_mb']:.0f} MB ({100 * s.get('rss_growth', 0):+.1f}%), max {s['rss_max_mb']:.0f} MB; "
              f"last lifecycle tick {s['last_tick_ms_under_load']:.1f} ms; load {s['load_before']} -> {s['load_after']}")
        print(f"soak: the gateway's answers by status: {s['answers_by_status']}")
        if s.get("rss_growth_window") is not None:
            begin = s['all_connected_at_s'] + s.get('settle_s', 0)
            print(f"soak: with every agent connected ({begin:.0f} s to {begin + s['window_s']:.0f} s): RSS {s['rss_window_start_mb']:.0f} -> "
                  f"{s['rss_window_end_mb']:.0f} MB ({100 * s['rss_growth_window']:+.1f}%; target within 10%; "
                  f"medians of the first and last {TRIM_EVERY_S:g} s, one heap-trim cycle; single samples "
                  f"{s['rss_window_first_sample_mb']:.0f} -> {s['rss_window_last_sample_mb']:.0f} MB)")
        else:
            print(f"soak: the gateway never held all {args.agents} connections within {args.ramp:g} s: "
                  "no steady window to judge memory by")
        for when in ("caches_at_window_start", "caches_at_end"):
            if s.get(when):
                print(f"soak: caches {when[len('caches_at_'):].replace('_', ' ')}: " + ", ".join(
                    f"{name} {c['entries']:.0f} ({100 * c['fill']:.0f}% full)" for name, c in sorted(s[when].items())))
        if "all_connections_held_at_s" in s:
            print(f"soak: all {max(f for _, _, f in s['rss_samples'])} connections held from "
                  f"{s['all_connections_held_at_s']:.0f} s on (RSS {s['rss_when_all_held_mb']:.0f} MB): "
                  f"{100 * s['rss_growth_after_all_held']:+.1f}% from there to the end")
    info["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    previous = json.loads((out / "soak.json").read_text()) if (out / "soak.json").exists() else {}
    run = {"when": payload.pop("when"), "machine": payload.pop("machine")}
    for part in ("tick", "soak"):  # each part with the run it comes from; a skipped part keeps its last result
        if part in payload:
            payload[f"{part}_run"] = run
        elif part in previous:
            payload[part], payload[f"{part}_run"] = previous[part], previous.get(f"{part}_run")
    (out / "soak.json").write_text(json.dumps(payload, indent=1))
    print(f"wrote {out / 'soak.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
