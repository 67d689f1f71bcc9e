"""Adapter push: only the LoRA adapter goes to the engines, inside the same pause -> update -> resume as a full push.

A LoRA run's base weights never change, so a push sends megabytes instead of the whole model. The engine
routes are SGLang's (0.5.19 ``srt/entrypoints/http_server.py``, bodies ``srt/managers/io_struct.py``), which
the embedded engine serves as well:

- ``POST /load_lora_adapter {"lora_name", "lora_path"}``: a peft adapter directory the engine can read;
- ``POST /load_lora_adapter_from_tensors {"lora_name", "config_dict", "serialized_named_tensors",
  "load_format"}``: ``config_dict`` is the ``adapter_config.json`` content and ``serialized_named_tensors[0]``
  base64 of a ``ForkingPickler`` dump of ``{peft key: tensor}`` (CUDA IPC handles on a GPU, shared-memory files
  on a CPU: the engine must run on the trainer's machine);
- ``POST /unload_lora_adapter {"lora_name"}``;
- each answers ``{"success", "error_message", "loaded_adapters"}`` (400 when refused).

SGLang refuses to load a name that is already loaded, so a new version is unload + load, done while
generation is paused (a request naming the adapter waits in the gateway or the paused engine, never sees
it missing). SGLang's load route carries no weight version, so the engine's version is then moved with
``POST /update_weight_version`` and generation resumes with it: tokens carry the version of the adapter that
sampled them, exactly as after a full push. A push that fails after every retry reloads the previous
adapter directory on the engines it reached (disk mode), resumes on the old version and raises
:class:`~trainer.weight_sync.WeightSyncError`.

Gathering the adapter from FSDP2 shards is a collective: every rank calls :func:`push_adapter`; rank 0 does
the HTTP and its outcome is broadcast.
"""

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
from trainer.weight_sync import WeightSyncError, broadcast_object

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


def post(client: httpx.Client, url: str, body: dict[str, Any], *, timeout: float = 600.0) -> dict[str, Any]:
    """POST JSON to an engine; a transport error, a non-2xx status or ``success: false`` raises WeightSyncError."""
    try:
        resp = client.post(url, json=body, timeout=timeout)
    except httpx.HTTPError as exc:
        raise WeightSyncError(f"POST {url} failed: {exc!r}") from exc
    try:
        data = resp.json()
    except ValueError:
        data = None
    if resp.status_code // 100 != 2 or (isinstance(data, dict) and data.get("success") is False):
        message = data.get("error_message") or data.get("message") if isinstance(data, dict) else resp.text
        raise WeightSyncError(f"POST {url} answered {resp.status_code}: {str(message)[:500]}")
    return data if isinstance(data, dict) else {}


@dataclass
class AdapterSync:
    """Stage the adapter (before the pause) and load it on engines under ``name``, by ``mode``."""

    name: str
    mode: str  # disk | tensor
    sync_dir: Path  # disk mode: adapter directories the engines can read
    client: httpx.Client
    keep: int = 2  # adapter directories kept (the served one and the one before, for rollback)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"adapter push mode {self.mode!r}: use {' or '.join(MODES)}")
        self.sync_dir = Path(self.sync_dir).resolve()  # the engines resolve paths against their own cwd
        self.served: Path | None = None  # the directory the engines load on rollback
        self._held: torch.Tensor | None = None

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
        """Rank 0: on each engine, unload the old version and load the new one; ``touched`` collects the
        engines whose adapter was unloaded (they need a rollback if the push fails)."""
        for url in engines:
            if url not in touched:
                self._unload(url)
                touched.append(url)
            if self.mode == "disk":
                post(self.client, f"{url}/load_lora_adapter", {"lora_name": self.name, "lora_path": str(staged)})
            else:
                post(self.client, f"{url}/load_lora_adapter_from_tensors",
                     {"lora_name": self.name, "config_dict": staged["config_dict"],
                      "serialized_named_tensors": [staged["payload"]], "load_format": None})

    def _unload(self, url: str) -> None:
        """Unload ``name`` if the engine has it (the first push finds none: SGLang answers 400 then)."""
        try:
            post(self.client, f"{url}/unload_lora_adapter", {"lora_name": self.name})
        except WeightSyncError as exc:
            if "does not exist" not in str(exc):  # SGLang's answer for a name it does not have: nothing to unload
                raise

    def rollback(self, engines: list[str]) -> None:
        """Disk mode: the engines that lost the adapter load the previous directory again."""
        if self.mode != "disk" or self.served is None:
            return
        for url in engines:
            try:
                self._unload(url)
                post(self.client, f"{url}/load_lora_adapter", {"lora_name": self.name, "lora_path": str(self.served)})
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


def set_version(client: httpx.Client, url: str, version: int) -> None:
    # SGLang 0.5.19 UpdateWeightVersionReqInput aborts every request unless told not to
    post(client, f"{url}/update_weight_version", {"new_version": str(version), "abort_all_requests": False})


def push_adapter(model: torch.nn.Module, version: int, *, info: DistInfo, transport: AdapterSync, control,
                 retries: int = 3, backoff_s: float = 1.0) -> AdapterPushResult:
    """Collective: stage the adapter, pause generation, load it on every engine as ``version``, resume.

    ``control``: the full push's pause/resume (the gateway's admin API, or the engines directly). Raises
    WeightSyncError on every rank when the push failed after ``retries`` attempts; the engines then serve the
    previous adapter (disk mode) at ``version - 1``."""
    start = time.perf_counter()
    staged = transport.stage(model, version, info)
    paused_at = time.perf_counter()
    error: str | None = None
    engines: list[str] = []
    if info.is_main:
        try:
            engines = control.engines()
            control.pause()
        except WeightSyncError as exc:
            error = f"cannot pause generation: {exc}"
    error = broadcast_object(error, info)
    if error:
        raise WeightSyncError(error)
    attempts = 0
    touched: list[str] = []
    try:
        for attempts in range(1, retries + 1):
            if info.is_main:
                try:
                    transport.send(engines, staged, touched)
                    for url in engines:
                        set_version(transport.client, url, version)
                    error = None
                except WeightSyncError as exc:
                    error = str(exc)
            error = broadcast_object(error, info)
            if error is None:
                break
            log.warning("adapter push v%d attempt %d/%d failed: %s", version, attempts, retries, error)
            if attempts < retries:
                time.sleep(backoff_s * attempts)
    finally:
        if info.is_main:
            if error is not None and touched:
                transport.rollback(touched)
                for url in touched:
                    try:
                        set_version(transport.client, url, version - 1)
                    except WeightSyncError as exc:
                        log.error("could not set %s back to version %d: %s", url, version - 1, exc)
            try:
                control.resume(version if error is None else version - 1)
            except WeightSyncError as exc:
                error = error or f"adapter pushed but generation could not be resumed: {exc}"
        paused_s = time.perf_counter() - paused_at
        error = broadcast_object(error, info)
    if error is not None:
        raise WeightSyncError(
            f"adapter push of version {version} failed after {attempts} attempt(s): {error}. The engines keep "
            f"serving version {version - 1}; the current batch was not acknowledged.")
    if info.is_main:
        transport.committed(staged)
    stale = len(getattr(control, "stale_cache", ())) if info.is_main else 0
    return AdapterPushResult(version, time.perf_counter() - start, lora.adapter_bytes(model, served_dtype(model)),
                             attempts, paused_s, stale)
