"""Checkpoints: a Hugging Face directory (loadable by transformers and by the engine) plus trainer state.

Layout of ``<checkpoint_dir>/step_<NNNNNN>/``::

    model.safetensors, config.json, tokenizer files   HF format (rank 0 writes the gathered full weights)
      or, for a LoRA run (trainer/lora.py):
    adapter_config.json, adapter_model.safetensors      the adapter only, in peft's layout (float32)
    optimizer/                                          torch.distributed.checkpoint of the sharded AdamW state
                                                        (absent when saved without it: --no-save-optimizer)
    trainer_state.json                                  {"step", "version", "seen_rows", ...}; written last

``trainer_state.json`` is written last, so a directory without it is an interrupted save and is ignored by
:func:`latest`. Resuming loads the model from the HF directory (then shards it), restores the optimizer
and continues the step and weight-version counts.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from trainer.model import DistInfo, iter_full_tensors
from trainer.weight_sync import save_hf_dir

STATE_FILE = "trainer_state.json"

log = logging.getLogger("trainer")


@dataclass
class TrainerState:
    step: int = 0
    version: int = 0
    seen_rows: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def step_dir(checkpoint_dir: str | Path, step: int) -> Path:
    return Path(checkpoint_dir) / f"step_{step:06d}"


def latest(checkpoint_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step_*") if (p / STATE_FILE).exists())
    return done[-1] if done else None


def save(checkpoint_dir: str | Path, state: TrainerState, model: torch.nn.Module,
         optimizer: torch.optim.Optimizer | None, info: DistInfo, *, source_dir: str | Path | None,
         keep: int = 0) -> Path:
    """Collective: write a checkpoint of ``model``/``optimizer`` at ``state.step``; returns its directory.
    ``optimizer=None`` writes the weights and the trainer state only (the optimizer state is about twice
    the weights' size: 1.1 GB beside 514 MB for SmolLM2-135M in float32).

    Older complete checkpoints beyond the newest ``keep`` are deleted (0 keeps every one)."""
    from trainer import lora

    path = step_dir(checkpoint_dir, state.step)
    config = lora.config_of(model)
    if config is not None:  # the frozen base is the model directory's own: only the adapter is saved
        tensors = lora.adapter_tensors(model, to_cpu=True)
    else:
        tensors = iter_full_tensors(model, to_cpu=True)
    if info.is_main and config is not None:
        lora.save_adapter(dict(tensors), config, path)
    elif info.is_main:
        save_hf_dir(tensors, model.config, path, Path(source_dir) if source_dir else None)
    else:
        for _ in tensors:  # take part in every gather
            pass
    if info.world_size > 1:
        dist.barrier()
    if optimizer is not None:
        dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(path / "optimizer"))
    if info.world_size > 1:
        dist.barrier()
    if info.is_main:
        (path / STATE_FILE).write_text(json.dumps(asdict(state)))
        _prune(Path(checkpoint_dir), keep)
    if info.world_size > 1:
        dist.barrier()
    return path


def load_optimizer(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: restore the sharded optimizer state saved by :func:`save` (model already loaded); a
    checkpoint saved without it leaves the fresh optimizer as it is."""
    if not (Path(path) / "optimizer").is_dir():
        log.warning("%s holds no optimizer state (saved with --no-save-optimizer): AdamW starts afresh", path)
        return
    target = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(target, checkpoint_id=str(Path(path) / "optimizer"))
    set_optimizer_state_dict(model, optimizer, target["optimizer"])


def load_state(path: str | Path) -> TrainerState:
    data = json.loads((Path(path) / STATE_FILE).read_text())
    return TrainerState(**data)


def _prune(root: Path, keep: int) -> None:
    if keep <= 0:
        return
    done = sorted(p for p in root.glob("step_*") if (p / STATE_FILE).exists())
    for old in done[: max(0, len(done) - keep)]:
        shutil.rmtree(old, ignore_errors=True)
