"""Weight push from the trainer to a running engine: seconds per push and GB/s, disk vs broadcast.

For each model shape, this starts a real engine process (``python -m agentrl engine``) on a directory of
random weights of that shape, loads the same weights into the trainer (FSDP2, one process), and times
``trainer.weight_sync.push_weights`` (pause -> update -> resume on the engine) in both modes:

* disk: save safetensors + ``POST /update_weights_from_disk`` (the engine reads and checks them)
* broadcast: bucketed ``POST /update_weights_from_distributed`` + a collective broadcast (gloo on CPU,
  NCCL on CUDA; the process group is formed once, and that first push is reported separately)

The floor is a plain tensor copy of the same number of bytes on the trainer's device (and, on CUDA, a
device-to-host copy into pinned memory, the least any disk push must do).

    python bench/weight_sync.py                                   # tiny and smollm2 shapes on CPU
    python bench/weight_sync.py --model-shape qwen2.5-1.5b --device cuda   # on the GPU machine

Shapes are built in code from a config (random weights; nothing is downloaded). On one GPU the engine shares
the trainer's GPU, where NCCL cannot connect two ranks on one device, so broadcast is skipped there; with two
or more GPUs the engine runs on the second one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import torch  # noqa: E402

SHAPES = ("tiny", "smollm2", "qwen2.5-1.5b")


def build_config(shape: str, vocab: int):
    from transformers import LlamaConfig, Qwen2Config

    from engine.models import tiny_config

    if shape == "tiny":
        return tiny_config(vocab)
    if shape == "smollm2":  # SmolLM2-135M's shape
        return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                           tie_word_embeddings=True, rope_theta=100000.0)
    if shape == "qwen2.5-1.5b":
        return Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                           num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                           tie_word_embeddings=True, rope_theta=1000000.0)
    raise ValueError(f"unknown model shape {shape!r}; valid: {', '.join(SHAPES)}")


def model_dir(shape: str, dtype: str) -> Path:
    """A HF directory of random weights of ``shape`` (cached under $AGENTRL_HOME/bench)."""
    from transformers import AutoModelForCausalLM

    from engine.models import agentrl_home, tiny_dir

    target = agentrl_home() / "bench" / f"{shape}-{dtype}"
    if (target / "config.json").exists():
        return target
    tok_dir = tiny_dir()
    config = build_config(shape, vocab=49152)
    config.dtype = dtype
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent if target.parent.exists() else None))
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tok_dir / name).exists():
            shutil.copy2(tok_dir / name, tmp / name)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(target, ignore_errors=True)
    shutil.move(str(tmp), target)
    return target


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_floor(nbytes: int, device: torch.device, repeats: int) -> dict[str, float]:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def same():
        dst.copy_(src)
        sync()

    same()  # first touch of the pages is not part of a copy
    floors = {"copy": timed(same, repeats)}
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

        def d2h():
            host.copy_(src, non_blocking=True)
            sync()

        d2h()
        floors["d2h copy"] = timed(d2h, repeats)
    return floors


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_shape(shape: str, args, procs) -> list[dict]:
    from trainer.model import init_distributed, load_model, served_dtype, weight_bytes
    from trainer.weight_sync import BroadcastSync, DirectControl, DiskSync, push_weights

    info = init_distributed(args.device)
    dtype = args.dtype or ("bfloat16" if info.device.type == "cuda" else "float32")
    path = model_dir(shape, dtype)
    port = free_port()
    engine_env = {}
    engine_gpu = None
    if info.device.type == "cuda":
        engine_gpu = 1 if torch.cuda.device_count() > 1 else 0
        engine_env["CUDA_VISIBLE_DEVICES"] = str(engine_gpu)
    child = procs.start(f"engine-{shape}", [sys.executable, "-m", "agentrl", "engine", "--model", str(path),
                                             "--port", str(port), "--device", info.device.type], env=engine_env)
    url = f"http://127.0.0.1:{port}"
    procs.wait_healthy(child, url + "/health", timeout_s=600)

    model = load_model(path, dtype=dtype, device=info.device)
    nbytes = weight_bytes(model, served_dtype(model))
    client = httpx.Client(timeout=600)
    control = DirectControl([url], client=client)
    rows = []
    version = [0]

    def push(transport):
        version[0] += 1
        push_weights(model, version[0], info=info, transport=transport, control=control, retries=1)

    floors = copy_floor(nbytes, info.device, args.repeats)
    for name, seconds in floors.items():
        rows.append({"shape": shape, "mode": f"floor: {name}", "seconds": seconds, "bytes": nbytes})
    if "disk" in args.modes:
        sync_dir = Path(args.sync_dir or (tempfile.gettempdir() if not Path("/dev/shm").is_dir() else "/dev/shm")) / f"agentrl-bench-{os.getpid()}"
        disk = DiskSync(sync_dir=sync_dir, source_dir=path, client=client)
        rows.append({"shape": shape, "mode": f"disk ({sync_dir.parent})", "seconds": timed(lambda: push(disk), args.repeats),
                     "bytes": nbytes})
        shutil.rmtree(sync_dir, ignore_errors=True)
    if "broadcast" in args.modes:
        backend = "nccl" if info.device.type == "cuda" else "gloo"
        if backend == "nccl" and engine_gpu == 0:
            rows.append({"shape": shape, "mode": "broadcast (nccl)", "seconds": float("nan"), "bytes": nbytes,
                         "note": "skipped: one GPU; NCCL needs the engine on another GPU"})
        else:
            bcast = BroadcastSync(client=client, bucket_bytes=int(args.bucket_mb * 2**20), backend=backend)
            first = timed(lambda: push(bcast), 1)
            rows.append({"shape": shape, "mode": f"broadcast ({backend}) first, incl. group init", "seconds": first,
                         "bytes": nbytes})
            rows.append({"shape": shape, "mode": f"broadcast ({backend}, {args.bucket_mb:g} MB buckets)",
                         "seconds": timed(lambda: push(bcast), args.repeats), "bytes": nbytes})
    check = httpx.get(f"{url}/get_model_info", timeout=30).json()["weight_version"]
    assert int(check) == version[0], f"engine at version {check}, expected {version[0]}"
    procs.stop_all()
    del model
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", action="append", choices=SHAPES,
                        help="model shape(s) to push (repeatable; default: tiny and smollm2)")
    parser.add_argument("--modes", default="disk,broadcast", help="comma-separated: disk, broadcast")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="weights dtype (default float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--repeats", type=int, default=3, help="pushes per mode (median reported)")
    parser.add_argument("--bucket-mb", type=float, default=256.0, help="broadcast bucket size")
    parser.add_argument("--sync-dir", default=None, help="disk mode directory (default /dev/shm, else the temp dir)")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    shapes = args.model_shape or ["tiny", "smollm2"]

    from agentrl.procs import Processes
    from trainer.model import close_distributed

    rows: list[dict] = []
    with Processes(Path(tempfile.mkdtemp(prefix="agentrl-bench-ws-"))) as procs:
        for shape in shapes:
            rows += bench_shape(shape, args, procs)
    close_distributed(finished=True)

    device = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU x{os.cpu_count()}"
    print(f"\nweight push, trainer -> engine ({device}, torch {torch.__version__}, median of {args.repeats})")
    header = f"{'shape':<14}{'GB':>7}  {'mode':<48}{'s/push':>9}{'GB/s':>8}{'x floor':>9}"
    print(header)
    print("-" * len(header))
    floor_by_shape = {r["shape"]: r["seconds"] for r in rows if r["mode"] == "floor: copy"}
    for r in rows:
        gb = r["bytes"] / 1e9
        s = r["seconds"]
        rate = gb / s if s == s and s > 0 else float("nan")
        ratio = s / floor_by_shape[r["shape"]] if s == s else float("nan")
        line = f"{r['shape']:<14}{gb:>7.3f}  {r['mode']:<48}{s:>9.4f}{rate:>8.2f}{ratio:>9.1f}"
        print(line + (f"  {r['note']}" if "note" in r else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
