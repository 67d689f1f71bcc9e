"""LoRA training: a peft adapter on the trained model, its tensors in peft's own layout, and merging.

Why peft: the layout it saves (``adapter_config.json`` + ``adapter_model.safetensors`` with keys
``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``) is what vLLM, SGLang and the embedded engine
load as is, and what users already have tools for. The adapter is injected in place
(``peft.inject_adapter_in_model``): the model stays the Hugging Face causal LM, so packing, the one-rank
shadow weights, FSDP2 and compile see the same module tree as for full fine-tuning; each targeted
``nn.Linear`` becomes peft's ``lora.Linear`` (``base_layer`` + ``lora_A``/``lora_B``). Only the adapter's
parameters require grad, so only they get gradients and AdamW state; the frozen base can be held in the
compute dtype (no float32 master copy of it, ``trainer.model.load_model``).

No dropout: the trainer recomputes the engines' logprobs, and a random mask would make every recompute
differ from the sampled distribution.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

ATTR = "_agentrl_lora"  # the model's peft LoraConfig (set by :func:`apply`)
ADAPTER = "default"  # peft's adapter name inside the modules (``lora_A.default.weight``)
PREFIX = "base_model.model."  # peft's key prefix in adapter_model.safetensors (a PeftModel's own path)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoraSpec:
    """What ``--lora-rank/--lora-alpha/--lora-targets`` ask for."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = (ALL_LINEAR,)


def resolve_targets(model: torch.nn.Module, targets: Sequence[str]) -> list[str]:
    """Module names (last path component, e.g. ``q_proj``) to adapt; ``all-linear`` = every ``nn.Linear`` of the
    decoder layers (not the LM head, as peft's own ``all-linear``). Short names, not peft's expanded full paths:
    vLLM and SGLang match adapters against their own module names by this suffix."""
    layers = model.model.layers
    linear = sorted({name.rsplit(".", 1)[-1] for name, mod in layers.named_modules()
                     if isinstance(mod, torch.nn.Linear)})
    wanted: list[str] = []
    for target in targets:
        if target == ALL_LINEAR:
            wanted += [n for n in linear if n not in wanted]
        elif target in linear:
            if target not in wanted:
                wanted.append(target)
        else:
            raise ValueError(f"--lora-targets {target!r}: the decoder layers have no linear module of that name; "
                             f"valid: {ALL_LINEAR}, {', '.join(linear)}")
    if not wanted:
        raise ValueError("--lora-targets is empty: give module names such as q_proj,v_proj, or all-linear")
    return wanted


def apply(model: torch.nn.Module, spec: LoraSpec, *, base_path: str | Path | None = None) -> torch.nn.Module:
    """Inject a LoRA adapter into ``model`` (in place, before any FSDP wrapping); freezes everything else.

    peft initialises ``lora_B`` to zero, so the adapted model starts equal to the base model."""
    from peft import LoraConfig, inject_adapter_in_model

    if spec.rank < 1:
        raise ValueError(f"lora rank {spec.rank}: use 1 or more")
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=resolve_targets(model, spec.targets),
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                        base_model_name_or_path=str(base_path) if base_path else None)
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_name(name))
    setattr(model, ATTR, config)
    return model


def config_of(model: torch.nn.Module):
    """The model's peft ``LoraConfig``, or None for full fine-tuning."""
    return getattr(model, ATTR, None)


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def peft_key(name: str) -> str:
    """Module state-dict name -> peft's saved key: ``model.layers.0.self_attn.q_proj.lora_A.default.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return PREFIX + name.replace(f".{ADAPTER}.", ".")


def module_name(key: str) -> str:
    """The inverse of :func:`peft_key`."""
    if not key.startswith(PREFIX):
        raise ValueError(f"{key!r} is not a peft adapter key (expected the prefix {PREFIX!r})")
    body = key[len(PREFIX):]
    for part in ("lora_A", "lora_B"):
        body = body.replace(f".{part}.", f".{part}.{ADAPTER}.")
    return body


def adapter_tensors(model: torch.nn.Module, *, dtype: torch.dtype | None = None,
                    to_cpu: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(peft key, full tensor) for every adapter weight, gathered from the FSDP2 shards, optionally cast.

    A collective with several ranks: every rank must iterate to the end."""
    for name, value in model.state_dict().items():
        if not is_adapter_name(name):
            continue
        full = (value.full_tensor() if isinstance(value, DTensor) else value).detach()
        if dtype is not None and full.is_floating_point():
            full = full.to(dtype)
        yield peft_key(name), (full.cpu() if to_cpu else full)


def adapter_bytes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    size = torch.empty((), dtype=dtype).element_size() if dtype is not None else None
    return sum(p.numel() * (size or p.element_size()) for n, p in model.state_dict().items() if is_adapter_name(n))


def save_adapter(tensors: Iterator[tuple[str, torch.Tensor]] | dict[str, torch.Tensor], config,
                 target: str | Path) -> Path:
    """Write ``target/adapter_config.json`` and ``target/adapter_model.safetensors`` (peft's layout), atomically."""
    from safetensors.torch import save_file

    target = Path(target)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    items = tensors.items() if isinstance(tensors, dict) else tensors
    save_file({k: v.detach().cpu().contiguous() for k, v in items}, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    write_config(config, tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def config_dict(config) -> dict:
    """peft's ``adapter_config.json`` content (``inference_mode: true``, as ``PeftModel.save_pretrained`` writes
    it); also the ``config_dict`` of SGLang's ``/load_lora_adapter_from_tensors``."""
    saved = config.to_dict()
    saved["inference_mode"] = True
    for key, value in list(saved.items()):
        if isinstance(value, set):
            saved[key] = sorted(value)
        elif hasattr(value, "value"):  # enums (peft_type, task_type)
            saved[key] = value.value
    return json.loads(json.dumps(saved, default=str))


def write_config(config, directory: Path) -> None:
    (Path(directory) / CONFIG_FILE).write_text(json.dumps(config_dict(config), indent=2, sort_keys=True))


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file() and (Path(path) / WEIGHTS_FILE).is_file()


def read_config(path: str | Path):
    from peft import LoraConfig

    return LoraConfig.from_pretrained(str(path))


@torch.no_grad()
def load_adapter(model: torch.nn.Module, path: str | Path) -> None:
    """Copy the adapter weights saved under ``path`` into ``model``'s adapter (before FSDP wrapping)."""
    from safetensors.torch import load_file

    saved = load_file(str(Path(path) / WEIGHTS_FILE))
    params = dict(model.named_parameters())
    names = {module_name(k): k for k in saved}
    mine = {n for n in params if is_adapter_name(n)}
    if set(names) != mine:
        missing, extra = sorted(mine - set(names)), sorted(set(names) - mine)
        raise ValueError(f"adapter at {path} does not fit the model's LoRA layers (missing {missing[:3]}, "
                         f"unexpected {extra[:3]}): was it trained with other --lora-targets or rank?")
    for name, key in names.items():
        params[name].copy_(saved[key].to(params[name].dtype))


def merge(adapter_dir: str | Path, base_dir: str | Path, out: str | Path, *, dtype: str | None = None) -> Path:
    """Base weights + adapter -> a plain Hugging Face checkpoint (``W + alpha / r * B @ A`` in every targeted
    layer), with the base's tokenizer files; saved in ``dtype`` or the dtype the base declares."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    declared = getattr(AutoConfig.from_pretrained(str(base_dir)), "dtype", None) or torch.float32
    target_dtype = getattr(torch, str(dtype or declared).removeprefix("torch."))
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    merged.to(target_dtype).save_pretrained(out)
    for extra in Path(base_dir).iterdir():  # tokenizer and chat template files: the base's own
        weights = extra.suffix in (".safetensors", ".bin") or extra.name.endswith(".index.json")
        if extra.is_file() and not weights and not (out / extra.name).exists():
            shutil.copy2(extra, out / extra.name)
    return out


def resume_adapter(checkpoint: str | Path | None, spec: LoraSpec | None) -> Path | None:
    """The adapter directory to resume ``spec``'s run from (None: start from a fresh adapter). A checkpoint of
    the other kind (full weights for a LoRA run, an adapter for full fine-tuning) or of another rank, scale or
    targets is refused with what to do."""
    from agentrl.settings import SettingsError

    if checkpoint is None:
        return None
    adapter = is_adapter_dir(checkpoint)
    if spec is None and adapter:
        raise SettingsError(f"the newest checkpoint {checkpoint} holds a LoRA adapter: resume it with the same "
                            "--lora-rank (and --lora-alpha, --lora-targets), or give a new --checkpoint-dir")
    if spec is None:
        return None
    if not adapter:
        raise SettingsError(f"the newest checkpoint {checkpoint} holds full weights, not a LoRA adapter: train the "
                            "adapter in a new --checkpoint-dir, or continue full fine-tuning without --lora-rank")
    saved = read_config(checkpoint)
    if saved.r != spec.rank or float(saved.lora_alpha) != float(spec.alpha):
        raise SettingsError(f"the checkpoint {checkpoint} is a rank {saved.r} adapter with lora_alpha "
                            f"{saved.lora_alpha}; resume with --lora-rank {saved.r} --lora-alpha {saved.lora_alpha}")
    return Path(checkpoint)
