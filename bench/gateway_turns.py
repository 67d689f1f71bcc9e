"""Where a gateway turn's time goes: `wrk` against one recording gateway, optionally under py-spy.

Starts `tests/standin.py` (an instant SGLang-native upstream) and `agentrl gateway` (SQLite, implicit mode
with an agent key, every turn recorded), then measures with `wrk` (one thread, a C load generator that
costs little next to the servers) for each scenario and concurrency, `--runs` times, and prints medians:

- `upstream`: the stand-in's `/generate` directly (the floor "added" latency is measured against);
- `turn 1`: a single-turn chat request (each one a new implicit episode: a root turn), always the same
  prompt, as the members of a GRPO group send it: after the first, its rendering comes from the render cache;
- `turn 1 unique`: the same, but every request's question carries its own number (wrk's Lua counts), so no
  two prompts are equal and every one is rendered by the chat template;
- `turn 2`, `turn 20`: the last turn of a growing 20-turn conversation (the history is recorded once
  first, so every request is a child turn of turn 1 / turn 19: a sibling under the same parent);
- `named 20`: `turn 20` in a named session (created with `POST /v1/sessions`, its 19 turns recorded first,
  every request sent with the session's own key): what an agent runner that creates its sessions sends.

    python bench/gateway_turns.py [--runs 3] [--duration 8] [--concurrency 1,32] [--profile OUT] [--base DIR]

`--base DIR` also starts a second gateway from another source tree (e.g. `git archive main | tar -x -C
DIR`) over the same upstream and alternates every wrk run between the two, so that a before/after
comparison sees the same machine load (on a shared machine, runs minutes apart are not comparable).

`--profile OUT` also samples the gateway process with py-spy (`py-spy record --pid`, raw collapsed
stacks) during one extra `turn 20` run at concurrency 1 (or `--profile-scenario`), and prints the share of
samples per phase of a turn (the classification is `PHASES` below; the raw stacks are kept in OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agentrl.procs import Processes  # noqa: E402
from bench.gateway import REDIS_URL, clear_redis_prefix, pg_database  # noqa: E402
from tests.conftest import free_port  # noqa: E402

ADMIN, AGENT = "bench-admin", "bench-agent"
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly and precisely."}
REPLY = "Hello! How can I help you today?"  # the stand-in's reply (tests.standin.DEFAULT_REPLY)


def user(k: int) -> dict[str, str]:
    return {"role": "user", "content": f"Question number {k}: what is {k} plus {k * 3}, and why does it matter?"}


def conversation(turn: int) -> list[dict[str, str]]:
    """The messages of turn ``turn`` (1-based) of the growing conversation."""
    messages = [SYSTEM, user(1)]
    for k in range(2, turn + 1):
        messages += [{"role": "assistant", "content": REPLY}, user(k)]
    return messages


def chat_body(turn: int) -> dict[str, object]:
    return {"model": "standin", "messages": conversation(turn), "max_tokens": 64}


def lua(body: dict[str, object], auth: str | None) -> str:
    lines = ['wrk.method = "POST"', f"wrk.body = {json.dumps(json.dumps(body))}",
             'wrk.headers["Content-Type"] = "application/json"']
    if auth:
        lines.append(f'wrk.headers["Authorization"] = "Bearer {auth}"')
    return "\n".join(lines) + "\n"


def lua_unique(body: dict[str, object], auth: str | None) -> str:
    """Like :func:`lua`, but each request replaces ``#N#`` in the body by a counter of its own."""
    lines = [f"template = {json.dumps(json.dumps(body))}", "counter = 0", "request = function()",
             "  counter = counter + 1",
             '  local headers = {["Content-Type"] = "application/json"' + (
                 f', ["Authorization"] = "Bearer {auth}"' if auth else "") + "}",
             '  return wrk.format("POST", nil, headers, (string.gsub(template, "#N#", tostring(counter))))',
             "end"]
    return "\n".join(lines) + "\n"


def named_session(url: str) -> str:
    """Create a named session on the gateway at ``url``, record turns 1-19 of the conversation in it and
    return its key (the ``named 20`` scenario's requests are then child turns of its turn 19)."""
    with httpx.Client(base_url=url, timeout=60) as client:
        created = client.post("/v1/sessions", json={"group_id": "bench-named"},
                              headers={"Authorization": f"Bearer {ADMIN}"})
        created.raise_for_status()
        key = created.json()["api_key"]
        for turn in range(1, 20):
            resp = client.post("/v1/chat/completions", json=chat_body(turn), headers={"Authorization": f"Bearer {key}"})
            resp.raise_for_status()
    return key


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process (and its threads) so far: what a request costs it, whatever else
    runs on the machine (latency on a shared machine measures the neighbours as much as the gateway)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wrk(url: str, script: Path, concurrency: int, duration: float, pid: int | None = None) -> dict[str, float]:
    cpu = cpu_seconds(pid)
    out = subprocess.run(["wrk", "-t1", f"-c{concurrency}", f"-d{duration:g}s", "--latency", "-s", str(script),
                          url], check=True, capture_output=True, text=True).stdout
    cpu = cpu_seconds(pid) - cpu
    done = int(re.search(r"(\d+) requests in", out).group(1))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}
    p50, p99 = (re.search(rf"{q}%\s+([\d.]+)(us|ms|s)\b", out) for q in (50, 99))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: (.*)", out)
    if errors or sock:
        print(f"  wrk reported errors: {errors.group(0) if errors else ''} {sock.group(0) if sock else ''}",
              file=sys.stderr)
    return {"rps": rps, "p50": float(p50.group(1)) * scale[p50.group(2)],
            "p99": float(p99.group(1)) * scale[p99.group(2)], "cpu_ms": 1000.0 * cpu / max(1, done)}


# A sample belongs to the first phase (outermost frame first) whose marker (a substring of
# "function (file:line)") one of its frames holds; the HTTP tier is tried only when no other phase matched
# (every request runs inside uvicorn's and Starlette's frames); samples matching nothing are "other".
PHASES: list[tuple[str, tuple[str, ...]]] = [
    ("lifecycle tick (background loop)", ("TrajectoryService", "gateway/lifecycle.py")),
    ("drift check", ("drift (gateway/chat/template.py",)),
    ("render + tokenize", ("gateway/chat/template.py",)),
    ("engine call (HTTP client, upstream answer)", ("EngineRouter.generate", "gateway/engine_client.py",
                                                     "gateway/fasthttp.py")),
    ("recording / SQL writes", ("_record (gateway/service.py", "GroupCommitWriter", "create_session",
                                "_connection_worker_thread", "record_interactions", "gateway/store/writer.py")),
    ("validation", ("validate_messages", "_refuse_surely_too_long", "model_validate", "refuse_unenforced",
                    "_params_json", "_sampling (gateway/service.py", "_choices (gateway/service.py")),
    ("plan / stitch (hashes, session, parent: SQL reads)", ("plan_chat", "_stitch", "find_parent", "chain_hashes",
                                                            "session_for", "authenticate", "admission",
                                                            "get_session")),
    ("response encoding", ("json_response", "chat_response", "chat_chunks", "gateway/formats/")),
]
# The staleness admission runs in the SQLite writer's thread (gateway/store/writer.py frames outside it)
FIRST = [("plan / stitch (hashes, session, parent: SQL reads)", ("_admit_sync",))]
HTTP_TIER = [("HTTP + JSON parse (uvicorn, Starlette/FastAPI, middleware)",
              ("httptools_impl", "h11_impl", "starlette/", "fastapi/", "read_json", "read_body", "metrics.py",
               "GatewayApp")),
             # SQLAlchemy runs statements in greenlets, whose stacks py-spy sees without their callers
             ("SQL statements (SQLAlchemy in a greenlet: callers not visible)", ("sqlalchemy/", "aiosqlite/"))]
# The event loop's own frame as the innermost one: uvloop in C, waiting in epoll or running callbacks
# (not told apart without py-spy --native); left out of the shares like idle samples.
LOOP = "Runner.run (asyncio/runners.py"
# Frames of a thread waiting for work (py-spy counts a wait with a timeout as active): the event loop in
# epoll, a thread pool's or aiosqlite's worker waiting on its queue.
IDLE = ("epoll_pwait", "uv__io_poll (linux.c:1452)", "_worker (concurrent/futures/thread.py:81)",
        "_connection_worker_thread (aiosqlite/core.py:59)")


def classify(stack: str) -> str | None:
    """The phase of one sample, or None for an idle one (a thread waiting for work, the loop in epoll)."""
    frames = stack.split(";")
    if any(idle in frame for frame in frames for idle in IDLE):
        return None
    if frames[-1].startswith("SqliteBatchWriter._serve (") or frames[-1].startswith("_serve (gateway/store/writer"):
        return None  # the SQLite writer's thread waiting in SimpleQueue.get (C: no frame of its own)
    if frames[-1].startswith(LOOP):
        return "loop"
    for phase, markers in FIRST:
        if any(m in frame for frame in frames for m in markers):
            return phase
    for tier in (PHASES, HTTP_TIER):
        for frame in frames:
            for phase, markers in tier:
                if any(m in frame for m in markers):
                    return phase
    if "Handle__run" in frames[-1]:
        return "event loop callbacks (Python frames not resolved)"
    return "other"


def shares_of(raw: Path) -> Counter[str]:
    counts: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        phase = classify(stack) if stack else None
        counts[phase or "idle"] += int(n)
    return counts


def py_spy() -> str | None:
    """The py-spy executable (on PATH or beside this Python), or None."""
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return found if Path(found).exists() else None


def profile(pid: int, out: Path, seconds: float, run: callable) -> Counter[str]:
    spy = py_spy()
    assert spy is not None
    proc = subprocess.Popen([spy, "record", "--pid", str(pid), "--format", "raw", "-o", str(out), "--rate", "250",
                             "--duration", str(int(seconds) + 2)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.5)
    run()
    log = proc.communicate()[0]
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"py-spy failed ({proc.returncode}): {log[-2000:]}")
    return shares_of(out)


def print_shares(shares: Counter[str], what: str) -> None:
    idle, loop = shares.pop("idle", 0), shares.pop("loop", 0)
    total = sum(shares.values())
    print(f"\npy-spy samples of {what}: {total} samples in Python code of all threads ({idle} idle ones and "
          f"{loop} of the event loop in C left out)")
    for phase, n in shares.most_common():
        print(f"  {phase:55s} {100.0 * n / total:5.1f} %")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="wrk runs per scenario and concurrency (0: profile only)")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per wrk run")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--scenarios", default="upstream,turn 1,turn 2,turn 20",
                        help="of upstream, turn 1, turn 1 unique, turn 2, turn 20, named 20")
    parser.add_argument("--profile", default=None, help="write py-spy raw stacks here and print phase shares")
    parser.add_argument("--profile-scenario", default="turn 20")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, database)")
    parser.add_argument("--base", default=None, help="also measure a gateway from this source tree, interleaved")
    parser.add_argument("--shares", default=None, help="only print the phase shares of an existing raw profile")
    parser.add_argument("--db", choices=("sqlite", "postgres"), default="sqlite",
                        help="sqlite (embedded, no Redis) or postgres (a fresh database each, with Redis)")
    args = parser.parse_args()
    if args.shares:
        print_shares(shares_of(Path(args.shares)), f"the profile {args.shares}")
        return 0
    if args.profile and py_spy() is None:  # say so before the runs, not after them
        parser.error("--profile needs py-spy: .venv/bin/pip install py-spy")
    levels = [int(c) for c in args.concurrency.split(",")]
    scenarios = [s.strip() for s in args.scenarios.split(",")]
    from engine.models import tiny_dir

    work = Path(tempfile.mkdtemp(prefix="agentrl-bench-turns-"))
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    with ExitStack() as stack, Processes(work / "logs") as procs:
        up_port, gw_port = free_port(), free_port()
        upstream, gateway = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{gw_port}"
        child = procs.start("standin", [sys.executable, str(REPO / "tests" / "standin.py"), "--port", str(up_port),
                                        "--tokenizer", str(tiny_dir()), "--reply", REPLY])
        procs.wait_healthy(child, upstream + "/health", timeout_s=120)
        gateways = {"": gateway}
        if args.base:
            gateways["base "] = f"http://127.0.0.1:{free_port()}"
        procs_by_name = {}
        for label, url in gateways.items():
            if args.db == "postgres":
                tag = label.strip() or "this"
                prefix = f"agentrl-bench-turns-{tag}-{os.getpid()}:"
                stack.callback(clear_redis_prefix, prefix)
                db = ["--db", stack.enter_context(pg_database(f"turns_{tag}")), "--redis", REDIS_URL,
                      "--redis-prefix", prefix]
            else:
                db = ["--db", f"sqlite+aiosqlite:///{work}/bench{label.strip()}.db"]
            argv = ["gateway", "--engine-url", upstream, *db,
                    "--port", url.rsplit(":", 1)[1], "--admin-key", ADMIN, "--agent-key", AGENT,
                    "--log-level", "warning"]
            if label:  # the other source tree first on the path
                code = f"import sys; sys.path.insert(0, {str(Path(args.base).resolve())!r}); " \
                       "from agentrl.cli import main; sys.exit(main())"
                procs_by_name[label] = procs.start("gateway-base", [sys.executable, "-c", code, *argv])
            else:
                procs_by_name[label] = procs.start_agentrl("gateway", argv)
        for label, url in gateways.items():
            procs.wait_healthy(procs_by_name[label], url + "/health", timeout_s=180)
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {AGENT}"}, timeout=60) as client:
                for turn in range(1, 20):  # record the conversation once: turn 2 and turn 20 are child turns
                    resp = client.post("/v1/chat/completions", json=chat_body(turn))
                    resp.raise_for_status()
                    assert resp.json()["choices"][0]["message"]["content"] == REPLY
        session_keys = {label: named_session(url) for label, url in gateways.items()} \
            if any(s.startswith("named") for s in scenarios) else {}
        gw = procs_by_name[""]
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tiny_dir()))
        prompt = tok.apply_chat_template(conversation(1), add_generation_prompt=True, tokenize=True)
        prompt = prompt["input_ids"] if isinstance(prompt, dict) else prompt
        targets = {"upstream": (upstream + "/generate", {"input_ids": list(prompt), "return_logprob": True,
                                                         "sampling_params": {"max_new_tokens": 64}}, None)}
        pids: dict[str, int | None] = {"upstream": None}
        for label, url in gateways.items():
            for turn in (1, 2, 20):
                targets[f"{label}turn {turn}"] = (url + "/v1/chat/completions", chat_body(turn), AGENT)
                pids[f"{label}turn {turn}"] = procs_by_name[label].proc.pid
            unique = chat_body(1)
            unique["messages"] = [SYSTEM, {"role": "user", "content": "Question number #N#: what is 5 plus 7?"}]
            targets[f"{label}turn 1 unique"] = (url + "/v1/chat/completions", unique, AGENT)
            pids[f"{label}turn 1 unique"] = procs_by_name[label].proc.pid
            if label in session_keys:
                targets[f"{label}named 20"] = (url + "/v1/chat/completions", chat_body(20), session_keys[label])
                pids[f"{label}named 20"] = procs_by_name[label].proc.pid
        scenarios = [s for s in scenarios if s == "upstream"] + [
            f"{label}{s}" for s in scenarios if s != "upstream" for label in gateways]
        scripts = {}
        for name, (url, body, auth) in targets.items():
            scripts[name] = work / (name.replace(" ", "_") + ".lua")
            scripts[name].write_text((lua_unique if name.endswith("unique") else lua)(body, auth))
        for name in scenarios:  # warm-up
            wrk(targets[name][0], scripts[name], 4, 2)
        for run in range(args.runs):
            for c in levels:
                for name in scenarios:
                    results.setdefault((name, c), []).append(
                        wrk(targets[name][0], scripts[name], c, args.duration, pids[name]))
        shares: Counter[str] | None = None
        if args.profile:
            name = args.profile_scenario
            shares = profile(gw.proc.pid, Path(args.profile), args.duration,
                             lambda: wrk(targets[name][0], scripts[name], levels[0], args.duration))
        procs.check_alive()

    load = os.getloadavg()
    print(f"\ngateway turns over an instant upstream ({args.db}): {os.cpu_count()} cores, load {load[0]:.2f}/{load[1]:.2f}, "
          f"wrk -t1 -d{args.duration:g}s, median of {args.runs} runs")
    print(f"{'scenario':15s} {'conc':>4s} {'req/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s} {'added p50':>10s} "
          f"{'gateway CPU ms/turn':>20s}")
    for c in levels if args.runs else []:
        base = statistics.median(r["p50"] for r in results.get(("upstream", c), [{"p50": 0.0}]))
        for name in scenarios:
            rs = results[(name, c)]
            rps, p50 = statistics.median(r["rps"] for r in rs), statistics.median(r["p50"] for r in rs)
            p99 = statistics.median(r["p99"] for r in rs)
            added = f"{p50 - base:10.2f}" if name != "upstream" else f"{'':10s}"
            cpu = f"{statistics.median(r['cpu_ms'] for r in rs):20.2f}" if name != "upstream" else ""
            print(f"{name:15s} {c:4d} {rps:8.1f} {p50:8.2f} {p99:8.2f} {added} {cpu}")
        if ("turn 1", c) in results and ("turn 20", c) in results:
            for label in gateways:
                t1 = statistics.median(r["p50"] for r in results[(f"{label}turn 1", c)])
                t2 = statistics.median(r["p50"] for r in results[(f"{label}turn 2", c)]) \
                    if (f"{label}turn 2", c) in results else None
                t20 = statistics.median(r["p50"] for r in results[(f"{label}turn 20", c)])
                print(f"{label or 'this tree'}: concurrency {c}: turn-20 p50 / turn-1 p50 = {t20 / t1:.2f}x"
                      + (f", / turn-2 p50 = {t20 / t2:.2f}x" if t2 else ""))
    if shares:
        print_shares(shares, f"the gateway during {args.profile_scenario} at concurrency {levels[0]} "
                             f"(raw stacks in {args.profile})")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
