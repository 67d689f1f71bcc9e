"""Adapter push vs full push, trainer -> a running embedded engine: seconds per push, by disk and by tensors.

Starts a real engine process (``python -m agentrl engine``, on the trainer's device: tensor handles need the
same machine and GPU) on random weights of the shape, loads the same weights into the trainer, and times
(median of ``--repeats``, each a whole push: staging, pause, update, version, resume; ``DirectControl``):

* ``full disk`` / ``full tensor``: ``trainer.weight_sync.push_weights`` with ``DiskSync`` / ``TensorSync``;
* ``lora<R> disk`` / ``lora<R> tensor``: ``trainer.lora_push.push_adapter`` (unload + ``/load_lora_adapter`` or
  ``/load_lora_adapter_from_tensors``, then ``/update_weight_version``) for each ``--ranks`` on all linear
  layers.

After the LoRA pushes the engine's version must be the last one pushed and a request naming the adapter must
get the trainer's logprobs (< 1e-3, the engine computes in float32).

    python bench/lora_push.py                                          # tiny and smollm2 shapes on CPU
    python bench/lora_push.py --model-shape qwen2.5-1.5b --device cuda  # one GPU, engine beside the trainer

Writes ``lora_push.json`` / ``.md`` to ``--out`` (default ``$OUT``, else the current directory).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import torch  # noqa: E402

from bench.weight_sync import SHAPES, free_port, model_dir, timed  # noqa: E402

PROMPT = [1, 9690, 198, 2683, 314, 253, 1345, 30, 2, 198, 1, 520, 9531, 198]


def check_served(model, url: str, name: str, version: int) -> float:
    """The engine serves ``name`` at ``version`` with the trainer's logprobs; returns the largest gap."""
    from trainer.model import token_logprobs

    body = {"input_ids": PROMPT, "return_logprob": True, "lora_path": name,
            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 1, "ignore_eos": True}}
    out = httpx.post(f"{url}/generate", json=body, timeout=600).json()
    assert int(out["meta_info"]["weight_version"]) == version, out["meta_info"]
    served = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    ids = torch.tensor([PROMPT + out["output_ids"]], device=next(model.parameters()).device)
    model.eval()
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    return float((logp[0, len(PROMPT) - 1:].float().cpu() - served).abs().max())


def bench_shape(shape: str, args, procs) -> list[dict]:
    from trainer import lora
    from trainer.lora_push import AdapterSync, push_adapter
    from trainer.model import init_distributed, load_model, served_dtype, weight_bytes
    from trainer.weight_sync import DirectControl, DiskSync, TensorSync, push_weights

    info = init_distributed(args.device)
    dtype = args.dtype or ("bfloat16" if info.device.type == "cuda" else "float32")
    path = model_dir(shape, dtype)
    port = free_port()
    child = procs.start(f"engine-{shape}", [sys.executable, "-m", "agentrl", "engine", "--model", str(path),
                                             "--port", str(port), "--device", info.device.type])
    url = f"http://127.0.0.1:{port}"
    procs.wait_healthy(child, url + "/health", timeout_s=600)
    client = httpx.Client(timeout=600)
    control = DirectControl([url], client=client)
    sync_root = Path(args.sync_dir or ("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()))
    sync_dir = sync_root / f"agentrl-bench-lora-{os.getpid()}"
    rows: list[dict] = []
    version = [0]

    model = load_model(path, dtype=dtype, device=info.device)
    nbytes = weight_bytes(model, served_dtype(model))
    for mode in args.modes:
        transport = (DiskSync(sync_dir=sync_dir / "full", source_dir=path, client=client) if mode == "disk"
                     else TensorSync(client=client))

        def full_push() -> None:
            version[0] += 1
            push_weights(model, version[0], info=info, transport=transport, control=control, retries=1)

        rows.append({"shape": shape, "variant": f"full {mode}", "seconds": timed(full_push, args.repeats),
                     "bytes": nbytes})
    del model
    for rank in args.ranks:
        model = load_model(path, dtype=dtype, device=info.device, lora=lora.LoraSpec(rank, 32.0))
        torch.manual_seed(rank)
        with torch.no_grad():  # a trained adapter stands in as noise (B = 0 would hide a wrong push)
            for name, p in model.named_parameters():
                if lora.is_adapter_name(name):
                    p.copy_(torch.randn_like(p) * 0.01)
        abytes = lora.adapter_bytes(model, served_dtype(model))
        for mode in args.modes:
            transport = AdapterSync(f"bench-r{rank}", mode, sync_dir / "lora", client)

            def adapter_push() -> None:
                version[0] += 1
                push_adapter(model, version[0], info=info, transport=transport, control=control, retries=1)

            seconds = timed(adapter_push, args.repeats)
            gap = check_served(model, url, f"bench-r{rank}", version[0])
            rows.append({"shape": shape, "variant": f"lora{rank} {mode}", "seconds": seconds, "bytes": abytes,
                         "logprob_gap": gap})
            if gap > 1e-3 and dtype == "float32":
                raise AssertionError(f"lora{rank} {mode}: the engine's logprobs differ from the trainer's by {gap:.2e}")
        del model
    shutil.rmtree(sync_dir, ignore_errors=True)
    procs.stop_all()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", action="append", choices=SHAPES, help="repeatable; default tiny, smollm2")
    parser.add_argument("--modes", default="disk,tensor", help="comma-separated: disk, tensor")
    parser.add_argument("--ranks", default="16,64", help="comma-separated LoRA ranks (all linear layers, alpha 32)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="the model directory's (served) dtype: default float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--repeats", type=int, default=3, help="pushes per variant (median reported)")
    parser.add_argument("--sync-dir", default=None, help="disk mode directory (default /dev/shm, else the temp dir)")
    parser.add_argument("--out", default=os.environ.get("OUT") or ".")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.ranks = [int(r) for r in args.ranks.split(",") if r.strip()]

    from agentrl.procs import Processes
    from trainer.model import close_distributed

    rows: list[dict] = []
    with Processes(Path(tempfile.mkdtemp(prefix="agentrl-bench-lora-push-"))) as procs:
        for shape in args.model_shape or ["tiny", "smollm2"]:
            rows += bench_shape(shape, args, procs)
    close_distributed(finished=True)

    device = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU x{os.cpu_count()}"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## Adapter push vs full push: {date}, {device}, torch {torch.__version__}", "",
             f"median of {args.repeats} pushes each (staging + pause + update + version + resume, DirectControl), "
             f"command `python bench/lora_push.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             "| shape | variant | MB pushed | s/push | x full (same mode) | engine-trainer logprob gap |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        full = next((x["seconds"] for x in rows if x["shape"] == r["shape"]
                     and x["variant"] == "full " + r["variant"].split()[-1]), float("nan"))
        gap = f"{r['logprob_gap']:.1e}" if "logprob_gap" in r else ""
        lines.append(f"| {r['shape']} | {r['variant']} | {r['bytes'] / 1e6:.1f} | {r['seconds']:.4f} | "
                     f"{r['seconds'] / full:.3f} | {gap} |")
    table = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora_push.json").write_text(json.dumps({"date": date, "device": device, "rows": rows}, indent=2))
    (out / "lora_push.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
