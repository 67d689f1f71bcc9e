"""Does /release_memory_occupation really give the GPU memory back? Measured on a running engine process.

Starts the embedded engine (``python -m agentrl engine``) on random weights of a model shape (default the
Qwen2.5-1.5B shape on CUDA, tiny on CPU), fills its KV cache with a concurrent batch of generations, then:
pause (abort) -> release ``kv_cache`` -> release ``weights`` -> resume ``weights`` -> resume ``kv_cache``
-> continue. After each step it reads the engine's own allocator figures (``/get_server_info``:
``memory_allocated_bytes`` / ``memory_reserved_bytes``) and what the driver says the engine process holds
(``nvidia-smi --query-compute-apps``), and times each call. Greedy output before and after must be the same
tokens with the same logprobs (the weights came back unchanged).

    python bench/memory_occupation.py                          # GPU
    python bench/memory_occupation.py --device cpu --model tiny

Writes ``memory_occupation.json`` / ``.md`` to ``--out`` (default ``$OUT``). Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

GIB = 2**30


def driver_bytes(pid: int) -> int | None:
    """GPU memory the driver counts for ``pid`` (nvidia-smi), or None where it cannot say."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return int(parts[1]) * 2**20
    return None


def measure(url: str, pid: int, label: str, seconds: float | None) -> dict[str, Any]:
    state = httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"][0]
    return {"step": label, "seconds": seconds, "released": state.get("memory_released"),
            "allocated": state.get("memory_allocated_bytes"), "reserved": state.get("memory_reserved_bytes"),
            "driver": driver_bytes(pid)}


def timed_post(url: str, path: str, body: dict[str, Any] | None) -> float:
    start = time.perf_counter()
    resp = httpx.post(url + path, json=body, timeout=600)
    if resp.status_code != 200:
        raise RuntimeError(f"POST {path} answered {resp.status_code}: {resp.text[:300]}")
    return time.perf_counter() - start


def greedy(url: str, prompt: list[int], n: int) -> dict[str, Any]:
    resp = httpx.post(f"{url}/generate", timeout=600, json={
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}})
    resp.raise_for_status()
    body = resp.json()
    return {"ids": body["output_ids"], "logprobs": [e[0] for e in body["meta_info"]["output_token_logprobs"]]}


def fill(url: str, concurrency: int, prompt_len: int, new_tokens: int, vocab: int) -> float:
    """``concurrency`` generations at once (random prompts): the engine's batch and KV cache grow."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(5, vocab) for _ in range(prompt_len)] for _ in range(concurrency)]

    def one(prompt: list[int]) -> int:
        resp = httpx.post(f"{url}/generate", timeout=600, json={
            "input_ids": prompt, "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True}})
        resp.raise_for_status()
        return len(resp.json()["output_ids"])

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, prompts))
    return tokens / (time.perf_counter() - start)


def fmt_gib(x: int | None) -> str:
    return "n/a" if x is None else f"{x / GIB:.2f}"


def render(meta: dict[str, Any], rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    lines = [f"## Engine memory release/resume: {meta['date']}, {meta['machine']}", "",
             f"model {meta['model']} (engine weights float32), {meta['concurrency']} concurrent generations of "
             f"{meta['prompt_len']} + {meta['new_tokens']} tokens first ({meta['fill_tokens_per_s']:.0f} tokens/s), "
             f"torch {meta['torch']}, command `{meta['command']}`", "",
             "| step | call s | released | allocated GiB | reserved GiB | driver (nvidia-smi) GiB |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        secs = "" if r["seconds"] is None else f"{r['seconds']:.3f}"
        lines.append(f"| {r['step']} | {secs} | {','.join(r['released'] or []) or '-'} | {fmt_gib(r['allocated'])} "
                     f"| {fmt_gib(r['reserved'])} | {fmt_gib(r['driver'])} |")
    lines += ["", "| check | value | ok |", "|---|---|---|"]
    lines += [f"| {c['check']} | {c['value']} | {'PASS' if c['ok'] else 'FAIL'} |" for c in checks]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--model", default=None, choices=["tiny", "qwen2.5-1.5b"])
    p.add_argument("--concurrency", type=int, default=None, help="default 64 (cuda) / 4 (cpu)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 512 (cuda) / 16 (cpu)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 256 (cuda) / 8 (cpu)")
    p.add_argument("--out", default=os.environ.get("OUT") or None)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.model = args.model or ("qwen2.5-1.5b" if cuda else "tiny")
    args.concurrency = args.concurrency or (64 if cuda else 4)
    args.prompt_len = args.prompt_len or (512 if cuda else 16)
    args.new_tokens = args.new_tokens or (256 if cuda else 8)

    import torch

    from agentrl.procs import Processes
    from bench.two_gpu import NO_MULTICAST, free_port, model_dir

    os.environ.update(NO_MULTICAST)
    path = model_dir(args.model, "bfloat16" if cuda else "float32", "cuda:0" if cuda else "cpu")
    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": torch.cuda.get_device_name(0) if cuda else f"CPU x{os.cpu_count()}", "model": args.model,
        "concurrency": args.concurrency, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "torch": torch.__version__, "command": " ".join(["python", *sys.argv])}
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    with Processes(Path(tempfile.mkdtemp(prefix="agentrl-memory-"))) as procs:
        port = free_port()
        engine = procs.start("engine", [sys.executable, "-m", "agentrl", "engine", "--model", str(path), "--port",
                                        str(port), "--device", args.device, "--max-running-requests",
                                        str(args.concurrency)], env=NO_MULTICAST)
        url = f"http://127.0.0.1:{port}"
        procs.wait_healthy(engine, url + "/health", timeout_s=600)
        pid = engine.proc.pid
        vocab = min(49152, int(httpx.get(f"{url}/get_server_info", timeout=30).json().get("vocab_size") or 49152))
        prompt = list(range(100, 132))
        rows.append(measure(url, pid, "loaded", None))
        meta["fill_tokens_per_s"] = fill(url, args.concurrency, args.prompt_len, args.new_tokens, vocab)
        before = greedy(url, prompt, 16)
        rows.append(measure(url, pid, f"after {args.concurrency} generations", None))
        rows.append(measure(url, pid, "pause (abort)", timed_post(url, "/pause_generation", {"mode": "abort"})))
        rows.append(measure(url, pid, "release kv_cache",
                            timed_post(url, "/release_memory_occupation", {"tags": ["kv_cache"]})))
        rows.append(measure(url, pid, "release weights",
                            timed_post(url, "/release_memory_occupation", {"tags": ["weights", "cuda_graph"]})))
        refused = httpx.post(f"{url}/generate", json={"input_ids": prompt}, timeout=60).status_code
        rows.append(measure(url, pid, "resume weights",
                            timed_post(url, "/resume_memory_occupation", {"tags": ["weights", "cuda_graph"]})))
        rows.append(measure(url, pid, "resume kv_cache",
                            timed_post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})))
        timed_post(url, "/continue_generation", {})
        after = greedy(url, prompt, 16)
        rows.append(measure(url, pid, "continue, one generation", None))

    by = {r["step"]: r for r in rows}
    full, kv, none = by[f"after {args.concurrency} generations"], by["release kv_cache"], by["release weights"]
    key = "driver" if full["driver"] is not None else "reserved"
    if full[key] is not None:
        checks.append({"check": f"release kv_cache frees the cached KV blocks ({key})",
                       "value": f"{fmt_gib(full[key])} -> {fmt_gib(kv[key])} GiB", "ok": kv[key] < full[key]})
        weights = sum(v for v in [by["loaded"]["allocated"]] if v) or 0
        checks.append({"check": f"release weights frees the weights ({key}; allocated at load {fmt_gib(weights)} GiB)",
                       "value": f"{fmt_gib(kv[key])} -> {fmt_gib(none[key])} GiB",
                       "ok": none[key] <= kv[key] - 0.9 * weights})
    checks.append({"check": "generation refused while released", "value": f"HTTP {refused}", "ok": refused == 503})
    gap = max((abs(a - b) for a, b in zip(before["logprobs"], after["logprobs"])), default=0.0)
    checks.append({"check": "greedy output after resume = before (tokens; max logprob difference)",
                   "value": f"{'same' if before['ids'] == after['ids'] else 'DIFFERENT'} tokens; {gap:.2e}",
                   "ok": before["ids"] == after["ids"] and gap <= 1e-4})
    text = render(meta, rows, checks)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "memory_occupation.md").write_text(text)
        (out / "memory_occupation.json").write_text(json.dumps({"meta": meta, "rows": rows, "checks": checks}, indent=1))
    print("\n" + text, flush=True)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
