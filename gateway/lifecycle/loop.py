"""The export loop: from recorded sessions to queued GRPO groups, and what the trajectory routes call.

A background loop (one per gateway; with Redis, one leader among replicas and worker processes: the
process holding the lock ``<prefix>lifecycle:leader``, taken or renewed atomically at every tick, lapsing
``LEADER_TTL_MS`` after its holder stops renewing, released at shutdown) does, every ``tick_s``:

1. **Idle finish.** An active session idle for ``idle_timeout_s`` that has at least one reward (on a turn
   or on the session) and no turn in flight is finished.
2. **Readiness.** Non-eval sessions that are active or finished are grouped by ``group_id`` and cut, in
   creation order, into groups of the target size: ``metadata.group_size`` of the group's first session
   if set, else 1 for a session created without a group id (its group id is its own id), else
   ``group_size``; a group admitted as a whole (``gateway.groups``) has its own size. A group is ready when
   it is full and all of its sessions are finished with no turn in flight, or, for an admitted group that
   no session can join any more, as soon as its remaining sessions are finished (an abandoned session
   does not hold it back; ``complete: false``). A group with no activity (turn, finish, creation) for
   ``group_timeout_s`` goes out with the sessions that have finished (a smaller group,
   ``complete: false``); its still-active sessions are marked abandoned and its unused places are given
   back to the staleness budget.
   A finished session with a turn still in flight is left out of a group until that turn has ended, so
   that one slow turn never blocks the queue.
3. **Export, at least once.** The group's turn trees are exported with :mod:`agentrl.trajectory`
   (concat or individual); then one transaction marks its sessions consumed (compare-and-set from finished
   at the version read: from then on a reward for them answers 409, and no other replica exports them)
   and stages the group on the queue, which publishes it after the commit; a group staged by an exporter
   that died before publishing is published by the next upkeep's sweep. Sessions that yield no rows give
   their staleness budget back.
4. **Staleness upkeep.** Held-back stale groups are re-queued if admissible again or dropped after
   ``stale_max_age_s`` (their budget is given back).

The upkeep (the sweep of 3, step 4, and deserted groups' places) runs on every ``UPKEEP_EVERY_TICKS``-th
tick of the loop and on every tick woken by :meth:`TrajectoryService.notify`.

Eval sessions (``metadata.eval``) are never exported (they still finish on idle).

A tick reads only the groups where something can happen (``Store.lifecycle_sessions``: a finished session,
or an active one idle past the idle or group timeout, and then the whole group), never the finished history
or the busy groups: its cost follows what is ready, not how much was recorded (``bench/soak.py`` times it
at 1k and 100k finished sessions).

:class:`TrajectoryService` runs the loop and is what the routes call: lease a batch, ack, stats. It reads
the in-flight registry (:mod:`gateway.lifecycle.inflight`) and gives places back to the staleness budget
that the admission hook charges (:mod:`gateway.lifecycle.admission`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Iterable
from dataclasses import asdict
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from agentrl.trajectory import (
    FORMAT_VERSION,
    Row,
    UntrainableSampling,
    encode_batch,
    export_session,
    merge_batches,
    stable_id,
    turn_from_interaction,
)
from gateway import errors
from gateway.lifecycle.inflight import InFlight
from gateway.lifecycle.settings import ExportSettings, ExportStats
from gateway.queue import QueuedGroup, RedisQueue, SqlQueue, TrajectoryQueue, lease_meta
from gateway.staleness import StalenessControl
from gateway.store import GroupRecord, SessionRecord, Store
from gateway.store import errors as store_errors
from gateway.store.dberrors import translate

log = logging.getLogger("agentrl.gateway.lifecycle")

# The lifecycle leader lock (KEYS[1]; ARGV: holder id, ttl ms): renew it if held by ARGV[1], else take it
# if free. Returns 1 when ARGV[1] holds it afterwards.
_TAKE_OR_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def outage_of(exc: BaseException) -> str | None:
    """``"Redis"`` or ``"the database"`` when ``exc`` says that one is unavailable (a lost connection, a
    timeout, a server shutting down: what a retry later cures), else None (a bug). Redis is named when
    a Redis error is anywhere in the chain (the store raises its own StoreUnavailable from one)."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    if any(isinstance(e, (RedisConnectionError, RedisTimeoutError)) for e in chain):
        return "Redis"
    if any(isinstance(e, (store_errors.StoreUnavailable, errors.StoreUnavailable)) for e in chain):
        return "Redis" if any(isinstance(e, RedisError) for e in chain) else "the database"
    if isinstance(translate(exc), store_errors.StoreUnavailable):
        return "the database"
    return None

def target_group_size(first: SessionRecord, default: int) -> int:
    """Sessions per GRPO group, decided by a group's first session: its ``metadata.group_size`` if set,
    else 1 for a session created without a group id (its group id is its own id), else ``default``."""
    wanted = first.metadata.get("group_size") if isinstance(first.metadata, dict) else None
    if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted >= 1:
        return wanted
    return 1 if first.group_id == first.id else default


def grpo_chunks(members: list[SessionRecord], default_size: int, *,
                size: int | None = None) -> list[tuple[list[SessionRecord], int]]:
    """A group id's sessions cut, in creation order, into GRPO groups of the target size (``size`` if given:
    a group admitted as a whole): ``(chunk, size)``."""
    members = sorted(members, key=lambda s: (s.created_at, s.id))
    if not members:
        return []
    size = size or target_group_size(members[0], default_size)
    return [(members[i : i + size], size) for i in range(0, len(members), size)]


class TrajectoryService:
    """Export loop + queue + staleness: what the trajectory routes and the admin hook call."""

    LEADER_TTL_MS = 10_000
    EXPORT_CONCURRENCY = 8
    # The loop's ticks do the upkeep (deserted groups, the queue's sweep and staleness maintenance) on every
    # this-many-th tick, and on every tick woken by notify(): each of those is a few queries whose subject
    # moves on the scale of lease and group timeouts, and together they were most of an idle tick's CPU
    # (~5 of ~8.5 ms on PostgreSQL + Redis, twice a second). A direct tick() call does everything.
    UPKEEP_EVERY_TICKS = 10
    # The loop looks for idle and timed-out sessions at most this often, as a fraction of the shorter of the
    # idle and group timeouts (3 s with the defaults; every tick with timeouts of a second or less): that
    # selection passes over every idle active session in SQL (50 ms for 66,364 of them on PostgreSQL, 166 ms
    # for 79,000 under load, twice a second in the benchmark's idle gateways), and finishing a session 1 % of
    # its timeout late changes nothing. Groups with a finished session are looked at on every tick (they are
    # the export's latency).
    IDLE_SCAN_FRACTION = 0.01

    def __init__(self, store: Store, settings: ExportSettings, *, inflight: InFlight | None = None) -> None:
        settings.validate()
        self.store = store
        self.settings = settings
        self.stats = ExportStats()
        redis = store.redis
        self.inflight = inflight or InFlight(store.redis_hot, prefix=store.redis_prefix)
        self.queue: TrajectoryQueue = (
            RedisQueue(redis, prefix=store.redis_prefix, lease_timeout_s=settings.lease_timeout_s, engine=store.engine)
            if redis is not None
            else SqlQueue(store.backend, lease_timeout_s=settings.lease_timeout_s)
        )
        self.staleness = StalenessControl(store.backend, default_group_size=settings.group_size,
                                          retry_after_s=settings.retry_after_s)
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._wake = asyncio.Event()
        self._idle_scanned_at = float("-inf")
        # who holds the lock, readable by operators: host, pid, and a random part (pids are reused)
        self._leader_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.leading = False  # whether the last tick held the leader lock
        self._leader_key = f"{store.redis_prefix}lifecycle:leader"
        self.fault_points: dict[str, BaseException] = {}  # tests only: see _fault
        # the dependency whose outage the loop's ticks fail on (logged once), since when, tick_outages then
        self._outage: tuple[str, float, int] | None = None

    # ------------------------------------------------------------------------------- the loop

    def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self._run(), name="agentrl-lifecycle")

    async def stop(self) -> None:
        if self._task is not None:
            # The flag ends the loop even if a cancellation is swallowed somewhere below it (a library
            # that catches CancelledError); the cancel ends a tick that is waiting on the store.
            self._stopping = True
            self._wake.set()
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # our caller was cancelled, not (only) the loop
            self._task = None
        await self._resign()
        await self.inflight.close()
        await self.queue.close()

    def notify(self) -> None:
        """Run the loop now (e.g. after a session finished) instead of at the next tick."""
        self._wake.set()

    async def _run(self) -> None:
        ticks = 0
        while not self._stopping:
            woken = self._wake.is_set()
            try:
                await self.tick(upkeep=woken or ticks % self.UPKEEP_EVERY_TICKS == 0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the loop must outlive a database hiccup; the error is logged
                self._tick_failed(exc)
            else:
                self._tick_done()
            ticks += 1
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                # A cancellation (stop()) reached the tick and a library below swallowed it: redis-py (8.1)
                # sends each command under asyncio.wait_for (its default 5 s socket_timeout), which on
                # Python 3.11 returns normally when the task is cancelled as the send completes. Seen with
                # the queue's upkeep and the leader lock's EVAL during shutdown, after which this loop
                # waited a whole tick_s (an hour in a test) on a wake-up that the clear() below had
                # already erased. Honour it here.
                log.warning("lifecycle: a cancellation was swallowed during a tick; stopping the loop")
                raise asyncio.CancelledError
            if self._stopping:
                return
            self._wake.clear()
            # Not asyncio.wait_for: on Python 3.11 it returns normally, swallowing the cancellation, when
            # the task is cancelled in the same loop iteration as the event is set (a notify() such as
            # POST /admin/trainer's just before shutdown), and stop() then waited forever.
            # asyncio.timeout never swallows an outside cancellation.
            try:
                async with asyncio.timeout(self.settings.tick_s):
                    await self._wake.wait()
            except TimeoutError:
                pass

    def _tick_failed(self, exc: Exception) -> None:
        """Log a failed tick: a bug with its traceback every time; an outage of Redis or the database once,
        when it starts (and again if the other one fails instead), then only counted (``tick_outages``)
        until a tick succeeds. While Redis was down the loop logged a full traceback every 0.5 s tick."""
        self.stats.tick_errors += 1
        dependency = outage_of(exc)
        if dependency is None:
            log.exception("lifecycle tick failed")
            return
        self.stats.tick_outages += 1
        if self._outage is not None and self._outage[0] == dependency:
            return
        self._outage = (dependency, time.monotonic(), self.stats.tick_outages - 1)
        log.warning("lifecycle: %s is unavailable (%s: %s); ticks fail until it is back (counted in "
                    "tick_outages, logged once)", dependency, type(exc).__name__, exc)

    def _tick_done(self) -> None:
        """A tick succeeded: say so once if it ends an outage."""
        if self._outage is None:
            return
        dependency, since, before = self._outage
        self._outage = None
        log.warning("lifecycle: %s is back; %d tick(s) failed over %.1f s", dependency,
                    self.stats.tick_outages - before, time.monotonic() - since)

    async def _is_leader(self) -> bool:
        """Take or keep the leader lock: one atomic step (a holder's renewal cannot extend a lock that
        lapsed and was taken by another process in between)."""
        redis = self.store.redis
        if redis is None:
            self.leading = True
            return True
        got = await redis.eval(_TAKE_OR_RENEW, 1, self._leader_key, self._leader_id, self.LEADER_TTL_MS)
        self.leading = bool(got)
        return self.leading

    async def _resign(self) -> None:
        """Let the lock go at shutdown (if still ours), so another process leads at its next tick."""
        redis = self.store.redis
        if redis is None or not self.leading:
            return
        try:
            await redis.eval(_RELEASE, 1, self._leader_key, self._leader_id)
        except RedisError as exc:
            log.warning("lifecycle leader lock not released (it lapses in %d ms): %s", self.LEADER_TTL_MS, exc)
        self.leading = False

    async def leader(self) -> str | None:
        """The id of the process holding the leader lock (``host:pid:random``); this one's without Redis."""
        redis = self.store.redis
        if redis is None:
            return self._leader_id
        holder = await redis.get(self._leader_key)
        return holder.decode() if isinstance(holder, bytes) else holder

    async def tick(self, now: float | None = None, *, upkeep: bool = True) -> None:
        """One pass of idle finish and readiness/export, and with ``upkeep`` of deserted groups, the queue's
        sweep and staleness maintenance. Idle and timed-out sessions are looked for with ``upkeep`` and
        otherwise at most every ``IDLE_SCAN_FRACTION`` of the shorter timeout; groups with a finished
        session on every tick."""
        if not await self._is_leader():
            return
        self.stats.ticks += 1
        started = time.perf_counter()
        now = time.time() if now is None else now
        # Only groups where something can happen: a finished session, a rewarded one idle past the idle
        # timeout, or one idle past the group timeout (the rest of the live sessions, those waiting for a
        # reward included, and all of the history stay in SQL).
        s_ = self.settings
        idle = upkeep or now - self._idle_scanned_at >= self.IDLE_SCAN_FRACTION * min(s_.idle_timeout_s,
                                                                                     s_.group_timeout_s)
        if idle:
            self._idle_scanned_at = now
        live = await self.store.lifecycle_sessions(idle_before=now - s_.idle_timeout_s,
                                                   timeout_before=now - s_.group_timeout_s, idle=idle)
        busy = await self.inflight.busy([s.id for s in live])
        live = await self._finish_idle(live, now, busy)
        groups: dict[str, list[SessionRecord]] = defaultdict(list)
        for s in live:
            if not s.is_eval:
                groups[s.group_id].append(s)
        admitted = await self.store.get_groups(group_ids=list(groups))
        chunks: list[tuple[list[SessionRecord], int, GroupRecord | None]] = []
        for gid, members in groups.items():
            row = admitted.get(gid)
            chunks += [(chunk, size, row) for chunk, size in
                       grpo_chunks(members, self.settings.group_size, size=row.size if row is not None else None)]
        timed_out: list[tuple[list[SessionRecord], GroupRecord | None]] = []

        async def consider(chunk: list[SessionRecord], size: int, row: GroupRecord | None) -> None:
            if await self._consider(chunk, size, row, now, busy):
                timed_out.append((chunk, row))

        await self._overlapped(consider(chunk, size, row) for chunk, size, row in chunks)
        await self._time_out(timed_out, busy)
        if upkeep:
            await self._close_deserted(now)
            await self._upkeep()
        self.stats.last_tick_ms = (time.perf_counter() - started) * 1000

    async def _close_deserted(self, now: float) -> None:
        """Give back the unused places of groups none of whose sessions is left (all abandoned or exported
        while places were still free), once they are older than the group timeout."""
        unused = 0
        old = await self.store.open_groups(created_before=now - self.settings.group_timeout_s)
        live = await self.store.live_group_ids(group_ids=[g.id for g in old])
        for group in old:
            if group.id not in live:
                unused += await self.store.close_group(group_id=group.id, status="closed")
        if unused:
            await self.staleness.release(unused)

    async def _finish_idle(self, live: list[SessionRecord], now: float, busy: set[str]) -> list[SessionRecord]:
        """``live`` with its active sessions idle past the idle timeout, rewarded and not in flight, finished
        (in batches: ``Store.move_sessions``)."""
        idle = [s for s in live if s.status == "active" and now - s.last_activity_at >= self.settings.idle_timeout_s
                and s.id not in busy]
        # Not remembered between ticks: a session found rewarded here is finished at once, so a set of them
        # only grew (one id per idle-finished session, for the life of the process).
        rewarded = {s.id for s in idle if s.reward is not None}
        rewarded |= await self.store.rewarded(session_ids=[s.id for s in idle if s.reward is None])
        if not rewarded:
            return live
        done = {s.id: s for s in await self.store.move_sessions(session_ids=[s.id for s in idle if s.id in rewarded],
                                                                 status="finished", expected=["active"])}
        self.stats.idle_finished += len(done)
        return [done.get(s.id, s) for s in live]

    async def _consider(self, chunk: list[SessionRecord], size: int, row: GroupRecord | None, now: float,
                        busy: set[str]) -> bool:
        """Export the chunk if it is ready; True if it has timed out instead (for :meth:`_time_out`)."""
        ready = [s for s in chunk if s.status == "finished" and s.id not in busy]
        if len(chunk) == size and len(ready) == size:
            await self._export(ready, complete=True)
            return False
        # An admitted group that no session can join any more goes as soon as its live sessions are done:
        # a session abandoned early never holds the others back.
        if row is not None and row.sealed and ready and len(ready) == len(chunk):
            await self._export(ready, complete=False)
            return False
        last_activity = max(max(s.last_activity_at, s.finished_at or 0.0, s.created_at) for s in chunk)
        return now - last_activity >= self.settings.group_timeout_s

    async def _time_out(self, chunks: list[tuple[list[SessionRecord], GroupRecord | None]], busy: set[str]) -> None:
        """Groups idle past the group timeout: their active sessions not in flight are abandoned (all of
        this tick's at once, ``Store.move_sessions``: a session that finished meanwhile is left for the next
        tick), the places their groups reserved and never used are given back with the abandoned sessions'
        (one release), and what finished is exported as a partial group."""
        if not chunks:
            return
        stuck = [s.id for chunk, _ in chunks for s in chunk if s.status == "active" and s.id not in busy]
        abandoned = len(await self.store.move_sessions(session_ids=stuck, status="abandoned", expected=["active"]))
        unused = 0
        for _, row in chunks:
            if row is not None:
                unused += await self.store.close_group(group_id=row.id, status="closed")
        if abandoned or unused:
            self.stats.sessions_abandoned += abandoned
            await self.staleness.release(abandoned + unused)
        await self._overlapped(self._export(ready, complete=False) for chunk, _ in chunks
                               if (ready := [s for s in chunk if s.status == "finished" and s.id not in busy]))

    async def _overlapped(self, steps: Iterable[Awaitable[None]]) -> None:
        """Await ``steps`` (one per group: groups are independent), overlapping their store round trips,
        at most ``EXPORT_CONCURRENCY`` at a time to leave the pool to requests."""
        gate = asyncio.Semaphore(self.EXPORT_CONCURRENCY)

        async def gated(step: Awaitable[None]) -> None:
            async with gate:
                await step

        await asyncio.gather(*(gated(step) for step in steps))

    async def _export(self, sessions: list[SessionRecord], *, complete: bool) -> None:
        """Export a group at least once: its rows are built from the sessions as read, then the sessions
        are claimed (compare-and-set from finished, at the version read: a reward posted meanwhile makes the
        claim fail and the next tick re-reads) and the group is staged on the queue in ONE transaction, then
        published. A crash between the two leaves it staged, and the next tick's sweep publishes it."""
        rows: list[Row] = []
        with_rows: list[str] = []
        no_rows = 0
        s_ = self.settings
        for rec in sessions:
            try:
                turns = [turn_from_interaction(i) for i in await self.store.session_interactions(session_id=rec.id)]
                got = export_session(turns, mode=s_.export_mode, gamma=s_.gamma, reward_mode=s_.reward_mode,
                                     session_reward=rec.reward, session_id=rec.id, group_id=rec.group_id,
                                     task_id=rec.task_id)
            except UntrainableSampling as exc:
                log.error("session %s is not exported for training: %s", rec.id, exc)
                self.stats.sessions_untrainable += 1
                got = []
            except ValueError:
                log.exception("session %s has a malformed turn tree; left out of its group", rec.id)
                self.stats.sessions_failed += 1
                got = []
            if got:
                rows += got
                with_rows.append(rec.id)
            else:
                no_rows += 1
        group: QueuedGroup | None = None
        if rows:
            group_id = sessions[0].group_id
            group_key = stable_id(group_id, *sorted(with_rows))
            for row in rows:  # the trainer normalises advantages over exactly this group
                row.group_key = group_key
            versions = [r.min_version for r in rows if r.min_version >= 0]
            group = QueuedGroup(
                group_key=group_key, group_id=group_id, session_ids=with_rows,
                payload=encode_batch(rows), n_rows=len(rows), n_tokens=sum(r.num_tokens for r in rows),
                min_version=min(versions) if versions else -1, complete=complete,
            )

        async def stage(conn: Any) -> None:
            if group is not None:
                await self.queue.stage(conn, group)
            self._fault("staged")

        # The group is claimed all or nothing: a second exporter (another replica whose leadership
        # overlapped, or an overlapping tick) loses the whole group instead of taking half of it.
        try:
            await self.store.claim_sessions(
                session_ids=[s.id for s in sessions], status="consumed", expected=["finished"],
                versions={s.id: s.version for s in sessions}, then=stage)
        except (store_errors.Conflict, store_errors.NotFound):
            return  # exported by someone else, or changed meanwhile; the next tick sees the truth
        if no_rows:
            self.stats.sessions_empty += no_rows
            await self.staleness.release(no_rows)
        if group is None:
            return
        self._fault("committed")
        await self.queue.publish(group)
        self.stats.groups_exported += 1
        self.stats.groups_partial += not complete
        self.stats.rows_exported += len(rows)
        self.stats.sessions_exported += len(with_rows)

    def _fault(self, point: str) -> None:
        """Fault injection for tests: ``fault_points`` maps a point to the exception to raise there
        (``staged``: inside the claim transaction; ``committed``: after it, before publishing)."""
        exc = self.fault_points.get(point)
        if exc is not None:
            raise exc

    async def _upkeep(self) -> None:
        swept = await self.queue.sweep()
        if swept:
            log.warning("published %d exported group(s) whose exporter stopped before publishing them", swept)
            self.stats.groups_swept += swept
        state = await self.staleness.state()
        done = await self.queue.maintain(min_version=state.min_version if state else None,
                                         max_held_s=self.settings.stale_max_age_s)
        self.stats.stale_groups_requeued += done.requeued
        self.stats.stale_groups_dropped += done.dropped_groups
        self.stats.stale_rows_dropped += done.dropped_rows
        if done.dropped_sessions:
            await self.staleness.release(done.dropped_sessions)

    # ------------------------------------------------------------------------ for the routes

    def check_lease_args(self, max_groups: int, wait_s: float) -> None:
        if not 1 <= max_groups <= self.settings.max_lease_groups:
            raise errors.InvalidRequest(
                f"max_groups must be between 1 and {self.settings.max_lease_groups}, got {max_groups}",
                param="max_groups")
        if not 0.0 <= wait_s <= self.settings.max_wait_s:
            raise errors.InvalidRequest(
                f"wait_s must be between 0 and {self.settings.max_wait_s}, got {wait_s}", param="wait_s")

    async def lease_batch(self, max_groups: int, wait_s: float) -> tuple[str, bytes] | None:
        """``(lease_id, encoded batch)`` of up to ``max_groups`` ready groups, or None after ``wait_s``."""
        self.check_lease_args(max_groups, wait_s)
        state = await self.staleness.state()
        lease = await self.queue.lease(max_groups, wait_s, min_version=state.min_version if state else None)
        if lease is None:
            return None
        self.stats.leases += 1
        self.stats.groups_leased += len(lease.groups)
        self.stats.groups_redelivered += sum(g.deliveries > 1 for g in lease.groups)
        meta = lease_meta(
            lease, format_version=FORMAT_VERSION, lease_timeout_s=self.settings.lease_timeout_s,
            export_mode=self.settings.export_mode, gamma=self.settings.gamma,
            reward_mode=self.settings.reward_mode, trainer=state.as_dict() if state else None,
        )
        return lease.id, merge_batches([g.payload for g in lease.groups], meta)

    async def ack(self, lease_id: str) -> int:
        n = await self.queue.ack(lease_id)
        self.stats.acks += 1
        self.stats.groups_acked += n
        return n

    async def configure_trainer(
        self, *, version: int, batch_size: int, staleness_bound: int, group_size: int | None = None
    ) -> Any:
        """``POST /admin/trainer``: register the trainer or move its version (see gateway.staleness)."""
        running = await self.store.list_sessions(status=["active", "finished"])
        queued = await self.queue.counts()
        # places reserved by open groups and not taken yet are charged too: the sessions that take them
        # later are not charged again (and the places, if never taken, are given back at the close)
        reserved = await self.store.open_groups(created_before=float("inf"))
        # a group exported between the two reads is in both: count each session once
        pending = (len({s.id for s in running if not s.is_eval} | queued.pending_ids)
                   + sum(g.places - g.created for g in reserved))
        state = await self.staleness.configure(version=version, batch_size=batch_size,
                                               staleness_bound=staleness_bound, group_size=group_size,
                                               pending_sessions=pending)
        self.notify()  # a new bound may re-admit held groups
        return state

    async def describe(self) -> dict[str, Any]:
        """Counters, queue depth and the trainer state, for ``GET /v1/trajectories/stats``."""
        counts = await self.queue.counts()
        state = await self.staleness.state()
        return {
            "leader": {"id": await self.leader(), "this_process": self._leader_id, "leading": self.leading},
            # groups published again after Redis lost them (the Redis queue's rebuild; 0 on the SQL queue)
            "stats": {**asdict(self.stats), "groups_republished": getattr(self.queue, "republished", 0)},
            "queue": counts.as_dict(),
            "trainer": state.as_dict() if state else None,
            "settings": asdict(self.settings),
            "waiting": await self.why_waiting(counts.ready, state),
        }

    async def why_waiting(self, ready: int, state: Any) -> str:
        """One line on why a trainer gets no data, e.g. "6 groups open (24 sessions: 24 active, 0 finished),
        0 ready to lease, staleness budget full (24 of 24 sessions admitted)"."""
        live = [s for s in await self.store.list_sessions(status=["active", "finished"]) if not s.is_eval]
        groups: dict[str, list[SessionRecord]] = defaultdict(list)
        for s in live:
            groups[s.group_id].append(s)
        active = sum(s.status == "active" for s in live)
        line = (f"{len(groups)} groups open ({len(live)} sessions: {active} active, {len(live) - active} "
                f"finished), {ready} ready to lease")
        if state is None:
            return line + ", no trainer registered (no staleness budget)"
        full = "full" if state.admitted >= state.limit else "not full"
        return line + f", staleness budget {full} ({state.admitted} of {state.limit} sessions admitted)"
