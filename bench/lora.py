"""LoRA vs full fine-tuning: the same GRPO step (``trainer.step.train_step``) on the same batches and the same
random weights, full fine-tuning and LoRA adapters of the given ranks on all linear layers of the decoder.

Per variant: step time (median of the steps after the first), tokens/s, peak memory (CUDA: the allocator's
peak; CPU: the child process's peak RSS, model loading included), trainable parameters, AdamW state bytes,
and what a push sends: the adapter in the served dtype (its peft ``adapter_model.safetensors`` size) or the
full weights. Each variant runs in its own child process, so peaks and compile caches do not mix;
``--rounds N`` runs the variants N times in turn and reports medians (a shared machine's load moves). Check:
a LoRA adapter starts at zero (peft's ``B = 0``), so every variant's first step sees the base model and
must report the full step's loss (bf16 tolerance on GPUs, float32's on CPU).

    python bench/lora.py                                   # GPU: Qwen2.5-1.5B's shape (random weights), bf16
    python bench/lora.py --device cpu --model tiny         # the same code on CPU, in seconds
    python bench/lora.py --device cpu --model smollm2      # SmolLM2-135M's shape on CPU (small batches)

Writes ``lora_bench.json`` / ``.md`` to ``--out`` (default ``$OUT``, else the current directory).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.trainer import batches, build_model_dir, free, model_flops, peak_gib, sync  # noqa: E402

SHAPES = ("tiny", "smollm2", "qwen2.5-1.5b")


def variant_spec(name: str):
    """``full`` or ``loraR``: the :class:`trainer.lora.LoraSpec` (alpha 32, all linear layers) or None."""
    from trainer.lora import LoraSpec

    if name == "full":
        return None
    if not name.startswith("lora") or not name[4:].isdigit():
        raise ValueError(f"variant {name!r}: use full or lora<rank>, e.g. lora16")
    return LoraSpec(int(name[4:]), 32.0)


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    """One variant in this process: ``args.steps`` steps on each batch; returns its figures."""
    from trainer import lora
    from trainer.config import TrainerSettings
    from trainer.model import build_optimizer, init_distributed, load_model, served_dtype, weight_bytes
    from trainer.step import train_step

    from transformers import AutoConfig

    info = init_distributed(args.device)
    spec = variant_spec(args.variant)
    path = Path(args.model_dir)
    settings = TrainerSettings(engine_urls=["unused"], micro_batch_tokens=args.micro_batch_tokens, lr=args.lr,
                               compile=args.compile)
    config = AutoConfig.from_pretrained(str(path))
    out: dict[str, Any] = {"variant": args.variant, "batches": {}}
    for name, rows in batches(args, int(config.vocab_size)).items():
        if name not in args.batches.split(","):
            continue
        model = optimizer = None
        free(info.device)
        torch.manual_seed(0)  # every batch starts from the base weights and a fresh adapter and optimizer
        model = load_model(path, dtype=args.dtype, device=info.device, compile=args.compile, lora=spec)
        optimizer = build_optimizer(model, settings, info.device)
        steps = []
        for _ in range(args.steps):
            sync(info.device)
            m = train_step(model, optimizer, rows, settings, info, version=0)
            sync(info.device)
            steps.append({"step_s": m["perf/step_s"], "loss": m["actor/loss"], "grad_norm": m["actor/grad_norm"]})
        timed = steps[1:] or steps
        step_s = statistics.median(s["step_s"] for s in timed)
        tokens = sum(r.num_tokens for r in rows)
        out["batches"][name] = {"first": steps[0], "step_s": step_s, "tokens": tokens, "tokens_per_s": tokens / step_s,
                                "peak_gib": peak_gib(info.device), "flops": model_flops(config, rows)}
    trained = [p for p in model.parameters() if p.requires_grad]
    state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                      if isinstance(t, torch.Tensor))
    dtype = served_dtype(model)
    out.update({
        "trainable_params": sum(p.numel() for p in trained),
        "total_params": sum(p.numel() for p in model.parameters()),
        "optimizer_state_bytes": state_bytes,
        "push_bytes": lora.adapter_bytes(model, dtype) if spec else weight_bytes(model, dtype),
        "served_dtype": str(dtype).removeprefix("torch."),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # kB -> GiB (Linux)
    })
    if spec is not None:  # the adapter as peft saves it (what a disk push writes)
        with tempfile.TemporaryDirectory() as tmp:
            saved = lora.save_adapter(dict(lora.adapter_tensors(model, dtype=dtype)), lora.config_of(model),
                                      Path(tmp) / "adapter")
            started = time.perf_counter()
            lora.save_adapter(dict(lora.adapter_tensors(model, dtype=dtype)), lora.config_of(model), Path(tmp) / "again")
            out["adapter_save_s"] = time.perf_counter() - started
            out["adapter_file_bytes"] = (saved / lora.WEIGHTS_FILE).stat().st_size
    return out


def combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's rounds as one result: the median step time per batch, the highest peaks."""
    out = {**rounds[0], "rounds": len(rounds), "peak_rss_gib": max(r["peak_rss_gib"] for r in rounds)}
    out["batches"] = {}
    for batch, first in rounds[0]["batches"].items():
        step_s = statistics.median(r["batches"][batch]["step_s"] for r in rounds)
        out["batches"][batch] = {**first, "step_s": step_s, "tokens_per_s": first["tokens"] / step_s,
                                 "step_s_rounds": [r["batches"][batch]["step_s"] for r in rounds],
                                 "peak_gib": max(r["batches"][batch]["peak_gib"] for r in rounds)}
    return out


def render(meta: dict[str, Any], results: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    lines = [f"## LoRA vs full fine-tuning: {meta['date']}, {meta['machine']}", "",
             f"model {meta['model']} ({meta['params'] / 1e6:.1f} M params, random weights), {meta['dtype']} compute, "
             f"{meta['device']}, compile {meta['compile']}, micro-batch budget {meta['micro_batch_tokens']} tokens, "
             f"{meta['steps']} steps per batch (median of all but the first; median of {meta['rounds']} interleaved "
             f"round(s)), torch {meta['torch']}, LoRA alpha 32 on "
             f"all linear layers of the decoder, command `{meta['command']}`", "",
             "| batch | variant | tokens | step s | tokens/s | x full | peak GiB (device) | peak RSS GiB | trainable params | "
             "AdamW state MB | push MB | loss (step 1) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for batch in meta["batches"]:
        full = next((r["batches"][batch]["tokens_per_s"] for r in results if r["variant"] == "full"), float("nan"))
        for r in results:
            b = r["batches"][batch]
            lines.append(f"| {batch} | {r['variant']} | {b['tokens']} | {b['step_s']:.4g} | {b['tokens_per_s']:.0f} | "
                         f"{b['tokens_per_s'] / full:.2f} | {b['peak_gib']:.2f} | {r['peak_rss_gib']:.2f} | "
                         f"{r['trainable_params']:,} | {r['optimizer_state_bytes'] / 1e6:.1f} | "
                         f"{r['push_bytes'] / 1e6:.1f} | {b['first']['loss']:.6g} |")
    lines += ["", "| check | value | limit | ok |", "|---|---|---|---|"]
    lines += [f"| {c['check']} | {c['value']} | {c['limit']} | {'PASS' if c['ok'] else 'FAIL'} |" for c in checks]
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--model", default=None, choices=SHAPES, help="shape (random weights); default: qwen2.5-1.5b on "
                                                                  "cuda, tiny on cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="compute dtype (default bf16 on cuda)")
    p.add_argument("--variants", default="full,lora16,lora64", help="comma-separated: full, lora<rank>")
    p.add_argument("--batches", default="uniform,agent")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=None, help="uniform batch row length (default 1024 cuda, 64 cpu)")
    p.add_argument("--agent-rows", type=int, default=64)
    p.add_argument("--agent-min", type=int, default=None, help="default 200 (cuda) / 20 (cpu)")
    p.add_argument("--agent-max", type=int, default=None, help="default 4000 (cuda) / 120 (cpu)")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="default 16384 (cuda) / 512 (cpu)")
    p.add_argument("--steps", type=int, default=4, help="steps per batch; the first is compared, the rest timed")
    p.add_argument("--rounds", type=int, default=1, help="run the variants this many times in turn (full, lora16, "
                                                          "..., full, ...) and report each one's median: on a "
                                                          "shared machine the load changes within a run")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--no-compile", action="store_true", help="no torch.compile (default on cuda: compiled layers)")
    p.add_argument("--out", default=os.environ.get("OUT") or ".")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # child mode: run this one variant, print JSON
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    args.model = args.model or ("qwen2.5-1.5b" if gpu else "tiny")
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.seq_len = args.seq_len or (1024 if gpu else 64)
    args.agent_min = args.agent_min or (200 if gpu else 20)
    args.agent_max = args.agent_max or (4000 if gpu else 120)
    args.micro_batch_tokens = args.micro_batch_tokens or (16384 if gpu else 512)
    args.compile = gpu and not args.no_compile
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args)), flush=True)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/lora.py: --device cuda but no GPU is visible; use --device cpu", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(args.model, Path(tmp), args.device)
        if args.dtype == "bfloat16":  # the served dtype: what the engines load and pushes send
            cfg = json.loads((model_dir / "config.json").read_text())
            (model_dir / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants.split(",")}
        child = list(argv if argv is not None else sys.argv[1:])
        for round_ in range(args.rounds):
            for variant in runs:
                cmd = [sys.executable, str(Path(__file__).resolve()), *child, "--variant", variant, "--model-dir",
                       str(model_dir)]
                proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if proc.returncode != 0 or line is None:
                    print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
                    print(f"bench/lora.py: variant {variant} failed (exit {proc.returncode})", file=sys.stderr)
                    return 1
                r = json.loads(line.removeprefix("RESULT "))
                runs[variant].append(r)
                print(f"round {round_ + 1} {variant}: " + ", ".join(
                    f"{b} {v['tokens_per_s']:.0f} tok/s ({v['step_s']:.3g} s/step)" for b, v in r["batches"].items())
                    + f", trainable {r['trainable_params']:,}, push {r['push_bytes'] / 1e6:.1f} MB", flush=True)
        results = [combine(rounds) for rounds in runs.values()]
    params = next(r["total_params"] for r in results)
    bf16 = args.dtype == "bfloat16"
    checks = []
    full = next((r for r in results if r["variant"] == "full"), None)
    for r in results:
        if full is None or r is full:
            continue
        for batch, b in r["batches"].items():
            ref = full["batches"][batch]["first"]["loss"]
            limit = (2e-3 + 2e-2 * abs(ref)) if bf16 else (1e-6 + 1e-5 * abs(ref))
            gap = abs(b["first"]["loss"] - ref)
            checks.append({"check": f"{r['variant']} step-1 loss = full's ({batch}; the adapter starts at zero)",
                           "value": f"{gap:.3g}", "limit": f"{limit:.3g}", "ok": gap <= limit})
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
            "model": args.model, "params": params, "dtype": args.dtype, "device": args.device, "compile": args.compile,
            "micro_batch_tokens": args.micro_batch_tokens, "steps": args.steps, "rounds": args.rounds, "torch": torch.__version__,
            "batches": [b for b in args.batches.split(",")], "command": "python bench/lora.py " + " ".join(child)}
    (out / "lora_bench.json").write_text(json.dumps({"meta": meta, "results": results, "checks": checks}, indent=2))
    table = render(meta, results, checks)
    (out / "lora_bench.md").write_text(table)
    print(table)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
