"""Gateway overhead: our recording gateway vs LiteLLM's proxy over one instant stand-in upstream, loaded by wrk.

In ONE run, for every scenario x concurrency (default 1, 8, 32, 128), each target in turn (interleaved, so
that the machine's changing load hits every target alike):

- scenarios: **single** (one-turn conversations), **session** (each connection runs 20-turn sessions whose
  history grows: turn k sends the k-1 earlier exchanges), each non-streamed and streamed; and
  **session-named** (ours only): the same sessions as named ones, each created first with ``POST
  /v1/sessions`` and driven with its own key (requests/s and p50 count the turns, not the creations; read
  against LiteLLM's session row);
- targets: the stand-in upstream called directly (its native ``/generate``, what our gateway calls, and its
  OpenAI route, what LiteLLM calls: the baselines of "added latency"); **ours** recording every turn in
  implicit mode (agent key) on SQLite, on PostgreSQL + Redis, and on PostgreSQL + Redis with
  ``--workers 2``; **LiteLLM**'s proxy (one worker) over the stand-in's OpenAI route.

The load generator is ``wrk`` (C, one event loop per thread; ``bench/wrk/chat.lua`` builds the bodies and
times each turn), so the client costs little of the machine's cores. Added latency = a proxy's p50 minus
the p50 of calling the upstream directly at the same concurrency. The machine (cores, model) and its load
(``/proc/loadavg`` before every block) are printed and saved: the cores are shared with other jobs, so
absolute numbers move; the ratios within one run are the figures to read. The machine's speed can also
change within a run (by 2x within minutes here): ``--rounds N`` cycles the targets N times per scenario and
concurrency and reports medians, and each ratio as the median of the rounds' own ratios.

    python bench/gateway.py [--duration 5] [--concurrency 1,8,32,128] [--rounds 1] [--targets ours-sqlite,litellm,...]

Writes ``docs/bench/gateway.json`` and ``docs/bench/gateway.png`` (``--out DIR``). LiteLLM comes from
``.venv-bench/bin/litellm`` (``pip install '.[bench]'`` into a separate venv), ``$AGENTRL_BENCH_LITELLM`` or
``PATH``; without it the LiteLLM rows are left out and said so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agentrl.procs import Processes  # noqa: E402
from tests.conftest import free_port  # noqa: E402

ADMIN, AGENT = "bench-admin", "bench-agent"
PEER_KEY = "sk-bench-" + "5f3a9c" * 6  # LiteLLM refuses to start without a master key
WRK_SCRIPT = REPO / "bench" / "wrk" / "chat.lua"
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Say hello in one short sentence."}]
PG_ADMIN = os.environ.get("AGENTRL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("AGENTRL_TEST_REDIS", "redis://127.0.0.1:6379/0")
PEER_SCENARIOS = ("single", "single-stream", "session", "session-stream")
# session-named: the session scenario through named sessions (each created first, its turns sent with its
# own key: how an agent runner that creates sessions drives the gateway); ours only, read against the
# peer's plain session rows (a plain proxy has no sessions)
SCENARIOS = (*PEER_SCENARIOS, "session-named")


# ------------------------------------------------------------------------------------------ wrk

def wrk_argv(url: str, *, concurrency: int, duration_s: float, mode: str, turns: int, stream: bool, key: str,
             tag: str, body_file: Path | None = None, timeout_s: float = 60.0) -> list[str]:
    """The wrk command line. Session mode needs one connection per thread (the script's state is per thread)."""
    threads = concurrency if mode in ("session", "named") else min(concurrency, 2)
    # wrk reads whole seconds only ("12.8s" is refused)
    argv = ["wrk", "-t", str(threads), "-c", str(concurrency), "-d", f"{max(1, round(duration_s))}s", "--timeout",
            f"{round(timeout_s)}s", "-s", str(WRK_SCRIPT), url, "--", mode, str(turns), "1" if stream else "0", key, tag]
    if body_file is not None:
        argv.append(str(body_file))
    return argv


def parse_wrk(output: str, *, named: bool = False) -> dict[str, Any]:
    """The ``WRKJSON {...}`` line that ``chat.lua`` prints, with requests/s, ms figures and an error total.
    ``named``: requests/s and p50 count the chat turns only, not the sessions' creation."""
    for line in output.splitlines():
        if line.startswith("WRKJSON "):
            raw = json.loads(line[len("WRKJSON "):])
            break
    else:
        raise ValueError(f"no WRKJSON line in wrk's output:\n{output[-2000:]}")
    errors = sum(raw[k] for k in ("connect_errors", "read_errors", "write_errors", "timeouts", "non200"))
    seconds = raw["duration_us"] / 1e6
    return {
        "requests": raw["requests"], "seconds": seconds, "rps": raw["requests"] / seconds if seconds else 0.0,
        "p50_ms": raw["p50_us"] / 1e3, "p90_ms": raw["p90_us"] / 1e3, "p99_ms": raw["p99_us"] / 1e3,
        "mean_ms": raw["mean_us"] / 1e3, "max_ms": raw["max_us"] / 1e3, "errors": errors,
        "turn_p50_ms": [None if v is None else v / 1e3 for v in raw["turn_p50_us"]], "turn_n": raw["turn_n"],
        "error_kinds": {k: raw[k] for k in ("connect_errors", "read_errors", "write_errors", "timeouts", "non200")
                        if raw[k]},
        **({"requests": raw["chat_requests"], "rps": raw["chat_requests"] / seconds if seconds else 0.0,
            "p50_ms": raw["chat_p50_us"] / 1e3}
           if named else {}),
    }


def run_wrk(argv: list[str], timeout_s: float, *, named: bool = False) -> dict[str, Any]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr[-2000:]}")
    return parse_wrk(done.stdout, named=named)


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def machine() -> dict[str, Any]:
    model = ""
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cores": os.cpu_count(), "cpu": model, "kernel": platform.release(), "python": platform.python_version(),
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}


# ------------------------------------------------------------------------------------------ targets

@dataclass
class Target:
    name: str  # ours-sqlite, ours-pg, ours-pg-w2, litellm, upstream-native, upstream-openai
    url: str  # the POST URL
    key: str
    kind: str  # ours | peer | upstream
    scenarios: tuple[str, ...] = SCENARIOS
    db: str | None = None
    pid: int = 0
    body_file: Path | None = None  # raw mode for single-turn scenarios (None: the chat body)
    extra: dict[str, Any] = field(default_factory=dict)


def find_litellm(explicit: str | None) -> str | None:
    for candidate in (explicit, os.environ.get("AGENTRL_BENCH_LITELLM"), str(REPO / ".venv-bench/bin/litellm"),
                      shutil.which("litellm")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


async def pg_admin(sql: str) -> None:
    """Run one statement (CREATE / DROP DATABASE) on the admin database."""
    import asyncpg

    conn = await asyncpg.connect(PG_ADMIN)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def pg_url(name: str) -> str:
    return f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"


@contextmanager
def pg_database(tag: str) -> Iterator[str]:
    """A fresh PostgreSQL database for one gateway, dropped at the end."""
    name = f"agentrl_bench_{tag}_{uuid.uuid4().hex[:8]}"
    asyncio.run(pg_admin(f'CREATE DATABASE "{name}"'))
    try:
        yield pg_url(name)
    finally:
        asyncio.run(pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def clear_redis_prefix(prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(match=prefix + "*"):
        client.delete(key)
    client.close()


def start_gateway(procs: Processes, name: str, upstream: str, db: str, *extra: str) -> tuple[str, int]:
    port = free_port()
    child = procs.start_agentrl(name, ["gateway", "--engine-url", upstream, "--db", db, "--port", str(port),
                                       "--admin-key", ADMIN, "--agent-key", AGENT, "--log-level", "warning",
                                       *extra])
    base = f"http://127.0.0.1:{port}"
    procs.wait_healthy(child, base + "/health", timeout_s=300)
    return base, child.proc.pid


def start_litellm(procs: Processes, litellm: str, upstream: str, work: Path) -> str:
    port = free_port()
    config = work / "litellm.yaml"
    config.write_text(
        "model_list:\n  - model_name: standin\n    litellm_params:\n      model: openai/standin\n"
        f"      api_base: {upstream}/v1\n      api_key: none\n"
        "litellm_settings:\n  telemetry: false\n  set_verbose: false\n"
        f"general_settings:\n  master_key: {PEER_KEY}\n")
    child = procs.start("litellm", [litellm, "--config", str(config), "--port", str(port), "--num_workers", "1"],
                        env={"LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False"})
    base = f"http://127.0.0.1:{port}"
    procs.wait_healthy(child, base + "/health/liveliness", timeout_s=300)
    return base


def recorded(db: str) -> dict[str, Any]:
    """Turns in a gateway's store, and why roots are roots (a linked session turn has no root reason)."""
    from gateway.store import Store

    async def count() -> dict[str, Any]:
        import sqlalchemy as sa

        store = await Store.open(db, migrate=False)
        try:
            async with store.read_connection() as conn:
                rows = (await conn.execute(sa.text(
                    "SELECT root_reason, count(*) FROM interactions GROUP BY root_reason"))).all()
                sessions = (await conn.execute(sa.text("SELECT count(*) FROM sessions"))).scalar_one()
        finally:
            await store.close()
        reasons = {str(r or "child"): int(n) for r, n in rows}
        return {"turns": sum(reasons.values()), "sessions": int(sessions), "by_root_reason": reasons}

    return asyncio.run(count())


# ------------------------------------------------------------------------------------------ the run

def drain(t: Target) -> None:
    """Wait until the requests a previous wrk run left in flight at ``t`` are served (one more request goes
    through behind them), so that they do not land on the next measurement."""
    body = (t.body_file or t.extra["stream_body"]).read_bytes()
    httpx.post(t.url, content=body, headers={"Authorization": f"Bearer {t.key}", "Content-Type": "application/json"},
               timeout=600)


def measure(targets: list[Target], levels: list[int], duration_s: float, turns: int, scenarios: list[str],
            loads: list[dict[str, Any]], rounds: int = 1) -> list[dict[str, Any]]:
    """One wrk run per target, scenario and concurrency; with ``rounds`` > 1, the targets of a scenario and
    concurrency are cycled that many times (round k of every target measured next to the others' round k),
    each result carrying its ``round``."""
    results: list[dict[str, Any]] = []
    run_tag = uuid.uuid4().hex[:6]
    for scenario in scenarios:
        mode = "named" if scenario == "session-named" else "session" if scenario.startswith("session") else "raw"
        stream = scenario.endswith("stream")
        for c, k in ((c, k) for c in levels for k in range(rounds)):
            loads.append({"scenario": scenario, "concurrency": c, "round": k, "loadavg": loadavg(), "at": time.time()})
            for t in targets:
                if scenario not in t.scenarios:
                    continue
                body = (t.extra["stream_body"] if stream else t.body_file) if mode == "raw" else None
                tag = f"{run_tag}{t.name}{scenario}{c}r{k}"
                # long enough for every connection to finish a few requests at a few tens of req/s
                seconds = max(duration_s, c / 10)
                key = ADMIN if mode == "named" else t.key  # named: the key that creates the sessions
                argv = wrk_argv(t.url, concurrency=c, duration_s=seconds, mode=mode, turns=turns, stream=stream,
                                key=key, tag=tag, body_file=body)
                # a small warm-up: the requests wrk leaves in flight when it stops are still served, and a
                # backlog of 128 would land on the measurement
                warm = wrk_argv(t.url, concurrency=min(c, 4), duration_s=1, mode=mode, turns=turns, stream=stream,
                                key=key, tag="w" + tag, body_file=body)
                drain(t)
                run_wrk(warm, timeout_s=120)
                drain(t)
                r = run_wrk(argv, timeout_s=seconds + 180, named=mode == "named")
                r.update(target=t.name, scenario=scenario, concurrency=c, round=k)
                results.append(r)
                turn_info = ""
                if mode != "raw" and r["turn_p50_ms"] and r["turn_p50_ms"][0] is not None:
                    last = r["turn_p50_ms"][-1]
                    turn_info = f"  turn1 {r['turn_p50_ms'][0]:.2f} ms, turn{turns} " + (
                        f"{last:.2f} ms" if last is not None else "n/a")
                print(f"{scenario:15s} c={c:<4d} {'' if rounds == 1 else f'r{k} '}{t.name:16s} {r['rps']:9.1f} req/s  p50 {r['p50_ms']:8.2f} ms  "
                      f"p99 {r['p99_ms']:8.2f} ms  errors {r['errors']}{turn_info}", flush=True)
    return results


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def table(results: list[dict[str, Any]], turns: int) -> list[dict[str, Any]]:
    """Rows with ratios: req/s vs LiteLLM's in the same scenario and concurrency, added p50 vs the upstream
    called directly, turn-N / turn-1 p50, --workers 2 vs 1 worker. With several rounds, every figure is the
    median over the rounds, and every ratio the median of the rounds' own ratios (each round's targets were
    measured next to each other, so a ratio within a round sees one machine speed)."""
    runs: dict[tuple[str, str, int], dict[int, dict[str, Any]]] = {}
    for r in results:
        runs.setdefault((r["target"], r["scenario"], r["concurrency"]), {})[r.get("round", 0)] = r
    rows = []
    for (target, scenario, c), mine in runs.items():
        if target.startswith("upstream"):
            continue
        # a plain proxy has no named sessions: its session row is the same conversations' traffic
        peer = runs.get(("litellm", "session" if scenario == "session-named" else scenario, c), {})
        base = runs.get(("upstream-openai" if target == "litellm" else "upstream-native", scenario, c), {})
        one = runs.get(("ours-pg", scenario, c), {})

        def ratio(other: dict[int, dict[str, Any]], of: Callable[[dict[str, Any], dict[str, Any]], float | None]
                  ) -> float | None:
            return _median([of(r, other[k]) for k, r in mine.items() if k in other])

        def turn(r: dict[str, Any], index: int) -> float | None:
            return r["turn_p50_ms"][index] if len(r["turn_p50_ms"]) > index else None

        session = scenario.startswith("session")
        rows.append({
            "scenario": scenario, "concurrency": c, "target": target, "rounds": len(mine),
            "rps": _median([r["rps"] for r in mine.values()]),
            "p50_ms": _median([r["p50_ms"] for r in mine.values()]),
            "p99_ms": _median([r["p99_ms"] for r in mine.values()]),
            "errors": sum(r["errors"] for r in mine.values()),
            "vs_litellm": None if target == "litellm" else ratio(peer, lambda a, b: a["rps"] / b["rps"] if b["rps"] else None),
            "added_p50_ms": ratio(base, lambda a, b: a["p50_ms"] - b["p50_ms"]),
            "turn1_ms": _median([turn(r, 0) for r in mine.values()]) if session else None,
            "turnN_ms": _median([turn(r, turns - 1) for r in mine.values()]) if session else None,
            "workers2_vs_1": ratio(one, lambda a, b: a["rps"] / b["rps"] if b["rps"] else None)
            if target == "ours-pg-w2" else None,
        })
    return rows


def fmt(v: Any, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def markdown(rows: list[dict[str, Any]], turns: int) -> str:
    head = (f"| scenario | conc | proxy | req/s | p50 ms | p99 ms | errors | vs LiteLLM | added p50 ms | "
            f"turn 1 / turn {turns} p50 ms | 2 workers / 1 |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        turn = "-" if r["turn1_ms"] is None else f"{r['turn1_ms']:.1f} / {fmt(r['turnN_ms'])}"
        lines.append(f"| {r['scenario']} | {r['concurrency']} | {r['target']} | {r['rps']:.1f} | {r['p50_ms']:.1f} | "
                     f"{r['p99_ms']:.1f} | {r['errors']} | {fmt(r['vs_litellm'], '.2f', 'x')} | "
                     f"{fmt(r['added_p50_ms'], '.2f')} | {turn} | {fmt(r['workers2_vs_1'], '.2f', 'x')} |")
    return head + "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = [s for s in SCENARIOS if any(r["scenario"] == s for r in results)]
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.2 * len(scenarios), 4), dpi=110, squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        names = sorted({r["target"] for r in results if r["scenario"] == scenario})
        for name in names:
            by_level: dict[int, list[float | None]] = {}
            for r in results:
                if r["scenario"] == scenario and r["target"] == name:
                    by_level.setdefault(r["concurrency"], []).append(r["rps"])
            pts = sorted((c, _median(rps)) for c, rps in by_level.items())  # with rounds: their median
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if name.startswith("ours") else "s--", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(scenario)
        ax.set_xlabel("concurrency (connections)")
        ax.set_ylabel("requests/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0,
                        help="seconds of load per measurement (at least concurrency / 10)")
    parser.add_argument("--concurrency", default="1,8,32,128")
    parser.add_argument("--turns", type=int, default=20, help="turns per session in the session scenarios")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--targets", default="upstream-native,upstream-openai,ours-sqlite,ours-pg,ours-pg-w2,litellm")
    parser.add_argument("--litellm", default=None, help="path of the litellm executable")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every target this many times per scenario and concurrency, interleaved; "
                             "the table gives medians, and the medians of each round's own ratios")
    parser.add_argument("--out", default=str(REPO / "docs" / "bench"), help="folder for gateway.json / .png")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        print("bench/gateway.py needs wrk (apt-get install wrk)", file=sys.stderr)
        return 2
    levels = [int(c) for c in args.concurrency.split(",")]
    wanted = args.targets.split(",")
    scenarios = args.scenarios.split(",")
    from engine.models import tiny_dir

    tokenizer = str(tiny_dir())
    work = Path(tempfile.mkdtemp(prefix="agentrl-bench-gw-"))
    litellm = find_litellm(args.litellm) if "litellm" in wanted else None
    if "litellm" in wanted and litellm is None:
        print("LiteLLM not found (.venv-bench/bin/litellm, $AGENTRL_BENCH_LITELLM, PATH): its rows are left out",
              file=sys.stderr)
    info = machine()
    print(f"machine: {info['cores']} cores, {info['cpu']}; {info['uptime']}", flush=True)
    loads: list[dict[str, Any]] = []
    prefixes: list[str] = []
    # the databases outlive the processes (the innermost context ends first)
    with pg_database("pg") as pg1, pg_database("w2") as pg2, Processes(work / "logs") as procs:
        up_port = free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        child = procs.start("standin", [sys.executable, str(REPO / "tests" / "standin.py"), "--port", str(up_port),
                                        "--tokenizer", tokenizer])
        procs.wait_healthy(child, upstream + "/health", timeout_s=120)
        # bodies of the single-turn scenarios
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
        prompt_ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
        if isinstance(prompt_ids, dict):
            prompt_ids = prompt_ids["input_ids"]
        bodies = {}
        for name, body in {
            "chat": {"model": "standin", "messages": MESSAGES, "max_tokens": 64},
            "chat-stream": {"model": "standin", "messages": MESSAGES, "max_tokens": 64, "stream": True},
            "native": {"input_ids": list(prompt_ids), "return_logprob": True,
                       "sampling_params": {"max_new_tokens": 64, "temperature": 1.0}},
            "native-stream": {"input_ids": list(prompt_ids), "return_logprob": True, "stream": True,
                              "sampling_params": {"max_new_tokens": 64, "temperature": 1.0}},
        }.items():
            bodies[name] = work / f"{name}.json"
            bodies[name].write_text(json.dumps(body))

        def ours(name: str, base: str, pid: int, db: str) -> Target:
            return Target(name, base + "/v1/chat/completions", AGENT, "ours", db=db, pid=pid,
                          body_file=bodies["chat"], extra={"stream_body": bodies["chat-stream"]})

        targets: list[Target] = []
        if "upstream-native" in wanted:
            targets.append(Target("upstream-native", upstream + "/generate", "none", "upstream",
                                  scenarios=("single", "single-stream"), body_file=bodies["native"],
                                  extra={"stream_body": bodies["native-stream"]}))
        if "upstream-openai" in wanted:
            targets.append(Target("upstream-openai", upstream + "/v1/chat/completions", "none", "upstream",
                                  scenarios=("single", "single-stream"), body_file=bodies["chat"],
                                  extra={"stream_body": bodies["chat-stream"]}))
        if "ours-sqlite" in wanted:
            db = f"sqlite+aiosqlite:///{work}/bench.db"
            base, pid = start_gateway(procs, "ours-sqlite", upstream, db)
            targets.append(ours("ours-sqlite", base, pid, db))
        for name, db, workers in (("ours-pg", pg1, 1), ("ours-pg-w2", pg2, 2)):
            if name in wanted:
                prefix = f"agentrl-bench:{uuid.uuid4().hex[:8]}:"
                prefixes.append(prefix)
                base, pid = start_gateway(procs, name, upstream, db, "--redis", REDIS_URL, "--redis-prefix", prefix,
                                          "--workers", str(workers))
                targets.append(ours(name, base, pid, db))
        if litellm:
            base = start_litellm(procs, litellm, upstream, work)
            targets.append(Target("litellm", base + "/v1/chat/completions", PEER_KEY, "peer", scenarios=PEER_SCENARIOS,
                                  body_file=bodies["chat"], extra={"stream_body": bodies["chat-stream"]}))
        print(f"targets: {', '.join(t.name for t in targets)}; {args.duration:g} s per measurement (+1 s warm-up)"
              + ("" if args.rounds == 1 else f", {args.rounds} rounds (medians)"), flush=True)
        started = time.time()
        results = measure(targets, levels, args.duration, args.turns, scenarios, loads, rounds=args.rounds)
        stores = {t.name: recorded(t.db) for t in targets if t.db}
        wall = time.time() - started
    for prefix in prefixes:
        clear_redis_prefix(prefix)
    info["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    rows = table(results, args.turns)
    md = markdown(rows, args.turns)
    print()
    print(md)
    for name, got in stores.items():
        print(f"{name}: {got['turns']} turns recorded in {got['sessions']} sessions; roots by reason "
              f"{ {k: v for k, v in got['by_root_reason'].items() if k != 'child'} }, linked children "
              f"{got['by_root_reason'].get('child', 0)}")
    print(f"load average (1/5/15 min) per block: {[l['loadavg'] for l in loads]}")
    print(f"machine: {info['cores']} cores, {info['cpu']}; before: {info['uptime']}; after: {info['uptime_after']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)), "wall_s": wall,
               "machine": info, "loads": loads, "duration_s": args.duration, "turns": args.turns,
               "rounds": args.rounds,
               "load_generator": "wrk " + subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.split("\n")[0],
               "results": results, "table": rows, "stores": stores}
    (out / "gateway.json").write_text(json.dumps(payload, indent=1))
    plot(results, out / "gateway.png", f"gateway vs LiteLLM over an instant upstream, {info['cores']} shared cores, "
         f"{payload['when']}")
    (out / "gateway.md").write_text(md)
    print(f"wrote {out / 'gateway.json'}, {out / 'gateway.png'}, {out / 'gateway.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
