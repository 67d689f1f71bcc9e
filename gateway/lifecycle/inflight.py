"""The in-flight registry: which sessions have a turn running now, so that no lifecycle decision (idle
finish, group timeout, export) cuts a turn off. On the hot path: every turn enters it."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from redis.exceptions import RedisError

from gateway import errors
from gateway.store import Marker

log = logging.getLogger("agentrl.gateway.lifecycle")


class InFlight:
    """Turns in flight per session, so that lifecycle decisions never cut a turn off.

    The generation path wraps each engine call in ``async with inflight.track(session_id)``. With Redis,
    entries are shared between replicas: a sorted set per session whose members are scored by expiry. The
    expiry is short (``ttl_s``, 30 s) and this replica pushes it forward every ``ttl_s / 3`` while the turn
    runs (:meth:`refresh`, run by the lifecycle loop's companion task), so the markers of a replica that
    was killed (kill -9, OOM) lapse within ``ttl_s`` and its sessions are idle-finished and exported as
    usual. Without Redis they live in this process (and die with it).

    An implicit-mode turn has its marker added by the script that finds its episode
    (``Store.find_continued`` with :meth:`marker`) and takes it over with :meth:`adopt`.

    A turn that is recorded has its marker removed in the same Redis round trip as the publish that
    follows its commit (:meth:`releases`, then :meth:`released`): from the commit on, the session's last
    activity keeps it from being idle-finished, so the marker has done its job, and the turn sends Redis
    no command of its own for it. A turn that ends without a commit (an error, a client gone) has its
    marker removed after it, off its path. This replica's :meth:`busy` first waits for the removals
    started before it asks, so it never counts a turn that has ended here; another replica may see one in
    flight a moment longer (:meth:`settle` waits for the removals started so far).

    Redis down: starting a turn fails with ``StoreUnavailable`` (503, nothing recorded yet); ending one
    never fails (the turn is already recorded; its marker lapses by itself)."""

    def __init__(self, redis: Any | None = None, *, prefix: str = "agentrl:", ttl_s: float = 30.0) -> None:
        self.redis = redis
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._local: dict[str, int] = defaultdict(int)
        self._members: dict[str, str] = {}  # Redis member -> session id, for the turns of this replica
        self._removals: set[asyncio.Task[None]] = set()
        self._refresher: asyncio.Task[None] | None = None

    def _key(self, session_id: str) -> str:
        return f"{self.prefix}inflight:{session_id}"

    def _key_ttl(self) -> int:
        return int(self.ttl_s * 4) + 1

    def marker(self) -> Marker | None:
        """A new marker for ``Store.find_continued`` to add (None without Redis)."""
        if self.redis is None:
            return None
        return Marker(self._key(""), uuid.uuid4().hex, time.time() + self.ttl_s, self._key_ttl())

    @asynccontextmanager
    async def track(self, session_id: str) -> AsyncIterator[str | None]:
        """Add a marker for a turn of ``session_id`` and hold it until the block ends; yields the marker's
        Redis member (None without Redis)."""
        marker = self.marker()
        if marker is not None:
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.zadd(marker.key_prefix + session_id, {marker.member: marker.expiry})
                    pipe.expire(marker.key_prefix + session_id, marker.key_ttl_s)
                    await pipe.execute()
            except RedisError as exc:
                raise errors.StoreUnavailable(f"Redis failed (in-flight marker): {exc}") from exc
        async with self.adopt(session_id, marker.member if marker is not None else None) as member:
            yield member

    @asynccontextmanager
    async def adopt(self, session_id: str, member: str | None) -> AsyncIterator[str | None]:
        """Track a turn whose Redis marker ``member`` is already set (None: without Redis); yields it."""
        if member is not None:
            self._members[member] = session_id
            self._start_refresher()
        self._local[session_id] += 1
        try:
            yield member
        finally:
            self._local[session_id] -= 1
            if not self._local[session_id]:
                del self._local[session_id]
            if member is not None and self._members.pop(member, None) is not None:
                self.discard(session_id, member)

    def releases(self, members: Sequence[str]) -> list[tuple[str, str]]:
        """The Redis ``(key, member)`` of the markers among ``members`` that this replica still holds, for
        the after-commit publish to remove (``Store.record_interactions(release=...)``)."""
        if self.redis is None:
            return []
        return [(self._key(self._members[m]), m) for m in members if m in self._members]

    def released(self, members: Sequence[str]) -> None:
        """The commit that carried these markers' removal went through: the turn no longer holds them (so
        it does not remove them again when it ends). Should Redis have failed that publish, they lapse
        within ``ttl_s`` as the markers of a dead replica do."""
        for m in members:
            self._members.pop(m, None)

    def discard(self, session_id: str, member: str) -> None:
        """Remove a marker in the background (a turn ended, or a marker set for a turn that went elsewhere)."""
        if self.redis is None:
            return
        task = asyncio.ensure_future(self._remove(session_id, member))
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    async def _remove(self, session_id: str, member: str) -> None:
        try:
            await self.redis.zrem(self._key(session_id), member)
        except RedisError as exc:
            log.warning("in-flight marker of session %s not removed (lapses in %.0fs): %s",
                        session_id, self.ttl_s, exc)

    async def settle(self) -> None:
        """Wait until the marker removals started so far have been answered."""
        if self._removals:
            await asyncio.gather(*list(self._removals), return_exceptions=True)

    def _start_refresher(self) -> None:
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.create_task(self._refresh_loop(), name="agentrl-inflight-refresh")

    async def _refresh_loop(self) -> None:
        while self._members:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                await self.refresh()
            except RedisError as exc:
                log.warning("in-flight markers not refreshed: %s", exc)

    async def refresh(self) -> None:
        """Push the expiry of this replica's live markers forward (they lapse ``ttl_s`` after its death)."""
        if self.redis is None or not self._members:
            return
        expiry = time.time() + self.ttl_s
        async with self.redis.pipeline(transaction=False) as pipe:
            for member, session_id in list(self._members.items()):
                pipe.zadd(self._key(session_id), {member: expiry}, xx=True)
                pipe.expire(self._key(session_id), self._key_ttl())
            await pipe.execute()

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
            self._refresher = None
        await self.settle()

    async def busy(self, session_ids: Sequence[str]) -> set[str]:
        """The sessions among ``session_ids`` that have a turn in flight (on a live replica)."""
        await self.settle()
        out = {s for s in session_ids if self._local.get(s)}
        if self.redis is not None and session_ids:
            now = time.time()
            async with self.redis.pipeline(transaction=False) as pipe:
                for s in session_ids:
                    pipe.zcount(self._key(s), now, "+inf")
                counts = await pipe.execute()
            out |= {s for s, n in zip(session_ids, counts) if n}
        return out
