"""The trained model: process group, FSDP2 sharding, token logprobs, and full weights for pushes/checkpoints.

Under ``torchrun`` every rank joins the default process group (NCCL on GPUs with gloo for CPU-side
objects, gloo on CPUs); a plain ``python -m trainer`` / ``agentrl train`` joins a one-process group. With
several ranks each decoder layer is one FSDP2 unit (``fully_shard``) and the root (embeddings, final norm,
tied LM head) another. With one rank there is nothing to shard: the model is not wrapped (no gather, cast
or reduce hooks per step) and, for bfloat16 compute, keeps bfloat16 compute weights beside its float32
parameters between steps (:mod:`trainer.shadow`); ``fsdp=True`` forces the FSDP2 wrapping on one rank.
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


def close_distributed(*, finished: bool) -> None:
    """Leave the default process group. ``finished``: every rank got here the normal way, so they first
    meet at a barrier; a rank that left the group while another still had gloo work in flight with it makes
    that rank's gloo thread abort the process (SIGABRT, "terminate called without an active exception").
    After an error the other ranks may never arrive, so there is no barrier then."""
    if not dist.is_initialized():
        return
    if finished and dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


def load_model(path: str | Path, *, dtype: str = "float32", device: torch.device | None = None,
               compile: bool = False, fsdp: bool | None = None, lora=None,
               adapter: str | Path | None = None) -> torch.nn.Module:
    """Load a Hugging Face causal LM and shard it with FSDP2 over the default process group (several ranks).

    Parameters (and optimizer state) stay float32; ``dtype="bfloat16"`` computes in bfloat16 (the usual
    setting on GPUs): through FSDP2's mixed-precision policy with several ranks (gradients reduced in
    float32), through :mod:`trainer.shadow` compute weights with one (gradients accumulated in float32).
    ``fsdp``: None = FSDP2 only with several ranks; True = also with one (the earlier one-GPU path, kept
    for comparison). ``compile``: :func:`compile_body`. The model gets the packed logprob method of
    :mod:`trainer.packing`.

    ``lora`` (a :class:`trainer.lora.LoraSpec`): train a LoRA adapter on the frozen base at ``path``
    (:mod:`trainer.lora`); ``adapter``: a saved adapter directory to start from (a resumed run). With one rank
    and bfloat16 compute the frozen base is held in bfloat16 only (no float32 copy), the adapter as float32
    masters with bfloat16 shadows.
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
    several = dist.get_world_size() > 1 if dist.is_initialized() else False
    if lora is not None:
        from trainer import lora as lora_mod

        lora_mod.apply(model, lora, base_path=path)
        if adapter is not None:
            lora_mod.load_adapter(model, adapter)
        if compute != torch.float32 and not (several or fsdp):
            for param in model.parameters():  # the frozen base needs no float32 master: one bf16 copy
                if not param.requires_grad:
                    param.data = param.data.to(compute)
    if several or fsdp:
        model = shard(model, compute_dtype=compute)
    elif compute != torch.float32:
        from trainer import shadow

        shadow.attach(model, compute)
    if compile:
        compile_body(model)
    return install(model)


def compile_body(model: torch.nn.Module, *, whole_layers: bool | None = None) -> None:
    """``torch.compile`` the decoder layers, with dynamic shapes (a new micro-batch shape does not recompile).

    ``whole_layers`` (default: when the layers are no FSDP2 units, i.e. one rank): each decoder layer is one
    graph (residual adds, rotary embedding and attention glue fused too: a quarter of the compiled calls per
    layer, which is what a launch-bound step on one GPU pays for), compiled with Inductor's
    ``emulate_precision_casts`` so that fused bf16 ops round where eager ones do (without it the step's
    loss moved by more than the bf16 tolerance against the eager reference on the H200). Otherwise (FSDP2
    units, several ranks): each layer's attention block, MLP and norms, so that the units' hooks and
    all-gathers stay eager and outside the graphs.
    """
    from torch.distributed.fsdp import FSDPModule

    from trainer import packing

    if next(model.parameters()).is_cuda:
        setattr(model, packing.COMPILED_HEAD, True)  # the LM head's softmax math as fused kernels
    units = any(isinstance(layer, FSDPModule) for layer in model.model.layers)
    if whole_layers is None:
        whole_layers = not units
    if whole_layers:
        if units:
            raise ValueError("whole-layer compile needs layers that are no FSDP2 units (one rank)")
        for layer in model.model.layers:
            layer.compile(dynamic=True, options={"emulate_precision_casts": True})
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
    """AdamW over the (sharded, float32) trained parameters; the fused kernel on GPUs (one launch per step, which
    also applies the gradient clipping of ``trainer.step``: no separate pass over the gradients)."""
    trained = [p for p in model.parameters() if p.requires_grad]  # a LoRA run: the adapter only
    return torch.optim.AdamW(trained, lr=settings.lr, weight_decay=settings.weight_decay,
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
