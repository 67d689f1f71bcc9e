"""Gateway overhead: our recording gateway vs LiteLLM's proxy, over stand-in upstreams that answer instantly.

In one run, for each concurrency (default 1, 8, 32):

- **ours**: `agentrl gateway` (one process, SQLite, recording every turn: session lookup, parent lookup,
  chat template, token ids + logprobs committed before the response) over `gateway.standin`, a
  SGLang-native upstream that returns a fixed completion at once;
- **LiteLLM**: `litellm --config ...` (one worker) over the same stand-in's OpenAI-compatible route
  (`/v1/chat/completions`). If LiteLLM is not installed, a plain httpx pass-through proxy (this file,
  `--serve-passthrough`) is measured instead and labelled so.

Added latency = the proxy's latency percentile minus the same percentile of calling the upstream
directly at the same concurrency. The load generator, upstream and proxies share this machine's cores,
so absolute numbers depend on load; the ratio in the same run is the figure to read.

    python bench/gateway.py [--requests 400] [--concurrency 1,8,32] [--litellm PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agentrl.procs import Processes  # noqa: E402
from tests.conftest import free_port  # noqa: E402

ADMIN, AGENT = "bench-admin", "bench-agent"
PEER_KEY = "sk-bench-" + "5f3a9c" * 6  # LiteLLM refuses to start without a master key
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Say hello in one short sentence."}]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def load(url: str, make_body: Any, headers_for: Any, total: int, concurrency: int) -> dict[str, float]:
    """Send ``total`` POSTs with ``concurrency`` workers; latencies in ms, requests/s over the wall time."""
    latencies: list[float] = []
    errors = 0
    counter = iter(range(total))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        async def worker(slot: int) -> None:
            nonlocal errors
            for _ in counter:
                start = time.perf_counter()
                resp = await client.post(url, json=make_body(), headers=headers_for(slot))
                latencies.append((time.perf_counter() - start) * 1000)
                if resp.status_code != 200:
                    errors += 1
                    if errors == 1:
                        print(f"  error {resp.status_code}: {resp.text[:200]}", file=sys.stderr)

        wall = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        wall = time.perf_counter() - wall
    return {"rps": len(latencies) / wall, "p50": percentile(latencies, 0.5), "p99": percentile(latencies, 0.99),
            "errors": float(errors)}


def run_load(url: str, make_body: Any, headers_for: Any, total: int, concurrency: int) -> dict[str, float]:
    asyncio.run(load(url, make_body, headers_for, min(20, total), concurrency))  # warm-up
    return asyncio.run(load(url, make_body, headers_for, total, concurrency))


def find_litellm(explicit: str | None) -> str | None:
    for candidate in (explicit, os.environ.get("AGENTRL_BENCH_LITELLM"), str(REPO / ".venv-bench/bin/litellm"),
                      shutil.which("litellm")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def serve_passthrough(port: int, upstream: str) -> None:
    """A plain httpx pass-through proxy (the fallback baseline when LiteLLM is unavailable)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=1000), timeout=60)

    async def forward(request: Request) -> Response:
        resp = await client.post(upstream + "/v1/chat/completions", content=await request.body(),
                                 headers={"content-type": "application/json"})
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    async def health(_: Request) -> Response:
        return Response("ok")

    app = Starlette(routes=[Route("/v1/chat/completions", forward, methods=["POST"]), Route("/health", health)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="requests per concurrency level")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--litellm", default=None, help="path of the litellm executable")
    parser.add_argument("--serve-passthrough", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_passthrough:
        serve_passthrough(args.serve_passthrough, args.upstream)
        return 0
    levels = [int(c) for c in args.concurrency.split(",")]
    from engine.models import tiny_dir

    tokenizer = str(tiny_dir())
    work = Path(tempfile.mkdtemp(prefix="agentrl-bench-gw-"))
    results: dict[str, dict[int, dict[str, float]]] = {}
    with Processes(work / "logs") as procs:
        up_port, gw_port, peer_port = free_port(), free_port(), free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        child = procs.start("standin", [sys.executable, "-m", "gateway.standin", "--port", str(up_port),
                                        "--tokenizer", tokenizer])
        procs.wait_healthy(child, upstream + "/health", timeout_s=120)
        gateway = f"http://127.0.0.1:{gw_port}"
        db = f"sqlite+aiosqlite:///{work}/bench.db"
        child = procs.start_agentrl("gateway", ["gateway", "--engine-url", upstream, "--db", db, "--port",
                                                str(gw_port), "--admin-key", ADMIN, "--agent-key", AGENT,
                                                "--log-level", "warning"])
        procs.wait_healthy(child, gateway + "/health", timeout_s=180)
        litellm = find_litellm(args.litellm)
        peer_name = "LiteLLM proxy" if litellm else "httpx pass-through (LiteLLM not installed)"
        peer = f"http://127.0.0.1:{peer_port}"
        if litellm:
            config = work / "litellm.yaml"
            config.write_text(
                "model_list:\n  - model_name: standin\n    litellm_params:\n      model: openai/standin\n"
                f"      api_base: {upstream}/v1\n      api_key: none\n"
                "litellm_settings:\n  telemetry: false\n  set_verbose: false\n"
                f"general_settings:\n  master_key: {PEER_KEY}\n")
            child = procs.start("litellm", [litellm, "--config", str(config), "--port", str(peer_port),
                                            "--num_workers", "1"],
                                env={"LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False"})
            procs.wait_healthy(child, peer + "/health/liveliness", timeout_s=300)
        else:
            child = procs.start("passthrough", [sys.executable, __file__, "--serve-passthrough", str(peer_port),
                                                "--upstream", upstream])
            procs.wait_healthy(child, peer + "/health", timeout_s=60)

        with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {ADMIN}"}) as admin:
            keys = [admin.post("/v1/sessions", json={"group_id": "bench"}).json()["api_key"]
                    for _ in range(max(levels))]
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
        prompt_ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
        if isinstance(prompt_ids, dict):
            prompt_ids = prompt_ids["input_ids"]
        native = {"input_ids": list(prompt_ids), "return_logprob": True,
                  "sampling_params": {"max_new_tokens": 64, "temperature": 1.0}}
        chat = {"model": "standin", "messages": MESSAGES, "max_tokens": 64}

        def no_auth(_: int) -> dict[str, str]:
            return {}

        def session_auth(slot: int) -> dict[str, str]:
            return {"Authorization": f"Bearer {keys[slot]}"}

        def peer_auth(_: int) -> dict[str, str]:
            return {"Authorization": f"Bearer {PEER_KEY}"}

        for c in levels:
            n = max(args.requests, 4 * c)
            print(f"concurrency {c}: {n} requests each ...", flush=True)
            results.setdefault("upstream native", {})[c] = run_load(upstream + "/generate", lambda: native, no_auth, n, c)
            results.setdefault("ours", {})[c] = run_load(gateway + "/v1/chat/completions", lambda: chat,
                                                         session_auth, n, c)
            results.setdefault("upstream openai", {})[c] = run_load(upstream + "/v1/chat/completions", lambda: chat,
                                                                    no_auth, n, c)
            results.setdefault("peer", {})[c] = run_load(peer + "/v1/chat/completions", lambda: chat, peer_auth, n, c)
        recorded = httpx.get(gateway + "/metrics").text
        rows = sum(float(line.split()[-1]) for line in recorded.splitlines()
                   if line.startswith("agentrl_gateway_interactions_recorded_total"))

    print()
    print(f"gateway overhead over an instant upstream ({os.cpu_count()} cores shared with the load generator)")
    header = f"{'proxy':44s} {'conc':>4s} {'req/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s} {'added p50':>10s} {'added p99':>10s} {'errors':>6s}"
    print(header)
    print("-" * len(header))
    for name, label, base in (("ours", "agentrl gateway (recording, SQLite)", "upstream native"),
                              ("peer", peer_name, "upstream openai")):
        for c in levels:
            r, b = results[name][c], results[base][c]
            print(f"{label:44s} {c:4d} {r['rps']:8.1f} {r['p50']:8.2f} {r['p99']:8.2f} "
                  f"{r['p50'] - b['p50']:10.2f} {r['p99'] - b['p99']:10.2f} {int(r['errors']):6d}")
    for c in levels:
        ours, peer_r = results["ours"][c], results["peer"][c]
        print(f"concurrency {c:3d}: ours/{'LiteLLM' if litellm else 'pass-through'} requests/s = "
              f"{ours['rps'] / peer_r['rps']:.2f}x, added p50 {ours['p50'] - results['upstream native'][c]['p50']:.2f} ms "
              f"vs {peer_r['p50'] - results['upstream openai'][c]['p50']:.2f} ms")
    print(f"turns recorded by the gateway: {int(rows)} (warm-ups included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
