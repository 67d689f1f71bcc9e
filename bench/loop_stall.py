"""How long one huge request holds the gateway's event loop: ``/health`` latency while a 7.9 MB prompt is
processed at a 128k context (issue 36: 98-139 ms stalls; the target is no stall over 20 ms).

A tiny engine and one gateway process (SQLite, ``--context-length 131072``) run as children. Per run, a
prober thread sends ``GET /health`` back to back on one keep-alive connection, while another thread posts one
chat request whose user message is ``--mb`` MB of words (the tiny model's vocabulary, seeded): it passes the
size pre-check (characters / longest token < context) and is refused only once tokenized (about 3.2 M
tokens). Reported per run: the answer's status, how long it took, and the slowest and the 99th-percentile
``/health`` answer while it was in flight, next to the same for 3 s with nothing in flight just before (the
machine's own noise: on a shared 2-core machine at a load of 8-11, an idle gateway's slowest ``/health``
alone is 15-40 ms) and the load average; then the medians over ``--runs`` runs (5). A ``/health`` answer
takes ~1 ms on an idle loop, so its latency is the loop's stall plus that.

    python bench/loop_stall.py [--runs 5] [--mb 7.9] [--context-length 131072]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # before bench/, whose gateway.py would shadow the gateway package

from agentrl.procs import Processes, free_port  # noqa: E402

AGENT = "loop-stall-agent"


def prompt_text(megabytes: float, seed: int = 0) -> str:
    """``megabytes`` of space-separated words of the tiny model's vocabulary."""
    from transformers import AutoTokenizer

    from engine.models import tiny_dir

    vocab = AutoTokenizer.from_pretrained(tiny_dir()).get_vocab()
    words = sorted({w.lstrip("Ġ") for w in vocab if w.lstrip("Ġ").isalpha() and len(w) > 3})
    rng = random.Random(seed)
    size = int(megabytes * 1_000_000)
    parts: list[str] = []
    total = 0
    while total < size:
        word = rng.choice(words)
        parts.append(word)
        total += len(word) + 1
    return " ".join(parts)[:size]


def idle_probe(base: str, seconds: float = 3.0) -> tuple[float, float]:
    """(max, p99) of ``/health`` with nothing else in flight: this machine's noise floor at the moment."""
    latencies: list[float] = []
    with httpx.Client(base_url=base, timeout=60.0) as http:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            started = time.perf_counter()
            http.get("/health")
            latencies.append((time.perf_counter() - started) * 1000.0)
    latencies.sort()
    return round(latencies[-1], 1), round(latencies[int(len(latencies) * 0.99)], 1)


def one_run(base: str, body: bytes) -> dict[str, float]:
    done = threading.Event()
    latencies: list[float] = []
    answer: dict[str, float] = {}

    def probe() -> None:
        with httpx.Client(base_url=base, timeout=60.0) as http:
            while not done.is_set():
                started = time.perf_counter()
                http.get("/health")
                latencies.append((time.perf_counter() - started) * 1000.0)

    def post() -> None:
        started = time.perf_counter()
        with httpx.Client(base_url=base, timeout=600.0) as http:
            resp = http.post("/v1/chat/completions", content=body,
                             headers={"Authorization": f"Bearer {AGENT}", "Content-Type": "application/json"})
        answer.update(status=resp.status_code, seconds=time.perf_counter() - started)
        done.set()

    prober = threading.Thread(target=probe)
    prober.start()
    time.sleep(0.2)  # the prober's connection is open and warm
    warm = len(latencies)
    poster = threading.Thread(target=post)
    poster.start()
    poster.join()
    prober.join()
    during = sorted(latencies[warm:])
    p99 = during[min(len(during) - 1, int(len(during) * 0.99))] if during else float("nan")
    return {"status": answer["status"], "request_s": round(answer["seconds"], 2), "probes": len(during),
            "health_max_ms": round(max(during), 1) if during else float("nan"), "health_p99_ms": round(p99, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--mb", type=float, default=7.9, help="size of the prompt's user message (MB)")
    p.add_argument("--context-length", type=int, default=131072)
    p.add_argument("--out", type=Path, default=None, help="write the runs as JSON here")
    args = p.parse_args(argv)
    text = prompt_text(args.mb)
    body = json.dumps({"model": "tiny", "max_tokens": 4,
                       "messages": [{"role": "user", "content": text}]}).encode()
    with Processes(Path("runs") / "loop-stall-logs") as procs:
        engine_port, gw_port = free_port(), free_port()
        engine = procs.start_agentrl("engine", ["engine", "--model", "tiny", "--port", str(engine_port)])
        procs.wait_healthy(engine, f"http://127.0.0.1:{engine_port}/health")
        db = Path("runs") / f"loop-stall-{gw_port}.db"
        gateway = procs.start_agentrl("gateway", [
            "gateway", "--engine-url", f"http://127.0.0.1:{engine_port}", "--port", str(gw_port),
            "--db", f"sqlite+aiosqlite:///{db}", "--admin-key", "loop-stall-admin", "--agent-key", AGENT,
            "--context-length", str(args.context_length), "--log-level", "warning"])
        base = f"http://127.0.0.1:{gw_port}"
        procs.wait_healthy(gateway, base + "/health")
        runs = []
        for i in range(args.runs):
            idle_max, idle_p99 = idle_probe(base)
            run = one_run(base, body)
            run.update(idle_max_ms=idle_max, idle_p99_ms=idle_p99, load=os.getloadavg()[0])
            runs.append(run)
            print(f"run {i + 1}: answer {run['status']} in {run['request_s']} s; /health while in flight: "
                  f"max {run['health_max_ms']} ms, p99 {run['health_p99_ms']} ms ({run['probes']} probes); "
                  f"idle just before: max {idle_max} ms, p99 {idle_p99} ms; load {run['load']:.1f}", flush=True)
        db.unlink(missing_ok=True)
    medians = {k: statistics.median(r[k] for r in runs)
               for k in ("health_max_ms", "health_p99_ms", "request_s", "idle_max_ms", "idle_p99_ms", "load")}
    print(f"median of {args.runs} runs ({args.mb} MB prompt, context {args.context_length}): /health max "
          f"{medians['health_max_ms']:.1f} ms, p99 {medians['health_p99_ms']:.1f} ms; request "
          f"{medians['request_s']:.2f} s; idle /health max {medians['idle_max_ms']:.1f} ms, p99 "
          f"{medians['idle_p99_ms']:.1f} ms; load average {medians['load']:.1f}")
    if args.out is not None:
        args.out.write_text(json.dumps({"runs": runs, "medians": medians, "mb": args.mb,
                                        "context_length": args.context_length}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
