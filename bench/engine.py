"""Output tokens/s of the embedded engine at several concurrencies, and the ratio to concurrency 1.

    python bench/engine.py [--model smollm2] [--concurrency 1,8,32] [--runs 3] [--tokens 32] [--device cuda]
                           [--grammar]

Starts `agentrl engine` as a real process (or uses --url), then for each concurrency c sends c requests at
once (each prompt different, max_new_tokens fixed, ignore_eos, temperature 1) and measures generated
tokens / wall time. Prints the median of --runs runs per concurrency, the ratio to concurrency 1, and the
mean decode batch size the engine reports. Numbers depend on the machine and on anything else it runs.

``--grammar``: at every concurrency, each run also sends the same batch with every request constrained by a
grammar (SGLang's ``regex``; one that cannot end before max_new_tokens, so every row generates exactly as
many tokens as unconstrained) and with half of them constrained, interleaved with the unconstrained batch;
prints constrained and mixed tokens/s as ratios to the unconstrained batch measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder comes first on sys.path and its name would shadow the engine package.
sys.path = [str(REPO)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
TOPICS = ["the sea", "a clock", "rain", "mountains", "bread", "a library", "winter", "the moon", "trains", "bees",
          "a garden", "music", "salt", "maps", "lanterns", "glass"]


def prompts(n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from engine.models import smollm2_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Write a short poem about {TOPICS[i % len(TOPICS)]} (#{i})."}]
        out.append(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    return out


def start_engine(model: str, port: int, max_running: int, threads: int, device: str = "cpu") -> tuple[subprocess.Popen, object]:
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-m", "agentrl", "engine", "--model", model, "--port", str(port),
                             "--max-running-requests", str(max_running), "--threads", str(threads),
                             "--device", device],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"engine exited:\n{log.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, log
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("engine did not start within 300 s")


GRAMMAR = {"regex": "[a-z ,.]{400,}"}  # lower-case prose that cannot end within the token budget


async def one_run(client: httpx.AsyncClient, url: str, batch: list[list[int]], tokens: int,
                  constrained: int = 0) -> tuple[float, int]:
    """Send ``batch`` at once; the first ``constrained`` requests carry :data:`GRAMMAR`."""
    async def call(row: int, ids: list[int]) -> int:
        sampling = {"temperature": 1.0, "max_new_tokens": tokens, "ignore_eos": True,
                    **(GRAMMAR if row < constrained else {})}
        body = {"input_ids": ids, "sampling_params": sampling}
        response = await client.post(url + "/generate", json=body)
        response.raise_for_status()
        return response.json()["meta_info"]["completion_tokens"]

    start = time.perf_counter()
    counts = await asyncio.gather(*(call(row, ids) for row, ids in enumerate(batch)))
    return time.perf_counter() - start, sum(counts)


async def bench(url: str, levels: list[int], runs: int, tokens: int, grammar: bool = False) -> list[dict]:
    all_prompts = prompts(max(levels))
    rows = []
    async with httpx.AsyncClient(timeout=600) as client:
        await one_run(client, url, all_prompts[:2], 4, constrained=1 if grammar else 0)  # warm-up (compiles)
        for c in levels:
            rates: list[float] = []
            constrained: list[float] = []
            mixed: list[float] = []
            before = (await client.get(url + "/get_server_info")).json()["internal_states"][0]
            for _ in range(runs):
                wall, generated = await one_run(client, url, all_prompts[:c], tokens)
                rates.append(generated / wall)
                if grammar:  # interleaved with the unconstrained batch: same load, same run
                    wall, generated = await one_run(client, url, all_prompts[:c], tokens, constrained=c)
                    constrained.append(generated / wall)
                    if c >= 2:
                        wall, generated = await one_run(client, url, all_prompts[:c], tokens, constrained=c // 2)
                        mixed.append(generated / wall)
            after = (await client.get(url + "/get_server_info")).json()["internal_states"][0]
            steps = after["decode_steps"] - before["decode_steps"]
            mean_batch = (after["decode_rows"] - before["decode_rows"]) / steps if steps else 0.0
            row = {"concurrency": c, "median": statistics.median(rates), "runs": rates, "batch": mean_batch}
            if grammar:
                row["constrained"] = statistics.median(constrained)
                row["mixed"] = statistics.median(mixed) if mixed else None
            rows.append(row)
            print(f"  concurrency {c:>3}: {', '.join(f'{r:.1f}' for r in rates)} tok/s"
                  + (f"; constrained {', '.join(f'{r:.1f}' for r in constrained)}; half constrained "
                     f"{', '.join(f'{r:.1f}' for r in mixed)}" if grammar else ""), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--url", default=None, help="use a running engine instead of starting one")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="max_new_tokens per request")
    parser.add_argument("--threads", type=int, default=1, help="the engine's torch CPU threads")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="the engine's device")
    parser.add_argument("--grammar", action="store_true",
                        help="also measure grammar-constrained batches (all rows, half the rows) against unconstrained")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    proc = log = None
    url = args.url
    if url is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc, log = start_engine(args.model, port, max(levels), args.threads, args.device)
        url = f"http://127.0.0.1:{port}"
    try:
        load = os.getloadavg()[0]
        print(f"engine bench: model {args.model} on {args.device}, {args.tokens} new tokens per request, "
              f"{args.runs} runs each, engine threads {args.threads}; "
              f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), load average {load:.1f}")
        rows = asyncio.run(bench(url, levels, args.runs, args.tokens, args.grammar))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
            log.close()
    base = rows[0]["median"]
    print(f"\n| concurrency | output tok/s (median of {args.runs}) | vs concurrency {rows[0]['concurrency']} | mean decode batch |")
    print("|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['concurrency']} | {row['median']:.1f} | {row['median'] / base:.2f}x | {row['batch']:.1f} |")
    if args.grammar:
        print(f"\n| concurrency | unconstrained tok/s | all constrained tok/s | ratio | half constrained tok/s | ratio |")
        print("|---:|---:|---:|---:|---:|---:|")
        for row in rows:
            half = "- | -" if row["mixed"] is None else f"{row['mixed']:.1f} | {row['mixed'] / row['median']:.2f}x"
            print(f"| {row['concurrency']} | {row['median']:.1f} | {row['constrained']:.1f} | "
                  f"{row['constrained'] / row['median']:.2f}x | {half} |")
    print(f"load average after: {os.getloadavg()[0]:.1f} (other processes on this machine share the CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
