"""The training loop: lease -> drop duplicates -> train step -> push weights -> ack -> log -> checkpoint.

A batch in which every group has zero reward variance has nothing to learn (every advantage is 0): it is
reported loudly, acknowledged and counted as a step, but not trained on, pushed or checkpointed; the
gateway's weight version still advances (the weights are unchanged) so that admission keeps going. (A run
whose every step was skipped still ends with one checkpoint, of the unchanged model, for eval and resume.)
``--steps N`` runs N steps now, also when resuming from a checkpoint.

Reads top to bottom in :func:`train`; the helpers below it hold the detail. Order matters for safety: a
lease is acknowledged only after its rows were trained on **and** the new weights are being served, so a
crash or a refused weight push leaves the batch to be re-delivered (the gateway re-queues unacknowledged
leases) rather than lost; re-delivered rows already trained on are dropped by ``row_id``.
"""

from __future__ import annotations

import json
import math
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import httpx
import torch

from agentrl.trajectory import decode_batch
from trainer import checkpoint, lora, lora_push
from agentrl.settings import SettingsError
from trainer.config import RELEASE_MEMORY, TrainerSettings
from trainer.data import GatewayError, Lease, LeaseClient, SeenRows, describe_batch, drop_duplicates
from trainer.model import DistInfo, build_optimizer, init_distributed, load_model
from trainer.outage import OutageRetry
from trainer.step import train_step
from trainer.weight_sync import (BroadcastSync, DirectControl, DiskSync, GatewayControl, TensorSync, WeightSyncError,
                                 broadcast_object, engines_released, push_weights, relabel_version)

log = logging.getLogger("trainer")


def train(settings: TrainerSettings, *, http: httpx.Client | None = None) -> checkpoint.TrainerState:
    """Run GRPO until ``settings.steps`` (or forever); returns the final trainer state.

    ``http`` is the one HTTP client for the gateway and the engines (tests inject one with a mock transport).
    """
    from engine.models import resolve_model

    if not settings.gateway:
        raise SettingsError("agentrl train needs --gateway URL: batches are leased from the gateway")
    info = init_distributed(settings.device)
    torch.manual_seed(settings.seed)
    model_dir = resolve_model(settings.model)
    resume_from = checkpoint.latest(settings.checkpoint_dir) if settings.resume else None
    # a LoRA run loads the base model and the checkpoint's adapter (trainer/lora.py)
    adapter = lora.resume_adapter(resume_from, settings.lora)
    model = load_model(model_dir if settings.lora else resume_from or model_dir, dtype=settings.dtype,
                       device=info.device, compile=settings.compile, lora=settings.lora, adapter=adapter)
    optimizer = build_optimizer(model, settings, info.device)
    state = checkpoint.TrainerState()
    if resume_from is not None:
        checkpoint.load_optimizer(resume_from, model, optimizer)
        state = checkpoint.load_state(resume_from)
    seen = SeenRows.from_state(state.seen_rows)
    http = http or httpx.Client(timeout=120.0)
    # a gateway replica or an engine that is down is waited for (trainer/outage.py), not a reason to exit
    retry = OutageRetry(settings.outage_give_up_s)
    leases = LeaseClient(settings.gateway, settings.admin_key, client=http) if info.is_main else None
    control, transport = build_sync(settings, model_dir, info, http)
    # never publish a version number already used: continue above what the gateway and the engines have seen
    # (a resume from an older checkpoint, or a fresh trainer against a running system)
    seen_version = broadcast_object(retry.call("asking the gateway and engines their weight version",
                                               lambda: peer_version(settings, control, http),
                                               errors=(GatewayError,)) if info.is_main and control is not None
                                    else None, info)
    fresh_label = int(resume_from is not None or bool(settings.lora))  # the weights pushed at start are not the served ones
    if seen_version is not None and seen_version > state.version:
        log.warning("the gateway or an engine is at weight version %d, above this trainer's %d (a resume from an "
                    "older checkpoint, or a new trainer): continuing from %d so that no version number names two "
                    "weight sets", seen_version, state.version, seen_version + fresh_label)
        state.version = seen_version + fresh_label
    push = push_weights
    if settings.lora and transport is not None:  # only the adapter goes to the engines (trainer/lora_push.py)
        transport = lora_push.AdapterSync(settings.lora_name, settings.sync_mode, client=http,
                                          sync_dir=Path(settings.sync_dir or Path(settings.checkpoint_dir) / "sync"))
        push = lora_push.push_adapter
    if control is None and info.is_main:
        # Nothing is pushed, so the served weights keep their version: telling the gateway a new version
        # after each step would hold every row generated since as stale (and announce weights that do not
        # exist). The trainer therefore does not register: no version, no staleness budget from it.
        log.warning("--sync-mode none: weights are never pushed; the gateway's weight version and staleness "
                    "budget are left alone (this trainer does not register with POST /admin/trainer)")
    announce_trainer(control, settings, state.version, info, retry=retry)
    # engines may have restarted on the base weights; a LoRA run's adapter must be there before requests name it
    if (resume_from is not None or settings.lora) and transport is not None:
        retry.call("weight push at start", lambda: push(model, state.version, info=info, transport=transport,
                                                        control=control, retries=settings.sync_retries),
                   errors=(WeightSyncError,), info=info)
    metrics_out = open_metrics(settings, info)
    idle_since = explained_at = time.monotonic()
    stop_at = state.step + settings.steps if settings.steps else None  # --steps counts from here
    trained_since_save = False

    while stop_at is None or state.step < stop_at:
        lease = next_lease(leases, settings, info, retry)
        if lease is None:
            if transport is not None:  # an engine that restarted on older weights gets the current ones again
                repush_if_behind(model, state.version, push, settings, info, transport, control, http, retry)
            if settings.max_idle_s and time.monotonic() - idle_since > settings.max_idle_s:
                log.warning("no data for %.0f s; stopping", settings.max_idle_s)
                break
            explained_at = explain_wait(leases, idle_since, explained_at)
            continue
        idle_since = explained_at = time.monotonic()
        rows, dropped = drop_duplicates(lease.rows, seen)
        if not rows:  # everything was trained on already: a re-delivery after a crash before the ack
            ack(leases, lease, info, retry)
            continue

        batch = describe_batch(rows, settings.gamma_or_none)
        skipped = batch["batch/zero_variance_groups"] == batch["batch/groups"]
        if skipped:  # every advantage is 0: an optimizer step would only move weights by AdamW's momentum
            metrics = {"skipped": "zero_variance"}
            warn_zero_variance(batch, info)
            if transport is not None:  # same weights, next version: tokens are tagged as fresh, not stale
                retry.call("relabelling the weight version", lambda: relabel_version(
                    state.version + 1, info=info, control=control, client=http, engine_kind=settings.engine_kind),
                    errors=(WeightSyncError,))
        else:
            with engines_released(RELEASE_MEMORY[settings.release_memory], state.version, info=info,
                                  control=control, client=http, engine_kind=settings.engine_kind) as released:
                metrics = train_step(model, optimizer, rows, settings, info, version=state.version)
            metrics.update(released)
            if transport is not None:  # a peer that is down is waited for; the batch stays unacknowledged
                pushed = retry.call(f"weight push v{state.version + 1}", lambda: push(
                    model, state.version + 1, info=info, transport=transport, control=control,
                    retries=settings.sync_retries), errors=(WeightSyncError,), info=info)
                metrics.update({"sync/seconds": pushed.seconds, "sync/paused_s": pushed.paused_s,
                                "sync/gb_per_s": pushed.gb_per_s,
                                "sync/attempts": pushed.attempts,
                                "sync/stale_cache_engines": pushed.stale_cache_engines})
        state.version += 1
        state.step += 1
        for row in rows:
            seen.add(row.row_id)
        ack(leases, lease, info, retry)

        metrics.update({"step": state.step, "version": state.version, "batch/duplicates_dropped": dropped,
                        **batch, "gateway/gamma": (lease.meta.get("leases") or [{}])[0].get("gamma"),
                        "time": time.time()})
        announce_trainer(control, settings, state.version, info, metrics=metrics, retry=retry)
        log_metrics(metrics, metrics_out, info)
        if not skipped:
            trained_since_save = True
        if settings.save_every and state.step % settings.save_every == 0 and trained_since_save:
            save(settings, state, seen, model, optimizer, info, model_dir)
            trained_since_save = False

    # the weights changed since the newest checkpoint, or a run that learned nothing has none to hand on
    if trained_since_save or (state.step and checkpoint.latest(settings.checkpoint_dir) is None):
        save(settings, state, seen, model, optimizer, info, model_dir)
    if info.is_main and isinstance(transport, DiskSync):
        remove_sync_copies(transport.sync_dir)
    if metrics_out is not None:
        metrics_out.close()
    return state


# ------------------------------------------------------------------------------------------------ helpers


def build_sync(settings: TrainerSettings, model_dir: Path, info: DistInfo, client: httpx.Client):
    """(control, transport) for the configured sync mode; (None, None) for ``--sync-mode none``."""
    if settings.sync_mode == "none":
        return None, None
    if settings.gateway:
        control = GatewayControl(settings.gateway, settings.admin_key, client=client,
                                 engine_urls=settings.engine_urls)
    else:
        control = DirectControl(settings.engine_urls, client=client, engine_kind=settings.engine_kind)
    if settings.sync_mode == "disk":
        # absolute: the engines resolve model_path against their own working directory
        sync_dir = Path(settings.sync_dir or Path(settings.checkpoint_dir) / "sync").resolve()
        return control, DiskSync(sync_dir=sync_dir, source_dir=model_dir, client=client,
                                 engine_kind=settings.engine_kind)
    if settings.sync_mode == "tensor":
        return control, TensorSync(client=client)
    backend = "nccl" if info.device.type == "cuda" else "gloo"
    return control, BroadcastSync(client=client, bucket_bytes=int(settings.sync_bucket_mb * 2**20),
                                  master_addr=settings.sync_master_addr, master_port=settings.sync_master_port,
                                  backend=backend, engine_kind=settings.engine_kind)


WAIT_EXPLAIN_S = 60.0


def explain_wait(leases: LeaseClient | None, idle_since: float, explained_at: float) -> float:
    """After each minute without data, log the gateway's account of why (groups open, ready, budget)."""
    now = time.monotonic()
    if leases is None or now - explained_at < WAIT_EXPLAIN_S:
        return explained_at
    log.warning("no data for %.0f s: %s", now - idle_since, leases.why_waiting())
    return now


def announce_trainer(control: Any, settings: TrainerSettings, version: int, info: DistInfo,
                     metrics: dict[str, Any] | None = None, retry: OutageRetry | None = None) -> None:
    """Tell the gateway the trainer's version, batch size, staleness bound and group size (admission), and
    after a step that step's numeric metrics (the gateway's trainer page charts them)."""
    if info.is_main and isinstance(control, GatewayControl):
        numbers = {k: float(v) for k, v in (metrics or {}).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        def register() -> None:
            control.register_trainer(version, settings.batch_groups, settings.staleness_bound, settings.group_size,
                                     metrics=numbers or None)

        if retry is None:
            register()
        else:
            retry.call("registering with the gateway (POST /admin/trainer)", register, errors=(WeightSyncError,))


def peer_version(settings: TrainerSettings, control: Any, client: httpx.Client) -> int:
    """The highest weight version the gateway or an engine reports (0 if none says): the gateway's served
    version (``GET /admin/weight_version``), its registered trainer's (``GET /v1/trajectories/stats``), and
    each engine's (``/model_info``, ``/get_model_info`` or vLLM's ``/weight_info``). A peer that cannot be
    reached raises GatewayError (the caller waits for it); one that answers without a version counts 0."""
    versions = [0]
    headers = {"Authorization": f"Bearer {settings.admin_key}"}
    urls: list[str] = []
    if isinstance(control, GatewayControl):
        base = settings.gateway.rstrip("/")
        for path, pick in (("/admin/weight_version", lambda d: d.get("weight_version")),
                           ("/v1/trajectories/stats", lambda d: (d.get("trainer") or {}).get("version"))):
            versions.append(_version_of(client, base + path, headers, pick))
        try:
            urls = control.engines()
        except WeightSyncError as exc:
            raise GatewayError(str(exc)) from exc
    else:
        urls = list(control.engines())
    for url in urls:
        try:
            versions.append(engine_version(client, url))
        except GatewayError:
            if len(urls) == 1:  # an engine that is down has no say, unless it is the only one
                raise
    return max(versions)


_VERSION_ROUTES = ("/model_info", "/get_model_info", "/weight_info")  # SGLang >= 0.5.23 and ours, 0.5.19, vLLM
_version_route: dict[str, str] = {}  # engine URL -> the route that answered with a version


def engine_version(client: httpx.Client, url: str) -> int:
    """The weight version ``url`` reports (-1 if none); raises GatewayError if it cannot be reached."""
    url = url.rstrip("/")
    known = _version_route.get(url)
    for path in ([known] if known else []) + [p for p in _VERSION_ROUTES if p != known]:
        got = _version_of(client, url + path, {}, lambda d: d.get("weight_version"))
        if got >= 0:
            _version_route[url] = path
            return got
    return -1


def repush_if_behind(model: torch.nn.Module, version: int, push: Any, settings: TrainerSettings, info: DistInfo,
                     transport: Any, control: Any, client: httpx.Client, retry: OutageRetry) -> bool:
    """Collective, while waiting for data: if an engine reports a weight version below ``version`` (it
    restarted and serves its base weights as 0, say), push this trainer's weights again as ``version``
    (the same weights that number names). The gateway keeps such an engine out of rotation while another
    serves the current version, and in rotation when none does: then no fresh data comes until this push.
    Engines that cannot be reached have no say. Returns whether it pushed."""
    behind: list[str] = []
    if info.is_main and version > 0:
        try:
            urls = control.engines()
        except WeightSyncError:
            urls = []
        for url in urls:
            try:
                got = engine_version(client, url)
            except GatewayError:
                continue
            if 0 <= got < version:
                behind.append(f"{url} (v{got})")
    behind = broadcast_object(behind, info)
    if not behind:
        return False
    if info.is_main:
        log.warning("engine(s) %s serve a version below %d (restarted?): pushing the current weights again",
                    ", ".join(behind), version)
    retry.call(f"weight push v{version} again", lambda: push(model, version, info=info, transport=transport,
                                                             control=control, retries=settings.sync_retries),
               errors=(WeightSyncError,), info=info)
    return True


def _version_of(client: httpx.Client, url: str, headers: dict[str, str], pick: Any) -> int:
    """The version ``pick`` finds in ``url``'s JSON; -1 for a route that does not exist or carries none."""
    try:
        resp = client.get(url, headers=headers, timeout=30.0)
    except httpx.HTTPError as exc:
        raise GatewayError(f"cannot read the weight version at {url}: {exc!r}") from exc
    if resp.status_code in (502, 503, 504):
        raise GatewayError(f"GET {url} answered {resp.status_code}")
    if resp.status_code != 200:
        return -1
    try:
        value = pick(resp.json())
        return int(value) if value is not None else -1
    except (ValueError, TypeError, AttributeError):
        return -1


def warn_zero_variance(batch: dict[str, Any], info: DistInfo) -> None:
    if info.is_main:
        rewards = sorted({g["reward_min"] for g in batch["batch/reward_spread"]})
        log.warning(
            "NOTHING TO LEARN: all %d groups of this batch have zero reward variance (group rewards %s); "
            "step skipped: no optimizer step, no weight push, no checkpoint. Make the task easier or "
            "harder, raise the sampling temperature or the group size, or check the reward function.",
            batch["batch/groups"], rewards[:8])


def next_lease(leases: LeaseClient | None, settings: TrainerSettings, info: DistInfo,
               retry: OutageRetry | None = None) -> Lease | None:
    """Rank 0 leases up to ``batch_groups`` groups; every rank gets the same rows (bytes broadcast).

    Leases are taken until the batch is full or a wait of ``lease_wait_s`` brings nothing more; a partial
    batch is trained on rather than held (its groups would otherwise go stale).
    """
    payload: Any = None
    if info.is_main and leases is not None:
        try:
            payload = _lease_batch(leases, settings, retry)
        except GatewayError as exc:  # every rank must stop, not only rank 0
            payload = exc
    payload = broadcast_object(payload, info)
    if isinstance(payload, GatewayError):
        raise payload
    if payload is None:
        return None
    parts = [decode_batch(raw) for raw, _ in payload]
    return Lease(lease_id=",".join(lid for _, lid in payload), rows=[r for rows, _ in parts for r in rows],
                 meta={"leases": [meta for _, meta in parts]}, lease_ids=[lid for _, lid in payload])


def _lease_batch(leases: LeaseClient, settings: TrainerSettings,
                 retry: OutageRetry | None = None) -> list[tuple[bytes, str]] | None:
    got: list[tuple[bytes, str]] = []
    groups: set[str] = set()
    while len(groups) < settings.batch_groups:
        want = settings.batch_groups - len(groups)
        if retry is None:
            lease = leases.lease(want, settings.lease_wait_s)
        else:
            lease = retry.call("leasing trajectories (GET /v1/trajectories)",
                               lambda: leases.lease(want, settings.lease_wait_s), errors=(GatewayError,))
        if lease is None:
            break
        got.append((lease.raw, lease.lease_id))
        groups |= {r.grpo_group for r in lease.rows}
    return got or None


def ack(leases: LeaseClient | None, lease: Lease, info: DistInfo, retry: OutageRetry | None = None) -> None:
    """Acknowledge the batch's leases (a gateway that is down is waited for). A refused ack (e.g. the lease
    expired during a long step) is only logged: the rows were trained on, and if the gateway re-delivers
    them they are dropped as duplicates."""
    if info.is_main and leases is not None:
        for lease_id in lease.lease_ids:
            try:
                if retry is None:
                    leases.ack(lease_id)
                else:
                    retry.call(f"acknowledging lease {lease_id}", lambda: leases.ack(lease_id),
                               errors=(GatewayError,))
            except GatewayError as exc:
                log.warning("%s; its rows will be dropped as duplicates if they come back", exc)


def save(settings: TrainerSettings, state: checkpoint.TrainerState, seen: SeenRows, model: torch.nn.Module,
         optimizer: torch.optim.Optimizer, info: DistInfo, model_dir: Path) -> Path:
    state.seen_rows = seen.state()
    path = checkpoint.save(settings.checkpoint_dir, state, model, optimizer if settings.save_optimizer else None,
                           info, source_dir=model_dir, keep=settings.keep_checkpoints)
    if info.is_main:
        print(f"[trainer] checkpoint step {state.step} version {state.version} -> {path}", file=sys.stderr, flush=True)
    return path


def remove_sync_copies(sync_dir: Path) -> None:
    """At the end of a run, the disk pushes' copies (``v<N>``, a model's weights each) go: the engines
    loaded them and the final checkpoint holds the same weights (a 3-step run of 2026-12-04 left 2 x 517 MB)."""
    for copy in Path(sync_dir).glob("v*"):
        shutil.rmtree(copy, ignore_errors=True)


def open_metrics(settings: TrainerSettings, info: DistInfo) -> TextIO | None:
    if not info.is_main:
        return None
    path = Path(settings.checkpoint_dir) / "metrics.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a", buffering=1)


def log_metrics(metrics: dict[str, Any], out: TextIO | None, info: DistInfo) -> None:
    """One JSON line per step in ``metrics.jsonl`` and one progress line on stderr (rank 0)."""
    if not info.is_main:
        return
    if out is not None:
        out.write(json.dumps(metrics) + "\n")
    if metrics.get("skipped"):
        print(f"[trainer] step {metrics['step']} v{metrics['version']} SKIPPED ({metrics['skipped']}): "
              f"{metrics['batch/groups']} groups, {metrics['batch/sessions']} sessions, nothing to learn",
              file=sys.stderr, flush=True)
        return
    print(
        f"[trainer] step {metrics['step']} v{metrics['version']} reward {metrics['reward/mean']:.3f} "
        f"loss {metrics['actor/loss']:+.2e} clip {metrics['actor/clip_frac']:.3f} "
        f"ent {metrics['actor/entropy']:.3f} gap {metrics['logprob_gap/mean']:.2e} "
        f"rows {int(metrics['batch/rows'])} tok/s {metrics['perf/tokens_per_s']:.0f}"
        + (f" sync {metrics['sync/seconds']:.2f}s" if "sync/seconds" in metrics else ""),
        file=sys.stderr, flush=True,
    )
