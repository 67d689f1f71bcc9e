"""One control plane for every gateway replica: whether generation is paused, and the weight version.

The trainer pauses, pushes weights and resumes through ONE replica (``POST /admin/pause``,
``POST /admin/resume``). Without Redis that replica is the whole gateway and the state lives in its
:class:`gateway.engine_client.EngineRouter`. With Redis every replica must pause, hold, resume and tag alike,
so the state also lives in Redis:

- hash ``<prefix>control``: ``version``, ``paused`` (0/1), ``epoch`` (bumped by every pause and resume),
  ``deadline`` (unix time after which a pause lapses), ``mode``;
- channel ``<prefix>control``: each change as JSON ``{op, epoch, version, mode, deadline, origin}``.

Every replica subscribes and applies the changes of the others to its own router (pausing its engines,
continuing them); a replica that starts, or whose subscription broke, reads the hash and catches up. A
replica that sees an engine abort a generation it did not ask for checks the hash before calling it an
error (the pause message may still be on its way).

A pause cannot outlive its trainer: it carries a deadline (``--pause-timeout-s``). When it passes with no
resume, the replica that notices resumes generation at the current version, logs a warning and counts
``agentrl_gateway_pause_expired_total``. Resume is idempotent: resuming a running gateway only sets the
version (and continues engines that still owe it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from redis.exceptions import RedisError

from gateway.engine_client import EngineRouter
from gateway.errors import StoreUnavailable
from gateway.metrics import Metrics

log = logging.getLogger("agentrl.gateway.control")


class ControlPlane:
    """Pause state and weight version of this replica, shared with the others through Redis if given."""

    def __init__(self, router: EngineRouter, metrics: Metrics, *, redis: Any | None = None,
                 prefix: str = "agentrl:", pause_timeout_s: float = 600.0) -> None:
        self.router = router
        self.metrics = metrics
        self.redis = redis
        self.key = f"{prefix}control"
        self.pause_timeout_s = pause_timeout_s
        self.origin = uuid.uuid4().hex  # this replica, so that it skips its own messages
        self.deadline: float | None = None  # unix time after which the current pause lapses
        self.epoch = 0  # the last shared change applied here
        self.expired = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._lock = asyncio.Lock()  # one change at a time, local or from another replica

    # ------------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Adopt the shared state (or publish ours if there is none) and follow the other replicas."""
        if self.redis is not None:
            await self.redis.hsetnx(self.key, "version", self.router.weight_version)
            await self._catch_up()
            self._tasks.append(asyncio.create_task(self._follow(), name="control-follow"))
        self.router.pause_check = self._paused_elsewhere
        self._tasks.append(asyncio.create_task(self._watchdog(), name="control-watchdog"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    # ------------------------------------------------------------------------------------ commands
    async def pause(self, mode: str = "abort") -> None:
        """Pause generation here and (through Redis) on every replica, until resume or the deadline."""
        deadline = time.time() + self.pause_timeout_s
        async with self._lock:
            self.deadline = deadline
            await self._publish({"op": "pause", "mode": mode, "deadline": deadline})
            await self.router.pause(mode)

    async def resume(self, version: int) -> None:
        """Set the weight version and resume generation here and on every replica (idempotent)."""
        async with self._lock:
            try:
                await self._publish({"op": "resume", "version": version})
            finally:  # this replica resumes even when Redis is down; the others follow on catch-up
                self.deadline = None
                await self.router.resume(version)
                self.metrics.weight_version.set(version)

    async def _publish(self, change: dict[str, Any]) -> None:
        if self.redis is None:
            return
        paused = change["op"] == "pause"
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hincrby(self.key, "epoch", 1)
                fields: dict[str, Any] = {"paused": int(paused)}
                if paused:
                    fields |= {"deadline": change["deadline"], "mode": change["mode"]}
                else:
                    fields["version"] = change["version"]
                pipe.hset(self.key, mapping=fields)
                epoch = (await pipe.execute())[0]
            self.epoch = int(epoch)
            await self.redis.publish(self.key, json.dumps({**change, "epoch": self.epoch, "origin": self.origin}))
        except RedisError as exc:
            raise StoreUnavailable(f"Redis failed; the other gateway replicas were not told: {exc}") from exc

    # ------------------------------------------------------------------------------------ followers
    async def _apply(self, change: dict[str, Any]) -> None:
        """Apply another replica's change to this replica's router."""
        epoch = int(change.get("epoch") or 0)
        async with self._lock:
            if epoch and epoch <= self.epoch:
                return  # already applied (a catch-up and its message, or a message twice)
            self.epoch = max(self.epoch, epoch)
            if change["op"] == "pause":
                self.deadline = float(change.get("deadline") or time.time() + self.pause_timeout_s)
                if not self.router.paused:
                    log.info("pausing generation: another replica paused (epoch %d)", epoch)
                    try:
                        await self.router.pause(str(change.get("mode") or "abort"))
                    except Exception as exc:  # a refusal is the pausing replica's to report; we stay paused
                        log.warning("pausing this replica's engines failed: %s", exc)
            else:
                version = int(change["version"])
                self.deadline = None
                if self.router.paused or version != self.router.weight_version:
                    log.info("resuming generation at weight version %d: another replica resumed", version)
                await self.router.resume(version)
                self.metrics.weight_version.set(version)

    async def _catch_up(self) -> None:
        assert self.redis is not None
        state = {k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v
                 for k, v in (await self.redis.hgetall(self.key)).items()}
        epoch = int(state.get("epoch") or 0)
        if state.get("paused") == "1":
            await self._apply({"op": "pause", "epoch": epoch, "mode": state.get("mode"),
                               "deadline": state.get("deadline")})
        elif "version" in state:
            await self._apply({"op": "resume", "epoch": epoch, "version": state["version"]})

    async def _follow(self) -> None:
        """Apply the other replicas' changes as they are published; reconnect and catch up after a loss."""
        assert self.redis is not None
        backoff = 0.2
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(self.key)
                await self._catch_up()  # what was published before the subscription took
                backoff = 0.2
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    change = json.loads(message["data"])
                    if change.get("origin") != self.origin:
                        await self._apply(change)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, ValueError) as exc:
                log.warning("control plane: following the other replicas failed (%s); retrying", exc)
            finally:
                try:
                    await pubsub.aclose()
                except (RedisError, OSError):
                    pass
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _paused_elsewhere(self) -> bool:
        """Asked by the router when an engine aborts a generation this replica did not pause: True (and
        paused here) if another replica paused; its message may not have arrived yet."""
        if self.router.paused:
            return True
        if self.redis is None:
            return False
        try:
            await self._catch_up()
        except RedisError as exc:
            log.warning("control plane: cannot read the shared pause state: %s", exc)
            return False
        return self.router.paused

    # ------------------------------------------------------------------------------------ deadline
    async def _watchdog(self) -> None:
        period = max(0.05, min(1.0, self.pause_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            deadline = self.deadline
            if self.router.paused and deadline is not None and time.time() > deadline:
                self.expired += 1
                self.metrics.pause_expired.inc()
                log.warning("generation was paused for longer than --pause-timeout-s (%.0fs) without a resume "
                            "(did the trainer die?); resuming at weight version %d", self.pause_timeout_s,
                            self.router.weight_version)
                try:
                    await self.resume(self.router.weight_version)
                except StoreUnavailable as exc:
                    log.warning("control plane: resumed here, but not shared: %s", exc)
