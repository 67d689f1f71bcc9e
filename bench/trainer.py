"""Trainer throughput: our GRPO step against a naive single-GPU Hugging Face step, in one run, on two batches.

Variants (each starts from the same random weights, saved once):

- **naive**: a plain HF step: float32 master weights on the device, ``torch.autocast`` bf16, fused AdamW, the
  full float32 logits, a token-logprob loss ``-(A * logp * mask).sum() / mask.sum()``; micro-batches of rows
  in arrival order, padded to the longest row, within the token budget.
- **ours, unpacked**: ``trainer.step.train_step`` with ``packing=False`` (padded rows, full logits) -- the
  step as it was, and the reference for the packed step's numbers.
- **ours**: ``train_step`` as configured for GPUs: packed rows, logprobs only at loss positions in chunks
  (``trainer.packing``), ``compile=True`` (whole decoder layers on one rank), fused AdamW with the clipping
  folded in, and on one rank no FSDP2 but bf16 compute weights kept beside the float32 masters
  (``trainer.shadow``). Alternatives for comparison: **ours-blocks** (each layer's attention, MLP and norms
  compiled, as with FSDP2), **ours-eager** (no compile), **ours-fsdp** (one-rank FSDP2, the earlier path).

Batches: **uniform** (8 rows x 1,024 tokens, 40% of each row is the response) and **agent** (64 rows of
200-4,000 tokens, ~60% prompt, loss-masked), groups of 8. Printed per batch and variant: tokens/s (real
tokens, no padding), ratio to naive, step time (median of the timed steps), peak memory and MFU (model
FLOPs ``6 x params x tokens`` plus causal attention, over the dense bf16 peak of the card, 989 TFLOP/s for
an H100/H200). The packed step's first-step loss and gradient norm must match the unpacked step's
(bf16 tolerance on GPUs, float32's on CPU). ``--profile`` also runs ``torch.profiler`` over one more step
of ``--profile-variants`` on the uniform batch: the top operators by device time, and (GPU) the chrome
trace with a table of the GPU's idle time by step phase and by the CPU operator running meanwhile.

    python bench/trainer.py                              # GPU: Qwen2.5-1.5B shape (random weights), bf16
    python bench/trainer.py --device cpu --model tiny    # the same code path on CPU, in seconds

Writes ``trainer_bench.json`` / ``.md`` (and the profiles' tables) to ``--out`` (default ``$OUT``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

PEAK_BF16 = 989e12  # dense bf16 FLOP/s of an H100/H200 SXM (datasheet); 790 measured on an H200 here


# ------------------------------------------------------------------------------------------------ inputs


def build_model_dir(shape: str, root: Path, device: str) -> Path:
    """Random weights (seed 0) of ``shape`` saved as a HF directory (float32; the config says bfloat16 on GPUs)."""
    from transformers import AutoModelForCausalLM

    from bench.weight_sync import build_config

    target = root / f"trainer-bench-{shape}"
    if (target / "config.json").exists():
        return target
    config = build_config(shape, vocab=151936 if shape == "qwen2.5-1.5b" else 49152)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(target)
    del model
    return target


def make_rows(lengths: list[int], prompt_frac: float, vocab: int, seed: int, group_size: int = 8) -> list:
    """Rows of the given lengths: a prompt of ``prompt_frac`` of the row (mask 0), then the response (mask 1)."""
    from agentrl.trajectory import Row

    rng = np.random.default_rng(seed)
    rows = []
    for i, n in enumerate(lengths):
        g, j = divmod(i, group_size)
        n_prompt = max(1, min(n - 2, int(round(n * prompt_frac))))
        ids = rng.integers(5, min(vocab, 49152), n).astype(np.int32)
        mask = (np.arange(n) >= n_prompt).astype(np.int8)
        behaviour = np.where(mask == 1, -math.log(vocab) + rng.normal(0.0, 0.3, n), 0.0).astype(np.float32)
        reward = float((i * 7 + g) % 3 == 0)
        rows.append(Row(
            input_ids=ids, loss_mask=mask, logprobs=behaviour,
            versions=np.where(mask == 1, 0, -1).astype(np.int32), turn_ids=np.where(mask == 1, 0, -1).astype(np.int32),
            turn_rewards=np.array([reward]), turn_returns=np.array([reward]), reward=reward, is_truncated=False,
            session_id=f"s{i}", group_id=f"g{g}", leaf_id=f"l{i}", row_id=f"r{i}",
        ))
    return rows


def batches(args: argparse.Namespace, vocab: int) -> dict[str, list]:
    rng = np.random.default_rng(1)
    agent_lengths = [int(x) for x in rng.integers(args.agent_min, args.agent_max + 1, args.agent_rows)]
    return {"uniform": make_rows([args.seq_len] * args.rows, 0.6, vocab, seed=2),
            "agent": make_rows(agent_lengths, 0.6, vocab, seed=3)}


def model_flops(config, rows: list) -> float:
    """Forward+backward FLOPs of the model on ``rows``: 6 x matmul params x tokens + causal attention."""
    h, i, v, n = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or h // heads
    per_layer = h * hd * (heads * 2 + kv * 2) + 3 * h * i
    matmul_params = n * per_layer + v * h  # the LM head counts once; the embedding lookup is free
    tokens = sum(r.num_tokens for r in rows)
    attn = sum(6 * n * heads * hd * r.num_tokens ** 2 for r in rows)  # 2 matmuls x 2 FLOP x len^2/2, x3 for bwd
    return 6.0 * matmul_params * tokens + attn


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    torch._dynamo.reset()  # compiled graphs of the previous variant's model would keep its tensors alive
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


# ------------------------------------------------------------------------------------------------ naive


def naive_micro_batches(rows: list, budget: int) -> list[list[int]]:
    """Rows in arrival order, cut whenever the padded size (rows x longest) would pass ``budget``."""
    out: list[list[int]] = []
    width = 0
    for i, r in enumerate(rows):
        if out and (len(out[-1]) + 1) * max(width, r.num_tokens) <= budget:
            out[-1].append(i)
            width = max(width, r.num_tokens)
        else:
            out.append([i])
            width = r.num_tokens
    return out


def run_naive(path: Path, rows: list, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from trainer.data import collate

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa").to(device)
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")
    adv = torch.tensor([1.0 if r.reward > 0 else -0.5 for r in rows])
    micro = [collate(rows, idx, adv).to(device) for idx in naive_micro_batches(rows, args.micro_batch_tokens)]
    total = float(sum(float(m.loss_mask.sum()) for m in micro))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    steps = []
    for _ in range(args.steps):
        sync(device)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for m in micro:
            with autocast:
                logits = model(input_ids=m.input_ids, attention_mask=m.attention_mask).logits[:, :-1]
            logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, m.input_ids[:, 1:, None])[..., 0]
            loss = -(m.advantages[:, None] * logp * m.loss_mask).sum() / total
            loss.backward()
            loss_sum += float(loss.detach())
            del logits, logp, loss
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        sync(device)
        steps.append({"step_s": time.perf_counter() - start, "loss": loss_sum, "grad_norm": norm})
    out = summarise(steps, rows, device)
    del model, opt, micro
    return out


# ------------------------------------------------------------------------------------------------ ours


def run_ours(path: Path, rows: list, args: argparse.Namespace, info, *, packing: bool, compile: bool, steps: int,
             profile: Path | None = None, whole_layers: bool | None = None, fsdp: bool | None = None) -> dict[str, Any]:
    from trainer.config import TrainerSettings
    from trainer.model import build_optimizer, compile_body, load_model
    from trainer.step import train_step

    model = load_model(path, dtype=args.dtype, device=info.device, compile=compile and whole_layers is None, fsdp=fsdp)
    if compile and whole_layers is not None:
        compile_body(model, whole_layers=whole_layers)
    settings = TrainerSettings(engine_urls=["unused"], micro_batch_tokens=args.micro_batch_tokens, lr=args.lr,
                               packing=packing, compile=compile)
    opt = build_optimizer(model, settings, info.device)
    results = []
    for k in range(steps + (profile is not None)):
        sync(info.device)
        prof = None
        if profile is not None and k == steps:  # one extra step under the profiler, not timed
            from torch.profiler import ProfilerActivity, profile as torch_profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.device.type == "cuda" else [])
            prof = torch_profile(activities=acts)
            prof.__enter__()
        m = train_step(model, opt, rows, settings, info, version=0)
        sync(info.device)
        if prof is not None:
            prof.__exit__(None, None, None)
            key = "self_cuda_time_total" if info.device.type == "cuda" else "self_cpu_time_total"
            table = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70)
            profile.write_text(table)
            short = prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=50)
            print(f"--- profile: {profile.name} ---\n{short}", flush=True)
            if info.device.type == "cuda":
                trace = profile.with_suffix(".trace.json")
                prof.export_chrome_trace(str(trace))
                gaps = timeline(json.loads(trace.read_text()))
                profile.with_suffix(".gaps.txt").write_text(gaps)
                print(gaps, flush=True)
                import gzip
                import shutil

                with trace.open("rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
                trace.unlink()
        if prof is not None:
            break
        results.append({"step_s": m["perf/step_s"], "loss": m["actor/loss"], "grad_norm": m["actor/grad_norm"],
                        "entropy": m["actor/entropy"]})
    out = summarise(results, rows, info.device)
    del model, opt
    return out


def timeline(trace: dict[str, Any]) -> str:
    """Where one profiled step's wall time goes: GPU busy vs idle, and what the CPU did while the GPU idled.

    From a chrome trace of ``torch.profiler``: the union of kernel/memcpy/memset intervals is the GPU's busy
    time; each idle interval (the GPU waiting for the CPU to launch work, or for a synchronisation) is
    charged to the ``agentrl.*`` phase of ``trainer.step`` running on the CPU at that moment and to the
    innermost CPU operator then running."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    phases = [e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("agentrl.")]
    ops = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "python_function")]
    if not gpu or not phases:
        return "timeline: no GPU events or no agentrl.* phases in the trace\n"
    start = min(float(e["ts"]) for e in phases)
    end = max(max(float(e["ts"]) + float(e["dur"]) for e in phases), gpu[-1][1])
    busy, idle, cursor = 0.0, [], start
    for a, b in gpu:
        a, b = max(a, start), min(b, end)
        if b <= cursor:
            continue
        if a > cursor:
            idle.append((cursor, a))
        busy += b - max(a, cursor)
        cursor = b
    if cursor < end:
        idle.append((cursor, end))

    def inside(t: float, evs: list) -> list:
        return [e for e in evs if float(e["ts"]) <= t < float(e["ts"]) + float(e["dur"])]

    by_phase: dict[str, float] = {}
    by_op: dict[str, float] = {}
    for a, b in idle:
        mid = (a + b) / 2
        ph = inside(mid, phases)
        name = min(ph, key=lambda e: e["dur"])["name"] if ph else "(outside the phases)"
        by_phase[name] = by_phase.get(name, 0.0) + (b - a)
        op = inside(mid, ops)
        oname = str(min(op, key=lambda e: e["dur"])["name"])[:70] if op else "(no CPU op)"
        by_op[oname] = by_op.get(oname, 0.0) + (b - a)
    total = end - start
    lines = [f"step window {total / 1e3:.2f} ms: GPU busy {busy / 1e3:.2f} ms, idle {(total - busy) / 1e3:.2f} ms "
             f"in {len(idle)} gaps ({sum(1 for a, b in idle if b - a > 100)} over 0.1 ms)", "",
             "| phase (CPU, during GPU idle) | idle ms |", "|---|---|"]
    lines += [f"| {k} | {v / 1e3:.2f} |" for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1])]
    lines += ["", "| innermost CPU op during GPU idle | idle ms |", "|---|---|"]
    lines += [f"| {k} | {v / 1e3:.2f} |" for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:20]]
    gpu_phase: dict[str, float] = {}
    for e in phases:  # GPU time of the kernels launched while each phase ran on the CPU (by correlation id)
        gpu_phase.setdefault(e["name"], 0.0)
    corr = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
            corr[e["args"]["correlation"]] = float(e["ts"])
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            t = corr.get(e.get("args", {}).get("correlation"))
            ph = inside(t, phases) if t is not None else []
            if ph:
                n = min(ph, key=lambda x: x["dur"])["name"]
                gpu_phase[n] = gpu_phase.get(n, 0.0) + float(e["dur"])
    lines += ["", "| phase | GPU ms (kernels it launched) | CPU wall ms |", "|---|---|---|"]
    wall: dict[str, float] = {}
    for e in phases:
        wall[e["name"]] = wall.get(e["name"], 0.0) + float(e["dur"])
    lines += [f"| {k} | {gpu_phase.get(k, 0.0) / 1e3:.2f} | {wall[k] / 1e3:.2f} |" for k in wall]
    return "\n".join(lines) + "\n"


def summarise(steps: list[dict[str, float]], rows: list, device: torch.device) -> dict[str, Any]:
    timed = steps[1:] or steps  # the first step pays for warm-up (and compilation)
    step_s = statistics.median(s["step_s"] for s in timed)
    tokens = sum(r.num_tokens for r in rows)
    return {"first": steps[0], "steps": steps, "step_s": step_s, "tokens": tokens, "tokens_per_s": tokens / step_s,
            "peak_gib": peak_gib(device)}


# ------------------------------------------------------------------------------------------------ main


def render(meta: dict[str, Any], results: dict[str, dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    lines = [f"## Trainer step: {meta['date']}, {meta['machine']}", "",
             f"model {meta['model']} ({meta['params'] / 1e9:.3f} B params, float32 master weights, {meta['dtype']} "
             f"compute), micro-batch budget {meta['micro_batch_tokens']} tokens, torch {meta['torch']}, "
             f"command `{meta['command']}`", "",
             "| batch | variant | tokens | step s (median) | tokens/s | x naive | peak GiB | MFU | loss (step 1) | grad norm (step 1) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for batch, variants in results.items():
        naive = variants["naive"]["tokens_per_s"] if isinstance(variants.get("naive"), dict) else float("nan")
        for name, r in variants.items():
            if not isinstance(r, dict) or "step_s" not in r:
                lines.append(f"| {batch} | {name} | {r} | | | | | | | |")
                continue
            mfu = r["flops"] / r["step_s"] / PEAK_BF16 if meta["cuda"] else float("nan")
            lines.append(f"| {batch} | {name} | {r['tokens']} | {r['step_s']:.4g} | {r['tokens_per_s']:.0f} | "
                         f"{r['tokens_per_s'] / naive:.2f} | {r['peak_gib']:.1f} | {mfu:.1%} | {r['first']['loss']:.6g} | "
                         f"{r['first']['grad_norm']:.6g} |")
    lines += ["", "| check | value | limit | ok |", "|---|---|---|---|"]
    lines += [f"| {c['check']} | {c['value']} | {c['limit']} | {'PASS' if c['ok'] else 'FAIL'} |" for c in checks]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--model", default=None, choices=["tiny", "qwen2.5-1.5b"], help="default: qwen2.5-1.5b on cuda, tiny on cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="compute dtype (default bf16 on cuda)")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=None, help="uniform batch row length (default 1024 on cuda, 64 on cpu)")
    p.add_argument("--agent-rows", type=int, default=64)
    p.add_argument("--agent-min", type=int, default=None, help="default 200 (cuda) / 20 (cpu)")
    p.add_argument("--agent-max", type=int, default=None, help="default 4000 (cuda) / 120 (cpu)")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="default 16384 (cuda) / 512 (cpu)")
    p.add_argument("--steps", type=int, default=4, help="steps per variant; the first is compared, the rest timed")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--variants", default="naive,unpacked,ours", help="comma-separated: naive, unpacked, ours, ours-eager (packed, no compile), ours-layers (packed, whole decoder layers compiled: the default on one rank), ours-blocks (packed, each layer's attention, MLP and norms compiled: the default with FSDP2), ours-fsdp (ours with FSDP2 wrapping on one rank: the earlier one-GPU path)")
    p.add_argument("--batches", default="uniform,agent")
    p.add_argument("--no-compile", action="store_true", help="ours without torch.compile")
    p.add_argument("--profile", action="store_true", help="torch.profiler over one step of --profile-variants (uniform batch): operator table, chrome trace, GPU idle time by phase")
    p.add_argument("--profile-variants", default="unpacked,ours")
    p.add_argument("--out", default=os.environ.get("OUT") or None)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.model = args.model or ("qwen2.5-1.5b" if cuda else "tiny")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.seq_len = args.seq_len or (1024 if cuda else 64)
    args.agent_min = args.agent_min or (200 if cuda else 20)
    args.agent_max = args.agent_max or (4000 if cuda else 120)
    args.micro_batch_tokens = args.micro_batch_tokens or (16384 if cuda else 512)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]

    from transformers import AutoConfig

    from trainer.model import init_distributed

    info = init_distributed(args.device)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    root = Path("/dev/shm") if cuda and Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    start = time.perf_counter()
    path = build_model_dir(args.model, root, "cuda" if cuda else "cpu")
    config = AutoConfig.from_pretrained(path)
    all_batches = {k: v for k, v in batches(args, int(config.vocab_size)).items() if k in args.batches.split(",")}
    from bench.two_gpu import _param_count

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": torch.cuda.get_device_name(0) if cuda else f"CPU x{os.cpu_count()}", "cuda": cuda,
            "model": args.model, "params": sum(_param_count(config)), "dtype": args.dtype,
            "micro_batch_tokens": args.micro_batch_tokens, "torch": torch.__version__,
            "command": " ".join(["python", *sys.argv])}
    print(f"model dir ready after {time.perf_counter() - start:.1f}s", flush=True)
    results: dict[str, dict[str, Any]] = {}
    checks: list[dict[str, Any]] = []
    tol = {"loss": (2e-3, 2e-2), "grad_norm": (0.0, 3e-2)} if args.dtype == "bfloat16" else {"loss": (1e-6, 1e-4), "grad_norm": (0.0, 1e-4)}
    for bname, rows in all_batches.items():
        res: dict[str, Any] = {}
        flops = model_flops(config, rows)
        print(f"batch {bname}: {len(rows)} rows, {sum(r.num_tokens for r in rows)} tokens", flush=True)
        for v in variants:
            free(info.device)
            t0 = time.perf_counter()
            prof = (out / f"profile_{v}_{bname}.txt") if (args.profile and out and bname == "uniform"
                                                          and v in args.profile_variants.split(",")) else None
            try:
                if v == "naive":
                    r = run_naive(path, rows, args, info.device)
                elif v == "unpacked":
                    r = run_ours(path, rows, args, info, packing=False, compile=False, steps=max(2, args.steps - 1),
                                 profile=prof)
                else:
                    r = run_ours(path, rows, args, info, packing=True,
                                 compile=cuda and not args.no_compile and v in ("ours", "ours-layers", "ours-blocks", "ours-fsdp"),
                                 whole_layers={"ours-layers": True, "ours-blocks": False, "ours-fsdp": False}.get(v), steps=args.steps, profile=prof,
                                 fsdp=True if v == "ours-fsdp" else None)
                r["flops"] = flops
            except Exception as exc:  # noqa: BLE001 - record and go on with the other variants
                import traceback

                traceback.print_exc()
                r = f"failed: {exc!r}"[:300]
            res[v] = r
            print(f"  {v}: {r if isinstance(r, str) else {k: r[k] for k in ('step_s', 'tokens_per_s', 'peak_gib')}}"
                  f" ({time.perf_counter() - t0:.1f}s)", flush=True)
        results[bname] = res
        b, n = res.get("unpacked"), res.get("naive")
        for name in ("ours", "ours-layers", "ours-blocks", "ours-fsdp"):
            a = res.get(name)
            if isinstance(a, dict) and isinstance(b, dict):
                for key, (atol, rtol) in tol.items():
                    x, y = a["first"][key], b["first"][key]
                    checks.append({"check": f"{bname}: {name} (packed) vs unpacked {key} (step 1)",
                                   "value": f"{x:.6g} vs {y:.6g}", "limit": f"{atol:g} + {rtol:g} x |unpacked|",
                                   "ok": abs(x - y) <= atol + rtol * abs(y)})
            if isinstance(a, dict) and isinstance(n, dict):
                ratio = a["tokens_per_s"] / n["tokens_per_s"]
                checks.append({"check": f"{bname}: {name} / naive tokens/s", "value": f"{ratio:.2f}",
                               "limit": ">= 1.5 (target)", "ok": ratio >= 1.5})
    meta["wall_s"] = time.perf_counter() - start
    text = render(meta, results, checks)
    if out:
        (out / "trainer_bench.md").write_text(text)
        (out / "trainer_bench.json").write_text(json.dumps({"meta": meta, "results": results, "checks": checks},
                                                           indent=1, default=str))
    print("\n" + text, flush=True)
    return 0 if all(c["ok"] for c in checks if "packed" in c["check"]) else 1


if __name__ == "__main__":
    sys.exit(main())
