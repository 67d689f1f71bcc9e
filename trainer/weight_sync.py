"""Weights out: push the trainer's weights to the engines, wrapped as pause -> update -> resume.

Three transports, one wrapper:

* :class:`DiskSync`: rank 0 writes a Hugging Face directory (safetensors + config + tokenizer) under
  ``sync_dir/v<version>`` **before** generation is paused, then every engine loads it at once (SGLang:
  ``POST /update_weights_from_disk``; vLLM: ``reload_weights`` + ``/update_weight_version``; the per-kind
  calls are in :mod:`trainer.engine_ops`): generation is paused only for the loads (``PushResult.paused_s``).
* :class:`TensorSync` (engines sharing the trainer's GPU): the weights in one flat buffer, sent as CUDA IPC
  handles with SGLang's ``POST /update_weights_from_tensor``; staged before the pause like disk mode.
* :class:`BroadcastSync`: rank 0 forms a process group with the engines once (``POST
  /init_weights_update_group`` on each engine while the trainer joins as rank 0, see
  :mod:`agentrl.weight_group`), then sends the weights in buckets: for each bucket, ``POST
  /update_weights_from_distributed`` with the names/dtypes/shapes (from a thread, because the engine answers
  only once it has received the tensors) while the trainer broadcasts the same tensors in the same order.

:func:`push_weights` pauses generation (through the gateway's ``POST /admin/pause`` so that in-flight
requests are aborted, held and later resumed by the gateway; or directly on the engines when there is no
gateway), updates, and resumes with the new version (``POST /admin/resume {"weight_version"}``). A failed
update is retried; after the last attempt the engines that already took the new weights are rolled back
(disk mode: they reload the previous directory), generation resumes on the **old** version, and
:class:`WeightSyncError` stops the trainer. The caller acknowledges its lease only after a successful push,
so nothing is acknowledged that the engines do not serve.

Gathering the full weights from the FSDP2 shards is a collective: every rank calls :func:`push_weights`;
only rank 0 talks HTTP, and its outcome is broadcast so that every rank raises the same error.
"""

from __future__ import annotations

import copy
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import torch
import torch.distributed as dist

from agentrl.procs import free_port
from trainer.engine_ops import EngineOpsError, SGLangOps, VLLMOps, engine_ops, post
from trainer.model import DistInfo, iter_full_tensors, served_dtype, tied_duplicates
from trainer.safetensors_io import HostBuffer, save_file_fast

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "vocab.json", "merges.txt")


class WeightSyncError(RuntimeError):
    """A weight push failed after every retry; the engines keep serving the old version."""


def _post(client: httpx.Client, url: str, body: dict[str, Any], *, timeout: float | None = None,
          headers: dict[str, str] | None = None) -> dict[str, Any]:
    """POST JSON; any transport error, non-2xx status or ``success: false`` raises WeightSyncError."""
    try:
        return post(client, url, body, timeout=timeout, headers=headers)
    except EngineOpsError as exc:
        raise WeightSyncError(str(exc)) from exc


class EngineSet:
    """The :class:`~trainer.engine_ops.EngineOps` of each engine URL, its kind given or detected once."""

    def __init__(self, client: httpx.Client, kind: str = "auto") -> None:
        self.client, self.kind = client, kind
        self._ops: dict[str, SGLangOps | VLLMOps] = {}

    def __call__(self, url: str) -> SGLangOps | VLLMOps:
        if url not in self._ops:
            try:
                self._ops[url] = engine_ops(self.client, url, self.kind)
            except EngineOpsError as exc:
                raise WeightSyncError(str(exc)) from exc
        return self._ops[url]


def ops_call(fn: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    try:
        fn(*args, **kwargs)
    except EngineOpsError as exc:
        raise WeightSyncError(str(exc)) from exc


# ------------------------------------------------------------------------------------ pause and resume


class Control(Protocol):
    #: whether weight updates may ask the engine to flush its prefix cache (SGLang flushes only an idle
    #: scheduler: 0.5.19 asserts and dies otherwise, 0.5.23 answers 400)
    flush_with_update: bool

    def engines(self) -> list[str]: ...
    def pause(self) -> None: ...
    def resume(self, version: int) -> None: ...


class GatewayControl:
    """Pause/resume through the gateway's admin API, which holds and re-sends aborted requests.

    The gateway pauses in ``abort`` mode: the engines' schedulers are empty during the update, so the
    update itself may flush the prefix cache."""

    flush_with_update = True

    def __init__(self, gateway: str, admin_key: str, *, client: httpx.Client | None = None,
                 engine_urls: Iterable[str] = ()) -> None:
        self.base = gateway.rstrip("/")
        self.client = client or httpx.Client(timeout=60.0)
        self.headers = {"Authorization": f"Bearer {admin_key}"}
        self._engine_urls = list(engine_urls)

    def engines(self) -> list[str]:
        if self._engine_urls:
            return self._engine_urls
        try:
            resp = self.client.get(f"{self.base}/admin/engines", headers=self.headers)
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"cannot list engines at {self.base}/admin/engines: {exc!r}") from exc
        if resp.status_code != 200:
            raise WeightSyncError(f"GET /admin/engines answered {resp.status_code}: {resp.text[:300]}")
        return parse_engines(resp.json())

    def pause(self) -> None:
        _post(self.client, f"{self.base}/admin/pause", {}, headers=self.headers)

    def resume(self, version: int) -> None:
        _post(self.client, f"{self.base}/admin/resume", {"weight_version": int(version)}, headers=self.headers)

    def register_trainer(self, version: int, batch_size: int, staleness_bound: int,
                         group_size: int | None = None, metrics: dict[str, float] | None = None) -> None:
        body: dict[str, Any] = {"version": int(version), "batch_size": int(batch_size),
                                "staleness_bound": int(staleness_bound)}
        if group_size is not None:  # the gateway budgets in sessions: batch_size x group_size
            body["group_size"] = int(group_size)
        if metrics:
            body["metrics"] = metrics  # the step's numbers, for the gateway's trainer page
        _post(self.client, f"{self.base}/admin/trainer", body, headers=self.headers)


def parse_engines(body: Any) -> list[str]:
    """Engine URLs from ``GET /admin/engines`` (a list, or ``{"engines": [...]}``, of URLs or ``{"url": ...}``)."""
    items = body.get("engines", body.get("data", [])) if isinstance(body, dict) else body
    urls = []
    for item in items or []:
        url = item if isinstance(item, str) else (item.get("url") or item.get("base_url"))
        if url:
            urls.append(str(url).rstrip("/"))
    if not urls:
        raise WeightSyncError(f"the gateway lists no engines ({str(body)[:200]}); start one or pass --engine-urls")
    return urls


class DirectControl:
    """No gateway: pause and continue the engines themselves, keeping in-flight requests.

    SGLang can flush its prefix cache (stale after new weights) only when its scheduler is idle: 0.5.19
    requires no running and no queued request (and an update with ``flush_cache`` that finds requests
    asserts and kills the server); 0.5.23 ignores the queue while paused and answers 400 otherwise. So the
    engines pause in ``retract`` mode (running requests go back to the queue, their KV cache freed and
    recomputed after continue), the updates do not flush, and ``resume`` flushes while still paused with
    ``POST /flush_cache``: it succeeds on 0.5.23, and on 0.5.19 whenever nothing was in flight; a refused
    flush is logged (the prefix cache then still holds KV computed under the old weights) and generation
    continues. It is not retried: once the retracted requests run again 0.5.19's scheduler is not idle
    until they end, and they would already have re-used the cached prefixes. :attr:`stale_cache` names
    those engines and the push reports their number (``PushResult.stale_cache_engines``). vLLM pauses in
    ``keep`` mode and resets its prefix cache before resuming (:mod:`engines.vllm`)."""

    flush_with_update = False

    def __init__(self, engine_urls: Iterable[str], *, client: httpx.Client | None = None,
                 engine_kind: str = "sglang") -> None:
        self._urls = [u.rstrip("/") for u in engine_urls]
        self.client = client or httpx.Client(timeout=60.0)
        self.ops = EngineSet(self.client, engine_kind)
        # the engines whose last resume kept a prefix cache computed under the old weights (flush refused)
        self.stale_cache: list[str] = []

    def engines(self) -> list[str]:
        return self._urls

    def pause(self) -> None:
        for url in self._urls:
            ops_call(self.ops(url).pause_keep)

    def resume(self, version: int) -> None:
        kept = []
        for url in self._urls:
            try:
                if not self.ops(url).resume_flushed():
                    kept.append(url)
            except EngineOpsError as exc:
                raise WeightSyncError(str(exc)) from exc
        self.stale_cache = kept


# ----------------------------------------------------------------------------------------- transports


def with_tied_copies(tensors: Iterable[tuple[str, torch.Tensor]],
                     model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` plus, for a tied-embedding model, the output embedding under its own name as well."""
    tied = tied_duplicates(model)
    embed = model.get_input_embeddings()
    embed_name = next((n for n, p in model.named_parameters() if p is embed.weight), None)
    kept: torch.Tensor | None = None
    for name, tensor in tensors:
        if name == embed_name:
            kept = tensor
        yield name, tensor
    if kept is not None:
        for name in sorted(tied):
            yield name, kept.clone()  # safetensors refuses two names sharing one storage


def save_hf_dir(tensors: Iterable[tuple[str, torch.Tensor]], config: Any, target: Path, source_dir: Path | None,
                *, buffer: HostBuffer | None = None, reuse: Path | None = None) -> Path:
    """Write an HF model directory (model.safetensors, config.json with ``architectures``,
    generation_config.json, tokenizer files) atomically. ``tensors`` come from ``iter_full_tensors``, which
    leaves out tied duplicates (``lm_head.weight``): the standard tied save, which SGLang's loaders expect.
    They may be on a GPU: :func:`trainer.safetensors_io.save_file_fast` copies them into one (pinned, reused
    with ``buffer``) host buffer and writes it from several threads. ``reuse``: an old directory of the same
    model that nobody reads any more; its ``model.safetensors`` is overwritten in place (its memory pages on
    a tmpfs such as /dev/shm are already there: a copy, not a fresh allocation of every page)."""
    target = Path(target)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    recycled = reuse is not None and (Path(reuse) / "model.safetensors").is_file()
    if recycled:
        os.rename(reuse, tmp)
        for old in tmp.iterdir():
            if old.name != "model.safetensors":
                shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        tmp.mkdir(parents=True)
    save_file_fast(tensors, tmp / "model.safetensors", metadata={"format": "pt"}, buffer=buffer, overwrite=recycled)
    if not getattr(config, "architectures", None):  # vLLM and SGLang pick the model class by it
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config = copy.deepcopy(config)
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.save_pretrained(tmp)
    if source_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(source_dir) / name).exists():
                shutil.copy2(Path(source_dir) / name, tmp / name)
    if not (tmp / "generation_config.json").exists():
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(config).save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


@dataclass
class DiskSync:
    """Save an HF directory, then ``POST /update_weights_from_disk`` on every engine."""

    sync_dir: Path
    source_dir: Path  # tokenizer files are copied from here; also the directory of version 0's weights
    client: httpx.Client
    keep: int = 2  # sync directories kept on disk (the newest is served, the one before is for rollback)
    engine_kind: str = "sglang"  # sglang | vllm | auto (detected per engine)

    def __post_init__(self) -> None:
        self.sync_dir = Path(self.sync_dir)
        self.served_path: Path = Path(self.source_dir)
        self.ops = EngineSet(self.client, self.engine_kind)
        self._engines: list[str] = []
        self._host = HostBuffer()  # pinned on a GPU; reused by every push

    def stage(self, model: torch.nn.Module, version: int, info: DistInfo) -> Path | None:
        """Collective: gather the weights (cast on the device); rank 0 writes ``sync_dir/v<version>``."""
        path = self.sync_dir / f"v{version}"
        tensors = iter_full_tensors(model, dtype=served_dtype(model))
        if info.is_main:
            if self._needs_tied_copies():
                tensors = with_tied_copies(tensors, model)
            started = time.perf_counter()
            save_hf_dir(tensors, model.config, path, self.source_dir, buffer=self._host, reuse=self._recyclable(path))
            log.info("staged v%d in %.2fs", version, time.perf_counter() - started)
            return path
        for _ in tensors:  # take part in every gather
            pass
        return None

    def _recyclable(self, target: Path) -> Path | None:
        """The oldest sync directory that is neither served (nor the rollback target) nor ``target``: its file
        is overwritten for the new version, so a steady run keeps ``keep`` directories and reuses their pages."""
        if not self.sync_dir.is_dir():
            return None
        served = Path(self.served_path).resolve()
        old = [p for p in self.sync_dir.glob("v*") if p.is_dir() and not p.name.endswith(".tmp")
               and p.resolve() not in (served, Path(target).resolve())]
        return min(old, key=lambda p: p.stat().st_mtime) if old else None

    def _needs_tied_copies(self) -> bool:
        """vLLM (0.32) reloads a tied-embedding model in place only when the checkpoint names the output
        embedding too: without ``lm_head.weight`` its layerwise reload puts the *old* output embedding back
        (measured: the served logprobs were those of the new body under the old head). SGLang and the
        embedded engine accept the extra name (SGLang's loader skips it for tied models). Staging happens
        before the engines are asked for, so ``auto`` decides by the engines of the last push (the first
        push writes the copy: harmless everywhere)."""
        if self.engine_kind != "auto":
            return self.engine_kind == "vllm"
        try:
            return not self._engines or any(self.ops(url).kind == "vllm" for url in self._engines)
        except WeightSyncError:
            return True

    def send(self, engines: list[str], version: int, staged: Path | None, updated: list[str], *,
             flush_cache: bool = True) -> None:
        """Rank 0 only. All engines load at once; appends each engine that took the update to ``updated``."""
        from concurrent.futures import ThreadPoolExecutor

        self._engines = list(engines)
        todo = [url for url in engines if url not in updated]

        def load(url: str) -> None:
            ops_call(self.ops(url).load_from_disk, str(staged), version, timeout=600.0, flush_cache=flush_cache)
            updated.append(url)

        with ThreadPoolExecutor(max_workers=max(1, len(todo))) as pool:
            errors = [f.exception() for f in [pool.submit(load, url) for url in todo]]
        failed = [e for e in errors if e is not None]
        if failed:
            raise failed[0]

    def committed(self, staged: Path | None) -> None:
        if staged is None:
            return
        self.served_path = staged
        versions = sorted(self.sync_dir.glob("v*"), key=lambda p: p.stat().st_mtime)
        for old in versions[: max(0, len(versions) - self.keep)]:
            if old != staged and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)

    def rollback(self, engines: list[str], old_version: int, *, flush_cache: bool = True) -> None:
        for url in engines:
            try:
                ops_call(self.ops(url).load_from_disk, str(self.served_path), old_version, timeout=600.0,
                      flush_cache=flush_cache)
            except WeightSyncError as exc:
                log.error("rollback of %s to version %d failed: %s", url, old_version, exc)


@dataclass
class TensorSync:
    """Engines on the trainer's machine and GPU: the weights by handle, SGLang's ``/update_weights_from_tensor``.

    Staging (before the pause) gathers the weights, casts them to the served dtype into one flat buffer on
    the trainer's device and pickles ``[(name, view), ...]`` with ``ForkingPickler``: on a GPU each view is
    a CUDA IPC handle into that buffer (one allocation, opened once by the engine), on a CPU a shared-memory
    file. The engine copies from the handles into its own weights before it answers; the buffer is freed
    once the push is committed. There is no rollback in this mode (as for broadcast).
    """

    client: httpx.Client
    engine_kind: str = "sglang"  # SGLang's route; the embedded engine speaks it too

    def __post_init__(self) -> None:
        self._held: tuple[torch.Tensor, list[tuple[str, torch.Tensor]]] | None = None
        self.ops = EngineSet(self.client, self.engine_kind)

    def stage(self, model: torch.nn.Module, version: int, info: DistInfo) -> str | None:
        """Collective: gather; rank 0 returns the base64 payload (and holds the buffer until committed)."""
        import base64
        import io
        from multiprocessing.reduction import ForkingPickler

        dtype = served_dtype(model)
        tensors = list(iter_full_tensors(model, dtype=dtype))
        if not info.is_main:
            return None
        odd = [n for n, t in tensors if t.dtype != dtype]
        if odd:
            raise WeightSyncError(f"tensor sync sends one dtype ({dtype}); {odd[:3]} differ")
        flat = torch.empty(sum(t.numel() for _, t in tensors), dtype=dtype, device=tensors[0][1].device)
        if flat.device.type == "cpu":  # CPU tensors travel as shared-memory files any process can open
            torch.multiprocessing.set_sharing_strategy("file_system")
            flat.share_memory_()
        named, offset = [], 0
        for name, t in tensors:
            view = flat[offset:offset + t.numel()]
            view.copy_(t.reshape(-1))
            named.append((name, view.view(t.shape)))
            offset += t.numel()
        if flat.device.type == "cuda":
            torch.cuda.synchronize(flat.device)
        buf = io.BytesIO()
        ForkingPickler(buf).dump(named)
        self._held = (flat, named)
        return base64.b64encode(buf.getvalue()).decode("ascii")

    def send(self, engines: list[str], version: int, staged: str | None, updated: list[str], *,
             flush_cache: bool = True) -> None:
        """Each engine in a weight-update session where its release has them (SGLang 0.5.23), with one
        payload per TP rank (each rank opens ``serialized_named_tensors[tp_rank]``)."""
        for url in engines:
            if url in updated:
                continue
            ops = self.ops(url)
            if not isinstance(ops, SGLangOps):
                raise WeightSyncError(f"tensor pushes speak SGLang's /update_weights_from_tensor; {url} is {ops.kind}")
            with _session([ops]):
                _post(self.client, f"{url}/update_weights_from_tensor",
                      {"serialized_named_tensors": ops.tensor_payloads(staged or ""), "load_format": None,
                       "flush_cache": flush_cache, "weight_version": str(version)}, timeout=600.0)
            updated.append(url)

    def committed(self, staged: str | None) -> None:
        self._held = None


@dataclass
class BroadcastSync:
    """A process group with the engines (trainer rank 0), bucketed ``/update_weights_from_distributed``."""

    client: httpx.Client
    bucket_bytes: int
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    backend: str = "gloo"
    group_name: str = "weight_update_group"
    timeout_s: float = 120.0
    engine_kind: str = "sglang"  # sglang | vllm | auto: vLLM engines are refused (not implemented)

    def __post_init__(self) -> None:
        self.group = None
        self._engines: list[str] = []
        # each connect forms its group under a fresh name (``group_name`` + a random suffix): a group left
        # registered by a trainer that died (on the engine) or by an earlier sync in this process (here)
        # would otherwise refuse the name
        self._name = self.group_name
        self._kinds = EngineSet(self.client, self.engine_kind)

    def _ops(self, url: str) -> SGLangOps:
        ops = self._kinds(url)
        assert isinstance(ops, SGLangOps)  # connect refused every other kind
        return ops

    def _tp_size(self, url: str) -> int:
        """Ranks the engine takes in the group: SGLang joins every TP worker, as ``rank_offset + tp_rank``."""
        return self._ops(url).dialect().tp_size

    def disconnect(self) -> None:
        """Drop the group on both sides (so that its name can be used again by the next ``connect``)."""
        from agentrl.weight_group import destroy_weight_group

        if self.group is not None:
            destroy_weight_group(self.group)
            self.group = None
        for url in self._engines:
            try:
                _post(self.client, f"{url}/destroy_weights_update_group", {"group_name": self._name},
                      timeout=30.0)
            except WeightSyncError as exc:  # an engine that restarted has no group; one that is gone, neither
                log.info("destroy_weights_update_group on %s: %s", url, exc)
        self._engines = []

    def connect(self, engines: list[str]) -> None:
        """Rank 0 only: form the group with every engine. The trainer is rank 0; engine ``i`` takes
        ``tp_size`` ranks from ``rank_offset`` (1 + the ranks of the engines before it)."""
        if any(self._kinds(url).kind == "vllm" for url in engines):
            raise WeightSyncError("broadcast pushes to vLLM are not implemented (vLLM's NCCL weight transfer needs "
                                  "its own process group on the trainer); use --sync-mode disk")
        from agentrl.weight_group import init_weight_group

        self.disconnect()
        self._name = f"{self.group_name}-{secrets.token_hex(4)}"
        port = self.master_port or free_port("")  # any interface: the engines may connect from other hosts
        offsets, world = [], 1
        for url in engines:
            offsets.append(world)
            world += self._tp_size(url)
        errors: list[str] = []

        def join(url: str, rank_offset: int) -> None:
            try:
                _post(self.client, f"{url}/init_weights_update_group",
                      {"master_address": self.master_addr, "master_port": port, "rank_offset": rank_offset,
                       "world_size": world, "group_name": self._name, "backend": self.backend},
                      timeout=self.timeout_s)
            except WeightSyncError as exc:
                errors.append(str(exc))

        threads = [threading.Thread(target=join, args=(u, o), daemon=True) for u, o in zip(engines, offsets)]
        for t in threads:
            t.start()
        try:
            self.group = init_weight_group(master_address=self.master_addr, master_port=port, rank=0,
                                           world_size=world, backend=self.backend, group_name=self._name,
                                           timeout_s=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/DistBackendError; report with the engines' side
            for t in threads:
                t.join(timeout=5)
            self._engines = list(engines)
            self.disconnect()
            raise WeightSyncError(f"cannot form the weight-update group: {exc!r}; engines said: {errors}") from exc
        for t in threads:
            t.join(timeout=self.timeout_s)
        self._engines = list(engines)
        if errors:
            self.disconnect()
            raise WeightSyncError(f"engines refused /init_weights_update_group: {errors}")

    def stage(self, model: torch.nn.Module, version: int, info: DistInfo) -> None:
        return None

    def send_all(self, model: torch.nn.Module, engines: list[str], version: int, info: DistInfo, *,
                 flush_cache: bool = True) -> str | None:
        """Collective over the trainer ranks: gather buckets; rank 0 broadcasts them. Rank 0's error or None."""
        from agentrl.weight_group import broadcast_flat

        error: str | None = None
        if info.is_main and (self.group is None or self._engines != engines):
            try:
                self.connect(engines)
            except WeightSyncError as exc:
                error = str(exc)
        error = broadcast_object(error, info)
        if error:
            return error
        opened: list[SGLangOps] = []  # weight-update sessions (SGLang 0.5.23 refuses pushes outside one)
        if info.is_main:
            try:
                for url in engines:
                    self._ops(url).begin_weight_update()
                    opened.append(self._ops(url))
            except EngineOpsError as exc:
                error = f"cannot open a weight-update session: {exc}"  # the gathers below still run on every rank
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in iter_full_tensors(model, dtype=served_dtype(model)):
            if not info.is_main:
                continue
            bucket.append((name, tensor.to(device)))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                error = error or self._send_bucket(bucket, engines, version, broadcast_flat, flush_cache)
                bucket, size = [], 0
        if info.is_main and bucket:
            error = error or self._send_bucket(bucket, engines, version, broadcast_flat, flush_cache)
        for ops in opened:  # closed also after a failed bucket: an open session refuses the next begin
            try:
                ops.end_weight_update()
            except EngineOpsError as exc:
                error = error or f"cannot close the weight-update session: {exc}"
        return error

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], engines: list[str], version: int,
                     broadcast: Callable, flush_cache: bool = True) -> str | None:
        """One ``/update_weights_from_distributed`` per engine and ONE broadcast of the bucket's tensors
        flattened to bytes (SGLang's ``flattened_bucket`` load format)."""
        from agentrl.weight_group import FLATTENED_BUCKET, flatten

        body = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": self._name,
                "weight_version": str(version), "flush_cache": flush_cache, "load_format": FLATTENED_BUCKET}
        flat = flatten([t for _, t in bucket])
        errors: list[str] = []

        def call(url: str) -> None:
            try:
                _post(self.client, f"{url}/update_weights_from_distributed", body, timeout=self.timeout_s)
            except WeightSyncError as exc:
                errors.append(str(exc))

        threads = [threading.Thread(target=call, args=(u,), daemon=True) for u in engines]
        for t in threads:
            t.start()
        try:
            broadcast(self.group, flat, 0)
        except Exception as exc:  # noqa: BLE001 - a broken group (engine gone, timeout) must stop this push
            errors.append(f"broadcast failed: {exc!r}")
        for t in threads:
            t.join(timeout=self.timeout_s)
        if errors:
            self.disconnect()  # the next attempt forms a fresh group
            return "; ".join(errors)
        return None


@contextmanager
def _session(engines: list[SGLangOps]) -> Iterator[None]:
    """Weight-update sessions on ``engines`` around a push (SGLang 0.5.23; a no-op for releases without
    them), closed also when the push fails: an open session refuses the next begin."""
    opened: list[SGLangOps] = []
    try:
        for ops in engines:
            ops_call(ops.begin_weight_update)
            opened.append(ops)
        yield
    except BaseException:
        for ops in opened:
            try:
                ops.end_weight_update()
            except EngineOpsError as exc:
                log.warning("closing the weight-update session on %s failed: %s", ops.url, exc)
        raise
    for ops in opened:
        ops_call(ops.end_weight_update)


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's ``obj`` on every rank (no-op for one process)."""
    if info.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ------------------------------------------------------------------------------------------- the push


@dataclass
class PushResult:
    version: int
    seconds: float  # the whole push: staging, pause, update, resume
    bytes: int
    attempts: int
    paused_s: float = 0.0  # of which generation was paused (disk mode stages before pausing)
    # engines that kept a prefix cache computed under the old weights (a direct push whose flush SGLang
    # 0.5.19 refused because retracted requests were waiting; DirectControl.stale_cache)
    stale_cache_engines: int = 0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def relabel_version(version: int, *, info: DistInfo, control: Control, client: httpx.Client,
                    engine_kind: str = "auto") -> None:
    """A skipped step (nothing to learn): the served weights stay, but every engine now reports ``version``
    (``POST /update_weight_version``, SGLang's and vLLM's route), so the tokens it generates from now on are
    tagged with the trainer's version and not held back as stale; then the gateway announces it."""
    if not info.is_main:
        return
    ops = EngineSet(client, engine_kind)
    for url in control.engines():
        ops_call(ops(url).set_version, version)
    control.resume(version)


@contextmanager
def engines_released(tags: list[str], version: int, *, info: DistInfo, control: Control | None,
                     client: httpx.Client, engine_kind: str = "auto") -> Iterator[dict[str, float]]:
    """Collective: around a train step, pause generation and ask every engine to free the memory of ``tags``
    (SGLang's ``/release_memory_occupation``: the KV cache, the weights), so that the trainer has the GPU; on
    exit take it back (``/resume_memory_occupation``), generation still paused until the weight push resumes
    it. If the step fails, generation resumes on ``version`` (the served weights). Yields the timings
    (``engine/release_s``, ``engine/resume_memory_s``), filled on rank 0. No tags: does nothing."""
    timings: dict[str, float] = {}
    if not tags or control is None:
        yield timings
        return
    ops = EngineSet(client, engine_kind)
    engines: list[str] = []
    error: str | None = None
    if info.is_main:
        started = time.perf_counter()
        try:
            engines = control.engines()
            control.pause()
            for url in engines:
                ops_call(ops(url).release_memory, tags)
        except WeightSyncError as exc:
            error = f"cannot release the engines' memory {tags}: {exc}"
            _resume_memory(ops, engines, tags)
            _resume_quietly(control, version)
        timings["engine/release_s"] = time.perf_counter() - started
    error = broadcast_object(error, info)
    if error:
        raise WeightSyncError(error)
    failed = True
    try:
        yield timings
        failed = False
    finally:
        if info.is_main:
            started = time.perf_counter()
            error = _resume_memory(ops, engines, tags)
            timings["engine/resume_memory_s"] = time.perf_counter() - started
            if failed or error:
                _resume_quietly(control, version)
        error = broadcast_object(error, info)
    if error:
        raise WeightSyncError(f"cannot take the engines' memory back: {error}")


def _resume_memory(ops: EngineSet, engines: list[str], tags: list[str]) -> str | None:
    """Every engine, even after one fails; the first error or None."""
    errors = []
    for url in engines:
        try:
            ops_call(ops(url).resume_memory, tags)
        except WeightSyncError as exc:
            errors.append(str(exc))
    return errors[0] if errors else None


def _resume_quietly(control: Control, version: int) -> None:
    try:
        control.resume(version)
    except WeightSyncError as exc:
        log.error("could not resume generation on version %d: %s", version, exc)


def paused_push(what: str, version: int, *, info: DistInfo, control: Control,
                send: Callable[[list[str], list[str]], str | None],
                rollback: Callable[[list[str]], None] | None = None, retries: int = 3,
                backoff_s: float = 1.0) -> tuple[int, float]:
    """Collective: the pause -> update -> resume of every push (full weights here, the adapter in
    :mod:`trainer.lora_push`). Returns ``(attempts, paused_s)``.

    Rank 0 lists the engines and pauses generation; then ``send(engines, touched)`` runs on every rank (a
    broadcast push is a collective; other transports act on rank 0 only) and returns rank 0's error or None,
    appending to ``touched`` each engine it changed. It is retried up to ``retries`` times. After the last
    failure ``rollback(touched)`` puts the old weights back on rank 0, generation resumes on ``version - 1``
    and every rank raises the same :class:`WeightSyncError`; after a success it resumes on ``version``."""
    error: str | None = None
    engines: list[str] = []
    paused_at = time.perf_counter()
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
            error = broadcast_object(send(engines, touched), info)
            if error is None:
                break
            log.warning("%s push v%d attempt %d/%d failed: %s", what, version, attempts, retries, error)
            if attempts < retries:
                time.sleep(backoff_s * attempts)
    finally:
        if info.is_main:
            if error is not None and touched and rollback is not None:
                rollback(touched)
            try:
                control.resume(version if error is None else version - 1)
            except WeightSyncError as exc:
                error = error or f"{what} pushed but generation could not be resumed: {exc}"
        paused_s = time.perf_counter() - paused_at
        error = broadcast_object(error, info)
    if error is not None:
        raise WeightSyncError(
            f"{what} push of version {version} failed after {attempts} attempt(s): {error}. The engines keep "
            f"serving version {version - 1}; the current batch was not acknowledged."
        )
    return attempts, paused_s


def on_main(info: DistInfo, fn: Callable[[], None]) -> str | None:
    """``fn()`` on rank 0; its WeightSyncError as text (None on success and on the other ranks)."""
    if not info.is_main:
        return None
    try:
        fn()
    except WeightSyncError as exc:
        return str(exc)
    return None


def push_weights(model: torch.nn.Module, version: int, *, info: DistInfo,
                 transport: DiskSync | BroadcastSync | TensorSync,
                 control: Control, retries: int = 3, backoff_s: float = 1.0) -> PushResult:
    """Collective: pause generation, send ``model``'s weights as ``version``, resume. Raises WeightSyncError.

    On failure after ``retries`` attempts, engines that took the update are rolled back (disk mode),
    generation resumes on ``version - 1`` and every rank raises the same WeightSyncError (:func:`paused_push`).
    """
    start = time.perf_counter()
    staged = None
    if isinstance(transport, (DiskSync, TensorSync)):  # gather, cast and write while the engines still generate
        staged = transport.stage(model, version, info)
    flush = getattr(control, "flush_with_update", True)

    def send(engines: list[str], updated: list[str]) -> str | None:
        if isinstance(transport, BroadcastSync):
            return transport.send_all(model, engines, version, info, flush_cache=flush)
        return on_main(info, lambda: transport.send(engines, version, staged, updated, flush_cache=flush))

    def rollback(updated: list[str]) -> None:
        if isinstance(transport, DiskSync):
            transport.rollback(updated, version - 1, flush_cache=flush)

    attempts, paused_s = paused_push("weight", version, info=info, control=control, send=send, rollback=rollback,
                                     retries=retries, backoff_s=backoff_s)
    if isinstance(transport, (DiskSync, TensorSync)) and info.is_main:
        transport.committed(staged)
    from trainer.model import weight_bytes

    stale = len(getattr(control, "stale_cache", ())) if info.is_main else 0
    if stale:
        log.warning("weight push v%d: %d engine(s) kept prefix-cache entries computed under v%d (flush refused)",
                    version, stale, version - 1)
    return PushResult(version, time.perf_counter() - start, weight_bytes(model, served_dtype(model)), attempts,
                      paused_s, stale)
