"""The trained model: process group, FSDP2 sharding, token logprobs, and full weights for pushes/checkpoints.

Under ``torchrun`` every rank joins the default process group (NCCL on GPUs with gloo for CPU-side
objects, gloo on CPUs); a plain ``python -m trainer`` / ``agentrl train`` joins a one-process group, so the
sharded code path is the only one. Each decoder layer is one FSDP2 unit (``fully_shard``) and the root
(embeddings, final norm, tied LM head) another; with one rank the root is the only unit (nothing to shard,
fewer hooks per step).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from trainer.core_algos import token_entropy


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda but no CUDA GPU is visible; use --device cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(device_name: str = "auto") -> DistInfo:
    """Join the default process group (torchrun's env, or a one-process group when run directly)."""
    device = resolve_device(device_name)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistInfo(dist.get_rank(), dist.get_world_size(), device, backend)


def load_model(path: str | Path, *, dtype: str = "float32", device: torch.device | None = None,
               compile: bool = False) -> torch.nn.Module:
    """Load a Hugging Face causal LM and shard it with FSDP2 over the default process group.

    Parameters (and optimizer state) stay float32; ``dtype="bfloat16"`` computes in bfloat16 through FSDP2's
    mixed-precision policy (gradients reduced in float32), which is the usual setting on GPUs. ``compile``:
    :func:`compile_body`. The model gets the packed logprob method of :mod:`trainer.packing`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.packing import install, register_attention

    served = getattr(AutoConfig.from_pretrained(str(path)), "dtype", None)  # what the engines load
    # packed attention: per-row causal SDPA over packed rows, plain causal SDPA over right-padded ones
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation=register_attention())
    if served is not None:
        model.config.dtype = served  # saved directories keep declaring it; pushes cast to it
    if device is not None and device.type == "cuda":
        model = model.to(device)
    model.config.use_cache = False
    compute = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = shard(model, compute_dtype=compute)
    if compile:
        compile_body(model)
    return install(model)


def compile_body(model: torch.nn.Module, *, whole_layers: bool = False) -> None:
    """``torch.compile`` each decoder layer's attention block, MLP and norms, with dynamic shapes.

    The FSDP2 units (whole layers) keep their hooks eager; only their children are compiled, so a new
    micro-batch shape does not recompile (dynamic=True) and FSDP's all-gathers stay outside the graphs.
    ``whole_layers`` (one rank only, where the layers are no FSDP units): each decoder layer is compiled as
    one graph (residual adds, rotary embedding and attention glue fused too; ``bench/trainer.py`` variant
    ``ours-layers``).
    """
    if whole_layers:
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("whole-layer compile is for one rank: the layers of several ranks are FSDP units")
        for layer in model.model.layers:
            layer.compile(dynamic=True)
        model.model.norm.compile(dynamic=True)
        return
    for layer in model.model.layers:
        for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            part = getattr(layer, name, None)
            if part is not None:
                part.compile(dynamic=True)
    model.model.norm.compile(dynamic=True)


def shard(model: torch.nn.Module, *, compute_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """FSDP2: one unit per decoder layer, plus the root (embeddings, norm, tied LM head); one rank: the root only."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: expected decoder layers at model.model.layers")
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    # One rank has nothing to free by sharding per layer or resharding after forward: one unit (the root)
    # gathers and casts all weights once per step and reduces all gradients once, instead of 4 hooks and
    # their copies per layer (the step on one GPU is bound by launching kernels, see docs/trainer.md).
    several = dist.get_world_size() > 1 if dist.is_initialized() else True
    if several:
        for layer in layers:
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy, reshard_after_forward=several)
    return model


def token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, with_entropy: bool = False,
    temperature: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) tokens -> (B, T-1) log p(token t+1 | tokens <= t) in float32, and optionally the entropy.

    ``temperature``: (B, T-1) the temperature token t+1 was sampled at; the logprobs are then those of
    ``softmax(logits / T)``, the distribution the engine sampled from and reported behaviour logprobs of
    (as verl and AReaL do). None: temperature 1."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    if temperature is not None:
        logits = logits / temperature.unsqueeze(-1)
    targets = input_ids[:, 1:]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = token_entropy(logits.detach()) if with_entropy else None
    return logp, entropy


def build_optimizer(model: torch.nn.Module, settings, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the (sharded, float32) parameters; the fused kernel on GPUs (one launch per step)."""
    return torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay,
                             fused=device.type == "cuda")


def tied_duplicates(model: torch.nn.Module) -> set[str]:
    """State-dict names that are tied to another (e.g. ``lm_head.weight``): saved and sent once."""
    if getattr(model.config, "tie_word_embeddings", False):
        return {"lm_head.weight"}
    return set()


def iter_full_tensors(model: torch.nn.Module, *, to_cpu: bool = False,
                      dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every weight, gathered from the shards, optionally cast to ``dtype``.

    A collective: every rank must iterate to the end.
    """
    skip = tied_duplicates(model)
    for name, value in model.state_dict().items():
        if name in skip:
            continue
        full = (value.full_tensor() if isinstance(value, DTensor) else value).detach()
        if dtype is not None and full.is_floating_point():
            full = full.to(dtype)
        yield name, (full.cpu() if to_cpu else full)


def served_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model's own config declares (what its engines load and what pushes send)."""
    name = str(getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None) or "float32")
    return getattr(torch, name.removeprefix("torch."), torch.float32)


def weight_bytes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    skip = tied_duplicates(model)
    return sum(v.numel() * (torch.empty((), dtype=dtype).element_size() if dtype else v.element_size())
               for k, v in model.state_dict().items() if k not in skip)
