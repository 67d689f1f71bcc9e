"""Adapter push: only the LoRA adapter goes to the engines, inside the same pause -> update -> resume as a full push.

A LoRA run's base weights never change, so a push sends megabytes instead of the whole model. The per-kind
routes are the engines' own (:class:`engines.sglang.SGLangOps` and :class:`engines.vllm.VLLMOps`, methods
``reload_adapter`` / ``reload_adapter_tensors`` / ``unload_adapter``; :class:`AdapterSync` picks them by
``engine_kind``, ``auto`` detecting each engine):

- SGLang (0.5.19 and 0.5.23, which the embedded engine speaks too): ``POST /load_lora_adapter {"lora_name",
  "lora_path"}``, ``POST /load_lora_adapter_from_tensors {"lora_name", "config_dict",
  "serialized_named_tensors", "load_format"}`` (``config_dict``: the ``adapter_config.json`` content;
  ``serialized_named_tensors``: per TP rank, base64 of a ``ForkingPickler`` dump of ``{peft key: tensor}``,
  CUDA IPC handles on a GPU, shared-memory files on a CPU: the engine must run on the trainer's machine),
  ``POST /unload_lora_adapter {"lora_name"}``; each answers ``{"success", "error_message",
  "loaded_adapters"}`` (400 when refused). SGLang refuses to load a loaded name, so a new version is unload +
  load, done while generation is paused (a request naming the adapter waits in the gateway or the paused
  engine, never sees it missing).
- vLLM (0.32): ``POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace": true}`` replaces the
  adapter in one call; disk mode only (vLLM has no tensor route).

The load routes carry no weight version, so the engine's version is then moved with ``POST
/update_weight_version`` and generation resumes with it: tokens carry the version of the adapter that sampled
them, exactly as after a full push. The pause, the retries, the rollback and the resume are the full push's
(:func:`trainer.weight_sync.paused_push`): a push that fails after every retry reloads the previous adapter
directory on the engines it reached (disk mode), resumes on the old version and raises
:class:`~trainer.weight_sync.WeightSyncError`.

Gathering the adapter from FSDP2 shards is a collective: every rank calls :func:`push_adapter`; rank 0 does
the HTTP and its outcome is broadcast."""

from __future__ import annotations

import base64
import io
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from trainer import lora
from trainer.model import DistInfo, served_dtype
from trainer.weight_sync import EngineSet, WeightSyncError, on_main, ops_call, paused_push

log = logging.getLogger(__name__)

MODES = ("disk", "tensor")


@dataclass
class AdapterPushResult:
    version: int
    seconds: float  # the whole push: staging, pause, update, resume
    bytes: int  # the adapter as sent
    attempts: int
    paused_s: float = 0.0
    # engines whose prefix cache survived the resume (DirectControl's refused flush, as for a full push); SGLang
    # keys its radix cache by adapter id, and a reloaded adapter gets a new id, so none of it is reused for it
    stale_cache_engines: int = 0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


@dataclass
class AdapterSync:
    """Stage the adapter (before the pause) and load it on engines under ``name``, by ``mode``."""

    name: str
    mode: str  # disk | tensor
    sync_dir: Path  # disk mode: adapter directories the engines can read
    client: httpx.Client
    keep: int = 2  # adapter directories kept (the served one and the one before, for rollback)
    # sglang (SGLang, the embedded engine) | vllm | auto (detected per engine); None: the push's control's
    # (DirectControl's engine_kind), auto behind a gateway
    engine_kind: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"adapter push mode {self.mode!r}: use {' or '.join(MODES)}")
        self.sync_dir = Path(self.sync_dir).resolve()  # the engines resolve paths against their own cwd
        self.served: Path | None = None  # the directory the engines load on rollback
        self._held: torch.Tensor | None = None
        self._ops: EngineSet | None = None

    def bind(self, control: Any) -> None:
        """Fix the engine kind once: the one given, else the control's (DirectControl's), else auto."""
        if self._ops is None:
            kind = self.engine_kind or getattr(getattr(control, "ops", None), "kind", None) or "auto"
            self._ops = EngineSet(self.client, kind)

    def ops(self, url: str):
        """The engine kind's control calls for ``url`` (SGLangOps or VLLMOps)."""
        self.bind(None)
        return self._ops(url)

    def stage(self, model: torch.nn.Module, version: int, info: DistInfo) -> Any:
        """Collective: gather the adapter in the served dtype; rank 0 returns what :meth:`send` sends."""
        config = lora.config_of(model)
        tensors = lora.adapter_tensors(model, dtype=served_dtype(model))
        if not info.is_main:
            for _ in tensors:  # take part in every gather
                pass
            return None
        if self.mode == "disk":
            return lora.save_adapter(dict(tensors), config, self.sync_dir / f"{self.name}-v{version}")
        return self._serialize(dict(tensors), config)

    def _serialize(self, tensors: dict[str, torch.Tensor], config) -> dict[str, Any]:
        """The adapter in one flat buffer (one shared-memory file on a CPU, one CUDA IPC allocation on a GPU,
        instead of one per tensor: hundreds of them), pickled as ``{key: view}``; the buffer is held until
        the engines answered."""
        from multiprocessing.reduction import ForkingPickler

        first = next(iter(tensors.values()))
        flat = torch.empty(sum(t.numel() for t in tensors.values()), dtype=first.dtype, device=first.device)
        if flat.device.type == "cpu":
            torch.multiprocessing.set_sharing_strategy("file_system")  # a file any process on this host can open
            flat.share_memory_()
        views, offset = {}, 0
        for key, t in tensors.items():
            view = flat[offset:offset + t.numel()].view(t.shape)
            view.copy_(t)
            views[key] = view
            offset += t.numel()
        if flat.device.type == "cuda":
            torch.cuda.synchronize(flat.device)
        buf = io.BytesIO()
        ForkingPickler(buf).dump(views)
        self._held = flat  # alive until the engines answered
        return {"config_dict": lora.config_dict(config), "payload": base64.b64encode(buf.getvalue()).decode("ascii")}

    def send(self, engines: list[str], staged: Any, touched: list[str]) -> None:
        """Rank 0: on each engine, replace the adapter under ``name`` by the new version (the engine kind's
        ``reload_adapter``: SGLang unload + load, vLLM ``load_inplace``); ``touched`` collects the engines
        asked to (they need a rollback if the push fails)."""
        for url in engines:
            if url not in touched:
                touched.append(url)
            if self.mode == "disk":
                ops_call(self.ops(url).reload_adapter, self.name, str(staged))
            else:
                ops_call(self.ops(url).reload_adapter_tensors, self.name, staged["config_dict"], staged["payload"])

    def set_version(self, engines: list[str], version: int) -> None:
        for url in engines:
            ops_call(self.ops(url).set_version, version)

    def rollback(self, engines: list[str]) -> None:
        """Disk mode: the engines that lost the adapter load the previous directory again."""
        if self.mode != "disk" or self.served is None:
            return
        for url in engines:
            try:
                ops_call(self.ops(url).reload_adapter, self.name, str(self.served))
            except WeightSyncError as exc:
                log.error("rollback of adapter %r on %s failed: %s", self.name, url, exc)

    def committed(self, staged: Any) -> None:
        self._held = None
        if self.mode != "disk" or staged is None:
            return
        self.served = Path(staged)
        dirs = sorted((p for p in self.sync_dir.glob(f"{self.name}-v*") if p.is_dir() and not p.name.endswith(".tmp")),
                      key=lambda p: p.stat().st_mtime)
        for old in dirs[: max(0, len(dirs) - self.keep)]:
            if old != self.served:
                shutil.rmtree(old, ignore_errors=True)


def push_adapter(model: torch.nn.Module, version: int, *, info: DistInfo, transport: AdapterSync, control,
                 retries: int = 3, backoff_s: float = 1.0) -> AdapterPushResult:
    """Collective: stage the adapter, pause generation, load it on every engine as ``version``, resume.

    ``control``: the full push's pause/resume (the gateway's admin API, or the engines directly), and the
    same pause -> update -> resume (:func:`trainer.weight_sync.paused_push`). Raises WeightSyncError on every
    rank when the push failed after ``retries`` attempts; the engines then serve the previous adapter (disk
    mode) at ``version - 1``."""
    start = time.perf_counter()
    transport.bind(control)
    staged = transport.stage(model, version, info)

    def send(engines: list[str], touched: list[str]) -> str | None:
        def load() -> None:
            transport.send(engines, staged, touched)
            transport.set_version(engines, version)
        return on_main(info, load)

    def rollback(touched: list[str]) -> None:
        transport.rollback(touched)
        try:
            transport.set_version(touched, version - 1)
        except WeightSyncError as exc:
            log.error("could not set %s back to version %d: %s", touched, version - 1, exc)

    attempts, paused_s = paused_push("adapter", version, info=info, control=control, send=send, rollback=rollback,
                                     retries=retries, backoff_s=backoff_s)
    if info.is_main:
        transport.committed(staged)
    stale = len(getattr(control, "stale_cache", ())) if info.is_main else 0
    return AdapterPushResult(version, time.perf_counter() - start, lora.adapter_bytes(model, served_dtype(model)),
                             attempts, paused_s, stale)
