"""Two-GPU run: a GRPO step with FSDP2 over two devices vs one, and weight pushes to an engine on its own GPU.

One command, three parts, one table:

(a) **step**: the same GRPO step (``trainer.step.train_step``) on the same synthetic batch (fixed seed: rows of
    ``--seq-len`` tokens with loss masks, behaviour logprobs and rewards that give every group an advantage
    spread), once with FSDP2 over two ranks (``torchrun --nproc-per-node 2``: NCCL on two GPUs, gloo on CPU)
    and once on one rank. The first step's loss, gradient norm and entropy must agree (bf16 tolerance on
    GPUs, float32 on CPU); the later steps give step time and tokens/s (median).
(b) **push**: a trainer process (one rank, device 0) and a real engine process (``python -m agentrl engine``,
    on GPU 1 when there are two) serving the same random weights. The trainer perturbs its weights and
    pushes them with ``trainer.weight_sync.push_weights``: disk mode (safetensors + ``/update_weights_from_disk``)
    and broadcast mode (``/init_weights_update_group`` once, then bucketed ``/update_weights_from_distributed``
    + NCCL/gloo broadcast), several pushes each (median). Floors: a raw broadcast of the same number of
    bytes between the two processes (one flat buffer, no HTTP), and a plain device copy. After each mode the
    engine's weight version must have bumped, and its greedy output and logprobs must match a float32
    reference forward pass of the trainer's new weights (and differ from the old ones).
(c) prints the tables and writes ``two_gpu.json`` and ``two_gpu.md`` to ``--out`` (default ``$OUT`` if set).

    python bench/two_gpu.py                                  # 2 GPUs: Qwen2.5-1.5B shape, bf16, 8 x 1024 tokens
    python bench/two_gpu.py --device cpu --model tiny        # the same code path on CPU (gloo, 2 processes)

The model is built from a config with random weights (nothing is downloaded): ``qwen2.5-1.5b`` is hidden 1536,
28 layers, 12 heads, 2 KV heads, intermediate 8960, vocab 151936, tied embeddings, with SmolLM2's tokenizer
(token ids of the synthetic batch stay below its 49152). With one GPU the two-rank step, the broadcast push
and the raw broadcast are skipped and said so (NCCL cannot join two ranks on one device). NVLink multicast
stays off (``NCCL_NVLS_ENABLE=0`` and friends are set for this process and every child).

Exit status: 0 when every check passed, 1 otherwise (the tables are written either way).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

# Keep NVLink multicast off everywhere (it can take the host's shared GPUs down); children inherit these.
_KEEP: list = []  # process groups kept alive until exit
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
MODELS = ("tiny", "qwen2.5-1.5b")
PROMPT = [1, 9690, 198, 2683, 314, 253, 1345, 30, 2, 198, 1, 520, 9531, 198]  # SmolLM2 ids, any model accepts them
STEP_KEYS = ("actor/loss", "actor/grad_norm", "actor/entropy", "batch/loss_tokens", "batch/tokens",
             "actor/is_weight_mean", "perf/step_s", "perf/tokens_per_s")


# ------------------------------------------------------------------------------------------------- inputs


def model_dir(name: str, dtype: str, device: str) -> Path:
    """The HF directory of random weights (seed 0) that both the trainer and the engine load.

    ``qwen2.5-1.5b`` is built from a Qwen2Config in code (``bench.weight_sync.build_config``), initialised on
    ``device`` (seconds on a GPU instead of a minute on CPU), with SmolLM2's tokenizer files.
    """
    from transformers import AutoModelForCausalLM

    from bench.weight_sync import build_config
    from engine.models import agentrl_home, tiny_dir

    if name == "tiny":
        return tiny_dir()
    target = agentrl_home() / "bench" / f"two-gpu-{name}-{dtype}"
    if (target / "config.json").exists():
        return target
    config = build_config(name, vocab=49152)
    config.dtype = dtype
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    model.save_pretrained(tmp)
    del model
    for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tiny_dir() / file).exists():
            shutil.copy2(tiny_dir() / file, tmp / file)
    os.rename(tmp, target)
    return target


def synthetic_batch(n_rows: int, seq_len: int, *, vocab: int, group_size: int = 4, seed: int = 0) -> list:
    """``n_rows`` rows of exactly ``seq_len`` tokens in groups of ``group_size`` (a shared prompt per group).

    Loss mask 1 on the response; behaviour logprobs near ``-log(vocab)`` (a random model is near-uniform)
    so importance weights stay moderate; rewards alternate within each group so no group has zero variance.
    """
    from agentrl.trajectory import Row

    rng = np.random.default_rng(seed)
    token_vocab = min(vocab, 49152)  # stay inside the tokenizer's ids
    rows = []
    prompt = np.zeros(0, dtype=np.int64)
    for i in range(n_rows):
        g, j = divmod(i, group_size)
        if j == 0:
            prompt = rng.integers(5, token_vocab, int(rng.integers(max(1, seq_len // 8), max(2, seq_len // 4))))
        ids = np.concatenate([prompt, rng.integers(5, token_vocab, seq_len - len(prompt))]).astype(np.int32)
        mask = (np.arange(seq_len) >= len(prompt)).astype(np.int8)
        behaviour = np.where(mask == 1, -math.log(vocab) + rng.normal(0.0, 0.3, seq_len), 0.0).astype(np.float32)
        reward = float((j + g) % 2)
        rows.append(Row(
            input_ids=ids, loss_mask=mask, logprobs=behaviour,
            versions=np.where(mask == 1, 0, -1).astype(np.int32), turn_ids=np.where(mask == 1, 0, -1).astype(np.int32),
            turn_rewards=np.array([reward]), turn_returns=np.array([reward]), reward=reward, is_truncated=False,
            session_id=f"s{i}", group_id=f"g{g}", leaf_id=f"l{i}", row_id=f"r{i}",
        ))
    return rows


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, **NO_MULTICAST, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1", **extra}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------ (a) the step


def step_worker(args: argparse.Namespace) -> int:
    """Under torchrun: ``--steps`` GRPO steps on the synthetic batch; rank 0 writes the metrics as JSON."""
    from trainer.config import TrainerSettings
    from trainer.model import close_distributed, init_distributed, load_model
    from trainer.step import train_step

    info = init_distributed(args.device)
    torch.manual_seed(0)
    model = load_model(args.model_dir, dtype=args.dtype, device=info.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    settings = TrainerSettings(engine_urls=["unused"], micro_batch_tokens=args.micro_batch_tokens, lr=args.lr)
    rows = synthetic_batch(args.rows, args.seq_len, vocab=int(model.config.vocab_size))
    steps = []
    for _ in range(args.steps):
        sync(info.device)
        metrics = train_step(model, optimizer, rows, settings, info, version=0)
        steps.append({k: float(metrics[k]) for k in STEP_KEYS})
    peak = torch.cuda.max_memory_allocated(info.device) / 2**30 if info.device.type == "cuda" else float("nan")
    if info.is_main:
        Path(args.result_file).write_text(json.dumps({"world_size": info.world_size, "steps": steps,
                                                      "peak_gib_rank0": peak}))
    close_distributed(finished=True)
    return 0


def run_step(args: argparse.Namespace, path: Path, nproc: int, log_dir: Path) -> dict[str, Any]:
    """One torchrun of :func:`step_worker` with ``nproc`` ranks (GPUs 0..nproc-1 on CUDA)."""
    result = log_dir / f"step-{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(Path(__file__).resolve()), "--_worker", "step",
           "--model-dir", str(path), "--result-file", str(result), *forwarded(args)]
    env = child_env(OMP_NUM_THREADS="1" if args.device == "cpu" else os.environ.get("OMP_NUM_THREADS", "4"))
    if args.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(nproc))
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.child_timeout_s)
    (log_dir / f"step-{nproc}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun with {nproc} rank(s) exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    out = json.loads(result.read_text())
    out["wall_s"] = time.perf_counter() - start
    return out


def forwarded(args: argparse.Namespace) -> list[str]:
    return ["--device", args.device, "--dtype", args.dtype, "--rows", str(args.rows), "--seq-len", str(args.seq_len),
            "--steps", str(args.steps), "--micro-batch-tokens", str(args.micro_batch_tokens), "--lr", str(args.lr)]


def summarise_step(run: dict[str, Any]) -> dict[str, Any]:
    timed = run["steps"][1:] or run["steps"]  # the first step pays for warm-up (kernels, allocator)
    first = run["steps"][0]
    return {"world_size": run["world_size"], "loss": first["actor/loss"], "grad_norm": first["actor/grad_norm"],
            "entropy": first["actor/entropy"], "loss_tokens": first["batch/loss_tokens"], "tokens": first["batch/tokens"],
            "step_s": statistics.median(s["perf/step_s"] for s in timed),
            "tokens_per_s": statistics.median(s["perf/tokens_per_s"] for s in timed),
            "first_step_s": first["perf/step_s"], "timed_steps": len(timed), "peak_gib_rank0": run["peak_gib_rank0"]}


def compare_steps(one: dict[str, Any], two: dict[str, Any], dtype: str) -> list[dict[str, Any]]:
    """The first step's loss, gradient norm and entropy on 2 ranks vs 1 (bf16 tolerance or float32's)."""
    tol = {"float32": {"loss": (1e-6, 1e-5), "grad_norm": (0.0, 1e-5), "entropy": (0.0, 1e-5)},
           "bfloat16": {"loss": (2e-3, 2e-2), "grad_norm": (0.0, 3e-2), "entropy": (0.0, 1e-2)}}[dtype]
    checks = []
    for key, (atol, rtol) in tol.items():
        a, b = two[key], one[key]
        diff = abs(a - b)
        checks.append({"check": f"step: {key} 2 ranks vs 1", "value": f"{a:.6g} vs {b:.6g} (|diff| {diff:.2e})",
                       "limit": f"{atol:g} + {rtol:g} x |1-rank|", "ok": diff <= atol + rtol * abs(b)})
    same = two["loss_tokens"] == one["loss_tokens"]
    checks.append({"check": "step: loss tokens 2 ranks vs 1", "value": f"{two['loss_tokens']:.0f} vs {one['loss_tokens']:.0f}",
                   "limit": "equal", "ok": same})
    return checks


# ------------------------------------------------------------------------------------------ (b) the push


def floor_worker(args: argparse.Namespace) -> int:
    """Receiver of the raw-broadcast floor: joins the group as rank 1, receives, checks the bytes."""
    from agentrl.weight_group import broadcast_tensors, init_weight_group

    device = torch.device("cuda", 0) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = init_weight_group(master_address="127.0.0.1", master_port=args.port, rank=1, world_size=2,
                              backend=args.backend, group_name="raw_floor", timeout_s=300)
    buf = torch.zeros(args.nbytes, dtype=torch.uint8, device=device)
    for i in range(args.pushes + 1):
        buf.zero_()
        broadcast_tensors(group, [buf], src=0)
        print(f"floor receiver: broadcast {i + 1}/{args.pushes + 1} received", flush=True)
    ok = bool((buf == 7).all())
    print(f"floor receiver: {args.nbytes} bytes x {args.pushes + 1}, content ok: {ok}", flush=True)
    _KEEP.append(group)  # NCCL's shutdown can wait for the peer; the process exit releases the group
    os._exit(0 if ok else 1)


def raw_broadcast_floor(nbytes: int, backend: str, device: torch.device, gpu: int | None, repeats: int, procs,
                        timeout_s: float) -> float:
    """Median seconds of one broadcast of ``nbytes`` in one flat buffer from this process to a receiver process."""
    from agentrl.weight_group import broadcast_tensors, init_weight_group

    port = free_port()
    env = {**NO_MULTICAST, **({"CUDA_VISIBLE_DEVICES": str(gpu)} if gpu is not None else {})}
    child = procs.start("floor-receiver", [sys.executable, str(Path(__file__).resolve()), "--_worker", "floor",
                                           "--port", str(port), "--nbytes", str(nbytes), "--pushes", str(repeats),
                                           "--backend", backend], env=env)
    try:
        group = init_weight_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2, backend=backend,
                                  group_name="raw_floor", timeout_s=min(timeout_s, 120.0))
    except Exception as exc:  # noqa: BLE001 - torch raises several kinds; the receiver's log says why
        raise RuntimeError(f"raw broadcast group did not form: {exc!r}; receiver log:\n{child.tail()}") from exc
    buf = torch.full((nbytes,), 7, dtype=torch.uint8, device=device)
    times = []
    for i in range(repeats + 1):  # the first one connects the channels
        sync(device)
        start = time.perf_counter()
        broadcast_tensors(group, [buf], src=0)
        if i:
            times.append(time.perf_counter() - start)
    rc = child.proc.wait(timeout=min(timeout_s, 120.0))
    _KEEP.append(group)  # not destroyed: NCCL's shutdown can wait for the (gone) peer; exit releases it
    if rc != 0:
        raise RuntimeError(f"raw broadcast receiver exited {rc}:\n{child.tail()}")
    return statistics.median(times)


def copy_floor(nbytes: int, device: torch.device, repeats: int) -> float:
    src = torch.full((nbytes,), 1, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int, scale: float) -> None:
    """Add seeded noise to every weight (stands in for training so that greedy outputs change visibly)."""
    from torch.distributed.tensor import DTensor

    gen = None
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if gen is None:
            gen = torch.Generator(device=local.device).manual_seed(seed)
        noise = torch.randn(local.shape, generator=gen, device=local.device, dtype=torch.float32) * scale
        local.add_(noise.to(local.dtype))


def engine_generate(url: str, n: int) -> dict[str, Any]:
    import httpx

    resp = httpx.post(f"{url}/generate", json={
        "input_ids": PROMPT, "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
    }, timeout=300)
    resp.raise_for_status()
    body = resp.json()
    return {"ids": body["output_ids"], "logprobs": [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]],
            "version": int(body["meta_info"]["weight_version"])}


class Reference:
    """A float32 copy of the trainer's current weights, to score the engine's output (the engine runs float32)."""

    def __init__(self, config, device: torch.device):
        from transformers import AutoModelForCausalLM

        with torch.device(device):
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
        self.device = device

    @torch.no_grad()
    def load(self, trainer_model: torch.nn.Module) -> None:
        from trainer.model import iter_full_tensors, served_dtype

        pushed = iter_full_tensors(trainer_model, dtype=served_dtype(trainer_model))  # what the engine receives
        state = {name: t.to(self.device, torch.float32) for name, t in pushed}
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)

    @torch.no_grad()
    def score(self, output: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(n,) logprob of each output token and (n,) the best logprob at its position."""
        ids = torch.tensor([PROMPT + output], device=self.device)
        logits = self.model(input_ids=ids).logits[0, len(PROMPT) - 1: -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(-1, torch.tensor(output, device=self.device)[:, None])[:, 0].cpu(), logp.max(-1).values.cpu()


def check_engine(url: str, ref: Reference, version: int, before: dict[str, Any] | None, label: str, tol: float,
                 n: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The engine serves ``version`` and its greedy output scores as the reference says; returns (checks, output)."""
    import httpx

    served = int(httpx.get(f"{url}/get_model_info", timeout=30).json()["weight_version"])
    out = engine_generate(url, n)
    ref_lp, ref_best = ref.score(out["ids"])
    engine_lp = torch.tensor(out["logprobs"])
    gap = float((ref_lp - engine_lp).abs().max())
    greedy_slack = float((ref_best - ref_lp).max())
    checks = [
        {"check": f"{label}: engine weight version", "value": f"{served} (reply {out['version']})",
         "limit": f"= {version}", "ok": served == version == out["version"]},
        {"check": f"{label}: |engine - reference| logprob, {n} greedy tokens", "value": f"{gap:.2e}",
         "limit": f"< {tol:g}", "ok": gap < tol},
        {"check": f"{label}: engine's greedy tokens are the reference's argmax", "value": f"max shortfall {greedy_slack:.2e}",
         "limit": f"< {tol:g} (ties allowed)", "ok": greedy_slack < tol},
    ]
    if before is not None:
        same_ids = out["ids"] == before["ids"]
        moved = float((engine_lp - torch.tensor(before["logprobs"])).abs().max())
        checks.append({"check": f"{label}: output differs from the previous weights'",
                       "value": f"tokens {'same' if same_ids else 'changed'}, max logprob move {moved:.2e}",
                       "limit": "tokens changed or logprobs moved > 100 x tol", "ok": (not same_ids) or moved > 100 * tol})
    return checks, out


def run_push(args: argparse.Namespace, path: Path, log_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Part (b): returns (table rows, checks)."""
    import httpx

    from agentrl.procs import Processes
    from trainer.model import init_distributed, load_model, served_dtype, weight_bytes
    from trainer.weight_sync import BroadcastSync, DirectControl, DiskSync, TensorSync, push_weights

    info = init_distributed(args.device)
    cuda = info.device.type == "cuda"
    n_gpus = torch.cuda.device_count() if cuda else 0
    engine_gpu = (1 if n_gpus > 1 else 0) if cuda else None
    backend = "nccl" if cuda else "gloo"
    can_broadcast = not cuda or n_gpus > 1
    tol = args.logprob_tol if args.logprob_tol else (1e-3 if cuda else 1e-4)
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []

    with Processes(log_dir) as procs:
        port = free_port()
        engine_env = {**NO_MULTICAST, **({"CUDA_VISIBLE_DEVICES": str(engine_gpu)} if cuda else {}),
                      "OMP_NUM_THREADS": "1" if not cuda else os.environ.get("OMP_NUM_THREADS", "4")}
        engine = procs.start("engine", [sys.executable, "-m", "agentrl", "engine", "--model", str(path), "--port",
                                        str(port), "--device", args.device], env=engine_env)
        url = f"http://127.0.0.1:{port}"
        model = load_model(path, dtype=args.dtype, device=info.device)  # loads while the engine starts
        nbytes = weight_bytes(model, served_dtype(model))  # pushes cast the float32 masters to this
        ref = Reference(model.config, info.device)
        procs.wait_healthy(engine, url + "/health", timeout_s=args.child_timeout_s)
        where = f"engine on GPU {engine_gpu}, trainer on GPU 0" if cuda else "engine and trainer on CPU"
        print(f"push: {nbytes / 1e9:.3f} GB of {args.dtype} weights, {where}", flush=True)

        # floors
        rows.append({"mode": f"floor: device copy ({info.device.type})", "seconds": copy_floor(nbytes, info.device, args.pushes),
                     "bytes": nbytes})
        if can_broadcast:
            try:
                raw = raw_broadcast_floor(nbytes, backend, info.device, engine_gpu, args.pushes, procs, args.child_timeout_s)
                rows.append({"mode": f"floor: raw {backend} broadcast, one flat buffer", "seconds": raw, "bytes": nbytes})
            except Exception as exc:  # noqa: BLE001 - report it and go on with the pushes
                rows.append({"mode": f"floor: raw {backend} broadcast", "seconds": float("nan"), "bytes": nbytes,
                             "note": f"failed: {exc!r}"[:300]})
                checks.append({"check": "raw broadcast floor ran", "value": repr(exc)[:200], "limit": "no error", "ok": False})
        else:
            rows.append({"mode": f"floor: raw {backend} broadcast", "seconds": float("nan"), "bytes": nbytes,
                         "note": "not run: one GPU (NCCL cannot join two ranks on one device)"})

        # version 0: engine and trainer serve the same weights
        ref.load(model)
        found, before = check_engine(url, ref, 0, None, "v0 (no push)", tol, args.gen_tokens)
        checks += found
        client = httpx.Client(timeout=args.child_timeout_s)
        control = DirectControl([url], client=client)
        version = 0

        paused: list[float] = []

        def pushes(transport, count: int) -> list[float]:
            nonlocal version
            seconds = []
            paused.clear()
            for _ in range(count):
                version += 1
                result = push_weights(model, version, info=info, transport=transport, control=control, retries=1)
                seconds.append(result.seconds)
                paused.append(result.paused_s)
            return seconds

        sync_root = Path(args.sync_dir or ("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()))
        disk = DiskSync(sync_dir=sync_root / f"agentrl-two-gpu-{os.getpid()}", source_dir=path, client=client)
        perturb(model, seed=1, scale=args.noise)
        disk_s = pushes(disk, args.pushes)
        rows.append({"mode": f"disk ({sync_root}), total, median of {len(disk_s)}", "seconds": statistics.median(disk_s),
                     "bytes": nbytes, "all": disk_s})
        rows.append({"mode": f"disk ({sync_root}), generation paused (staged before the pause), median of {len(paused)}",
                     "seconds": statistics.median(paused), "bytes": nbytes, "all": list(paused)})
        ref.load(model)
        found, before = check_engine(url, ref, version, before, f"after disk pushes (v{version})", tol, args.gen_tokens)
        checks += found
        shutil.rmtree(disk.sync_dir, ignore_errors=True)

        # tensor handles (CUDA IPC on a shared GPU; shared-memory files on CPU): only when the engine shares
        # the trainer's device
        if not cuda or engine_gpu == 0:
            tensor = TensorSync(client=client)
            perturb(model, seed=3, scale=args.noise)
            tensor_s = pushes(tensor, args.pushes)
            rows.append({"mode": f"tensor handles (/update_weights_from_tensor), total, median of {len(tensor_s)}",
                         "seconds": statistics.median(tensor_s), "bytes": nbytes, "all": tensor_s})
            rows.append({"mode": "tensor handles, generation paused, median", "seconds": statistics.median(paused),
                         "bytes": nbytes, "all": list(paused)})
            ref.load(model)
            found, before = check_engine(url, ref, version, before, f"after tensor pushes (v{version})", tol,
                                         args.gen_tokens)
            checks += found

        if can_broadcast:
            bcast = BroadcastSync(client=client, bucket_bytes=int(args.bucket_mb * 2**20), backend=backend,
                                  timeout_s=args.child_timeout_s)
            perturb(model, seed=2, scale=args.noise)
            first = pushes(bcast, 1)
            rows.append({"mode": f"broadcast ({backend}): first push, incl. group init", "seconds": first[0],
                         "bytes": nbytes})
            bcast_s = pushes(bcast, args.pushes)
            rows.append({"mode": f"broadcast ({backend}, {args.bucket_mb:g} MB buckets), median of {len(bcast_s)}",
                         "seconds": statistics.median(bcast_s), "bytes": nbytes, "all": bcast_s})
            ref.load(model)
            found, _ = check_engine(url, ref, version, before, f"after broadcast pushes (v{version})", tol,
                                    args.gen_tokens)
            checks += found
            _KEEP.append(bcast.group)  # see raw_broadcast_floor: not destroyed while the engine may be gone
        else:
            rows.append({"mode": f"broadcast ({backend})", "seconds": float("nan"), "bytes": nbytes,
                         "note": "not run: one GPU (NCCL cannot join two ranks on one device)"})
        if engine.proc.poll() is not None:
            raise RuntimeError(f"the engine exited with {engine.proc.returncode}:\n{engine.tail()}")
    return rows, checks


# ------------------------------------------------------------------------------------------- (c) output


def fmt(x: float, digits: int = 4) -> str:
    return "n/a" if x != x else f"{x:.{digits}g}"


def render(meta: dict[str, Any], steps: dict[str, Any], push_rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    lines = [f"## Two-GPU run: {meta['date']}, {meta['machine']}", "",
             f"model {meta['model']} ({meta['params'] / 1e9:.3f} B params; trainer: float32 master weights, "
             f"{meta['dtype']} compute; pushes and engine: the config's dtype), batch {meta['rows']} rows x "
             f"{meta['seq_len']} tokens, micro-batch budget {meta['micro_batch_tokens']} tokens, torch {meta['torch']}", ""]
    if steps:
        lines += ["| GRPO step | loss (step 1) | grad norm (step 1) | entropy | step s (median) | tokens/s | peak GiB (rank 0) |",
                  "|---|---|---|---|---|---|---|"]
        for key in ("1 rank", "2 ranks"):
            s = steps.get(key)
            if isinstance(s, dict):
                lines.append(f"| FSDP2, {key} | {s['loss']:.6g} | {s['grad_norm']:.6g} | {s['entropy']:.6g} | "
                             f"{fmt(s['step_s'])} (of {s['timed_steps']}) | {s['tokens_per_s']:.0f} | {fmt(s['peak_gib_rank0'], 3)} |")
            elif s:
                lines.append(f"| FSDP2, {key} | {s} | | | | | |")
        lines.append("")
    if push_rows:
        floor = next((r["seconds"] for r in push_rows if "raw" in r["mode"] and r["seconds"] == r["seconds"]),
                     push_rows[0]["seconds"])
        lines += ["| weight push | GB | s/push | GB/s | x floor* |", "|---|---|---|---|---|"]
        for r in push_rows:
            gb = r["bytes"] / 1e9
            s = r["seconds"]
            rate = gb / s if s == s and s > 0 else float("nan")
            note = f" ({r['note']})" if "note" in r else ""
            lines.append(f"| {r['mode']}{note} | {gb:.3f} | {fmt(s)} | {fmt(rate, 3)} | {fmt(s / floor, 3)} |")
        lines += ["", "\\* floor: the raw broadcast where it ran, else the device copy.", ""]
    if checks:
        lines += ["| check | value | limit | ok |", "|---|---|---|---|"]
        lines += [f"| {c['check']} | {c['value']} | {c['limit']} | {'PASS' if c['ok'] else 'FAIL'} |" for c in checks]
    for note in meta.get("not_run", []):
        lines.append(f"\nNot run: {note}")
    return "\n".join(lines) + "\n"


def write_outputs(out: Path | None, meta, steps, push_rows, checks) -> str:
    text = render(meta, steps, push_rows, checks)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "two_gpu.md").write_text(text)
        (out / "two_gpu.json").write_text(json.dumps({"meta": meta, "step": steps, "push": push_rows, "checks": checks},
                                                     indent=1, default=str))
    return text


# ------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cuda: NCCL over GPUs; cpu: gloo")
    p.add_argument("--model", default=None, choices=MODELS, help="model shape (default: qwen2.5-1.5b on cuda, tiny on cpu)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="trainer parameter dtype (default bfloat16 on cuda, float32 on cpu); the engine serves float32")
    p.add_argument("--rows", type=int, default=8, help="rows in the synthetic batch (groups of 4)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 1024 on cuda, 64 on cpu)")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="micro-batch token budget (default: half the batch, so 1 rank runs 2 micro-batches)")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps per run: the first is compared, the rest timed")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate of the steps")
    p.add_argument("--pushes", type=int, default=3, help="timed pushes per mode (median reported)")
    p.add_argument("--bucket-mb", type=float, default=256.0, help="broadcast bucket size")
    p.add_argument("--noise", type=float, default=0.02, help="std of the weight perturbation before each mode's pushes")
    p.add_argument("--gen-tokens", type=int, default=16, help="greedy tokens generated for the logprob check")
    p.add_argument("--logprob-tol", type=float, default=0.0, help="engine-vs-reference logprob limit (default 1e-3 cuda, 1e-4 cpu)")
    p.add_argument("--parts", default="step,push", help="comma-separated: step, push")
    p.add_argument("--sync-dir", default=None, help="disk-mode directory (default /dev/shm, else the temp dir)")
    p.add_argument("--out", default=os.environ.get("OUT") or None, help="write two_gpu.json/.md here (default $OUT)")
    p.add_argument("--child-timeout-s", type=float, default=480.0, help="limit for each child process")
    # internal: the torchrun step worker and the raw-broadcast receiver
    p.add_argument("--_worker", choices=["step", "floor"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--nbytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.model = args.model or ("qwen2.5-1.5b" if cuda else "tiny")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.seq_len = args.seq_len or (1024 if cuda else 64)
    args.micro_batch_tokens = args.micro_batch_tokens or max(args.seq_len, args.rows * args.seq_len // 2)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    bad = set(args.parts) - {"step", "push"}
    if bad:
        p.error(f"--parts: unknown {sorted(bad)}; use step, push")
    if args.rows < 2 or args.steps < 1 or args.pushes < 1:
        p.error("--rows must be >= 2, --steps and --pushes >= 1")
    if cuda and not torch.cuda.is_available() and not args._worker:
        p.error("--device cuda but no GPU is visible; use --device cpu")
    return args


def main(argv: list[str] | None = None) -> int:
    os.environ.update(NO_MULTICAST)
    args = parse_args(argv)
    if args._worker == "step":
        return step_worker(args)
    if args._worker == "floor":
        return floor_worker(args)

    out = Path(args.out) if args.out else None
    log_dir = Path(tempfile.mkdtemp(prefix="agentrl-two-gpu-"))
    cuda = args.device == "cuda"
    n_gpus = torch.cuda.device_count() if cuda else 0
    start = time.perf_counter()
    path = model_dir(args.model, args.dtype, "cuda:0" if cuda else "cpu")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    params = sum(v for v in _param_count(config))
    machine = (f"{n_gpus} x {torch.cuda.get_device_name(0)}" if cuda else f"CPU x{os.cpu_count()} (gloo)")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine,
            "model": args.model, "params": params, "dtype": args.dtype, "rows": args.rows, "seq_len": args.seq_len,
            "micro_batch_tokens": args.micro_batch_tokens, "torch": torch.__version__, "gpus": n_gpus,
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "not_run": []}
    print(f"model dir {path} ready after {time.perf_counter() - start:.1f}s; logs in {log_dir}", flush=True)
    steps: dict[str, Any] = {}
    push_rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []

    if "step" in args.parts:
        if cuda and n_gpus < 2:
            steps["2 ranks"] = "not run: one GPU visible"
            meta["not_run"].append("the 2-rank FSDP2 step and its comparison (one GPU visible)")
        else:
            steps["2 ranks"] = summarise_step(run_step(args, path, 2, log_dir))
        steps["1 rank"] = summarise_step(run_step(args, path, 1, log_dir))
        if isinstance(steps["2 ranks"], dict):
            checks += compare_steps(steps["1 rank"], steps["2 ranks"], args.dtype)
        print(write_outputs(out, meta, steps, push_rows, checks), flush=True)
    if "push" in args.parts:
        if cuda and n_gpus < 2:
            meta["not_run"].append("the broadcast push and the raw NCCL broadcast floor (one GPU: NCCL cannot join two "
                                   "ranks on one device); the engine shares GPU 0 with the trainer")
        try:
            push_rows, push_checks = run_push(args, path, log_dir)
            checks += push_checks
        except Exception as exc:  # noqa: BLE001 - keep the step figures; the error becomes a failed check
            import traceback

            traceback.print_exc()
            checks.append({"check": "push part ran to the end", "value": repr(exc)[:300], "limit": "no error",
                           "ok": False})
    meta["wall_s"] = time.perf_counter() - start
    text = write_outputs(out, meta, steps, push_rows, checks)
    print("\n" + text, flush=True)
    failed = [c["check"] for c in checks if not c["ok"]]
    if failed:
        print(f"FAILED checks: {failed}", flush=True)
    from trainer.model import close_distributed

    close_distributed(finished=True)
    return 1 if failed else 0


def _param_count(config) -> list[int]:
    """Parameters of a Llama/Qwen2-style config (tied embeddings counted once), without building the model."""
    h, i, v, n = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    bias = head_dim * (heads + 2 * kv) if config.model_type == "qwen2" else 0
    attn = h * head_dim * heads * 2 + h * head_dim * kv * 2 + bias
    layer = attn + 3 * h * i + 2 * h
    return [v * h * (1 if config.tie_word_embeddings else 2), n * layer, h]


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: a kept NCCL group's destructor can wait for a peer that is gone
