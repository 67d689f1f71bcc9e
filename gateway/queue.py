"""The trajectory queue: finished groups wait here until a trainer leases and acknowledges them.

One entry is one GRPO group: its rows encoded with :mod:`agentrl.trajectory` (the payload) plus a little
metadata (group id, session ids, row/token counts, the oldest weight version among its generated tokens).

Semantics (both backends):

* ``put`` adds a group (idempotent by ``group_key``).
* Export is at-least-once: ``stage(conn, group)`` runs inside the transaction that claims the group's
  sessions (``Store.claim_sessions(then=...)``), ``publish(group)`` after it commits, and ``sweep()``
  (every lifecycle tick) publishes what was staged but never published (the exporter died in between).
  SQL: staging *is* the enqueue (one transaction), publish only wakes waiters. Redis: staging writes the
  group to the SQL table as ``status='outbox'`` (a transactional outbox); publish adds it to the stream
  (one Lua script: dedup key + stream entry, so a group is never added twice) and marks the row
  ``published``. The row stays until the group is acknowledged (or dropped as too stale), because Redis
  is state "that can be rebuilt from SQL" (DESIGN.md): a Redis restarted without its data (kill -9 with no
  AOF/RDB, an OOM kill, a failover to an empty replica) has lost the stream, the held groups and the
  dedup keys. Deleting the row at publish lost every waiting group then (the chaos bench, issue 36: 145
  of 155 exported groups over three Redis kills). See :meth:`RedisQueue.sweep` for the rebuild.
* ``lease(max_groups, wait_s)`` waits up to ``wait_s`` for ``max_groups`` available groups, then claims
  what is there (at least one, else returns None) under a fresh lease id that expires ``lease_timeout_s``
  later. Available = never leased, or leased under a lease that expired (at-least-once re-delivery).
  Groups whose oldest token version is below ``min_version`` are moved aside as *held* instead of being
  leased (staleness control); ``maintain`` re-queues held groups that became admissible again and drops
  those held longer than a configured age.
* ``ack(lease_id)`` removes the lease's groups for good (Redis: their SQL rows too). An unknown lease
  raises NotFound (404); an expired or already acknowledged lease raises Conflict (409) and acknowledges
  nothing, so no group is ever acknowledged twice.

Backends: :class:`SqlQueue` (tables of migration ``0002_trajectories``; claims are one conditional UPDATE,
safe with several gateway processes on PostgreSQL) and :class:`RedisQueue` (a Redis stream with a consumer
group; a lease is a consumer of that group, re-delivery is ``XAUTOCLAIM`` after the lease timeout, and the
ack is one Lua script that checks the lease and acknowledges its entries atomically, on Redis' clock).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway import errors
from gateway.store import schema
from gateway.store.backend import Backend

# the tables (Alembic revision 0002_trajectories) are defined with the store's others
queue_table = schema.trajectory_queue
lease_table = schema.trajectory_leases

log = logging.getLogger(__name__)

LEASE_RETENTION_S = 86_400.0  # how long a finished lease is remembered (to answer 409 rather than 404)
POLL_S = 0.2  # how often a waiting lease looks again (other processes may have added groups)
REBUILD_BATCH = 64  # rows read at a time when a restarted Redis gets its groups again (payloads can be MBs)


@dataclass(slots=True, kw_only=True)
class QueuedGroup:
    """One GRPO group in the queue. ``min_version`` is -1 when no row holds a generated token."""

    group_key: str
    group_id: str
    session_ids: list[str]
    payload: bytes
    n_rows: int
    n_tokens: int
    min_version: int
    complete: bool
    created_at: float = field(default_factory=time.time)
    deliveries: int = 0

    def describe(self) -> dict[str, Any]:
        """The group as it appears in a batch's metadata (everything but the payload)."""
        return {
            "group_key": self.group_key,
            "group_id": self.group_id,
            "session_ids": self.session_ids,
            "n_rows": self.n_rows,
            "n_tokens": self.n_tokens,
            "min_version": self.min_version,
            "complete": self.complete,
            "created_at": self.created_at,
            "deliveries": self.deliveries,
        }

    def _meta_json(self) -> str:
        return json.dumps({k: v for k, v in self.describe().items() if k != "deliveries"})

    @classmethod
    def _from_meta(cls, meta: dict[str, Any], payload: bytes, deliveries: int = 0) -> QueuedGroup:
        return cls(payload=payload, deliveries=deliveries, **meta)


@dataclass(slots=True)
class Lease:
    id: str
    deadline: float  # unix seconds
    groups: list[QueuedGroup]


@dataclass(slots=True)
class Maintenance:
    """What one ``maintain`` call did."""

    requeued: int = 0
    dropped_groups: int = 0
    dropped_rows: int = 0
    dropped_sessions: int = 0


@dataclass(slots=True)
class QueueCounts:
    ready: int = 0
    leased: int = 0
    held: int = 0
    held_rows: int = 0
    pending_ids: set[str] = field(default_factory=set)  # sessions in ready/leased/held groups (not yet trained)

    @property
    def pending_sessions(self) -> int:
        return len(self.pending_ids)

    def as_dict(self) -> dict[str, int]:
        """The counts of ``GET /v1/trajectories/stats`` (``pending_sessions`` instead of the ids)."""
        return {"ready": self.ready, "leased": self.leased, "held": self.held, "held_rows": self.held_rows,
                "pending_sessions": self.pending_sessions}


class TrajectoryQueue(Protocol):
    lease_timeout_s: float

    async def put(self, group: QueuedGroup) -> bool: ...
    async def stage(self, conn: Any, group: QueuedGroup) -> None: ...
    async def publish(self, group: QueuedGroup) -> None: ...
    async def sweep(self) -> int: ...
    async def lease(self, max_groups: int, wait_s: float, *, min_version: int | None = None) -> Lease | None: ...
    async def ack(self, lease_id: str) -> int: ...
    async def maintain(self, *, min_version: int | None, max_held_s: float) -> Maintenance: ...
    async def counts(self) -> QueueCounts: ...
    def notify(self) -> None: ...
    async def close(self) -> None: ...


def is_stale(group_min_version: int, min_version: int | None) -> bool:
    return min_version is not None and group_min_version >= 0 and group_min_version < min_version


class _Waiter:
    """Wakes waiting leases when this process adds a group; other processes are seen by polling."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()

    async def wait(self, timeout: float) -> None:
        self._event.clear()
        try:  # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation (see lifecycle)
            async with asyncio.timeout(timeout):
                await self._event.wait()
        except TimeoutError:
            pass


@asynccontextmanager
async def _translate(what: str) -> AsyncIterator[None]:
    """Database and Redis failures become 503s with a clear message (errors of ours pass through)."""
    import redis.exceptions

    try:
        yield
    except (SQLAlchemyError, redis.exceptions.RedisError, OSError) as exc:
        raise errors.StoreUnavailable(f"trajectory queue unavailable during {what}: {exc}") from exc


def _lost_group(exc: BaseException | None) -> bool:
    """Redis answered that the queue's stream or its consumer group does not exist."""
    import redis.exceptions

    text = str(exc)
    return isinstance(exc, redis.exceptions.ResponseError) and ("NOGROUP" in text or "no such key" in text.lower())


# ---------------------------------------------------------------------------------------------- SQL


class SqlQueue:
    """The queue over the tables of migration ``0002_trajectories`` (SQLite or PostgreSQL)."""

    def __init__(self, backend: Backend, *, lease_timeout_s: float) -> None:
        self.backend = backend
        self.engine = backend.write_engine
        self.lease_timeout_s = lease_timeout_s
        self._waiter = _Waiter()
        self._leases_pruned_at = 0.0

    def notify(self) -> None:
        self._waiter.notify()

    async def close(self) -> None:
        return None

    async def put(self, group: QueuedGroup) -> bool:
        async with _translate("put"):
            try:
                async with self.engine.begin() as conn:
                    await _insert(conn, group, "ready")
            except IntegrityError:
                return False  # already queued (same group_key): put is idempotent
        self.notify()
        return True

    async def stage(self, conn: Any, group: QueuedGroup) -> None:
        """Enqueue inside the caller's transaction (the one that claims the group's sessions)."""
        await _insert(conn, group, "ready")

    async def publish(self, group: QueuedGroup) -> None:
        self.notify()

    async def sweep(self) -> int:
        return 0  # staged = queued

    @staticmethod
    def _available(now: float) -> Any:
        q = queue_table
        return (q.c.status == "ready") | ((q.c.status == "leased") & (q.c.lease_deadline < now))

    async def _hold_stale(self, conn: Any, now: float, min_version: int | None) -> None:
        if min_version is None:
            return
        q = queue_table
        await conn.execute(
            q.update()
            .where(self._available(now), q.c.min_version >= 0, q.c.min_version < min_version)
            .values(status="held", held_at=now, lease_id=None, lease_deadline=None)
        )

    async def _count_available(self, min_version: int | None) -> int:
        q = queue_table
        now = time.time()
        cond = self._available(now)
        if min_version is not None:
            cond = cond & ((q.c.min_version < 0) | (q.c.min_version >= min_version))
        async with self.engine.connect() as conn:
            return int((await conn.execute(sa.select(sa.func.count()).select_from(q).where(cond))).scalar_one())

    async def _claim(self, max_groups: int, min_version: int | None) -> Lease | None:
        q, leases = queue_table, lease_table
        now = time.time()
        lease_id = "lease-" + uuid.uuid4().hex
        deadline = now + self.lease_timeout_s
        async with self.engine.begin() as conn:
            await conn.execute(
                leases.update().where(leases.c.status == "open", leases.c.deadline < now).values(status="expired")
            )
            await self._hold_stale(conn, now, min_version)
            pick = sa.select(q.c.id).where(self._available(now)).order_by(q.c.id).limit(max_groups)
            # The picked rows' ids first, locked where the database locks rows (skipping those another
            # lease holds): PostgreSQL may re-run a LIMIT subquery inside an UPDATE, and with SKIP LOCKED
            # each run would pick different rows. (SQLite has one writer at a time: nothing to skip.)
            ids = [r.id for r in await conn.execute(self.backend.lock(pick, skip_locked=True))]
            claimed = await conn.execute(
                q.update()
                .where(q.c.id.in_(ids), self._available(now))
                .values(status="leased", lease_id=lease_id, lease_deadline=deadline, deliveries=q.c.deliveries + 1)
            )
            if not claimed.rowcount:
                return None
            await conn.execute(
                leases.insert().values(id=lease_id, created_at=now, deadline=deadline, status="open",
                                       n_groups=claimed.rowcount)
            )
            rows = (await conn.execute(sa.select(q).where(q.c.lease_id == lease_id).order_by(q.c.id))).mappings()
            groups = [
                QueuedGroup(
                    group_key=r["group_key"], group_id=r["group_id"], session_ids=list(r["session_ids"]),
                    payload=bytes(r["payload"]), n_rows=r["n_rows"], n_tokens=r["n_tokens"],
                    min_version=r["min_version"], complete=bool(r["complete"]), created_at=r["created_at"],
                    deliveries=r["deliveries"],
                )
                for r in rows
            ]
        return Lease(id=lease_id, deadline=deadline, groups=groups)

    async def lease(self, max_groups: int, wait_s: float, *, min_version: int | None = None) -> Lease | None:
        end = time.monotonic() + wait_s
        async with _translate("lease"):
            while True:
                left = end - time.monotonic()
                if left <= 0 or await self._count_available(min_version) >= max_groups:
                    lease = await self._claim(max_groups, min_version)
                    if lease is not None or left <= 0:
                        return lease
                await self._waiter.wait(min(POLL_S, max(left, 0.0)))

    async def ack(self, lease_id: str) -> int:
        q, leases = queue_table, lease_table
        now = time.time()
        async with _translate("ack"), self.engine.begin() as conn:
            done = await conn.execute(
                leases.update()
                .where(leases.c.id == lease_id, leases.c.status == "open", leases.c.deadline >= now)
                .values(status="acked", acked_at=now)
            )
            if not done.rowcount:
                row = (await conn.execute(sa.select(leases.c.status).where(leases.c.id == lease_id))).first()
                if row is None:
                    raise errors.NotFound(f"no lease {lease_id!r} (never issued, or forgotten after a day)")
                if row.status == "acked":
                    raise errors.Conflict(f"lease {lease_id} was already acknowledged", code="lease_acked")
                raise errors.Conflict(
                    f"lease {lease_id} expired before its ack; its groups return to the queue "
                    "(lease again, and ack within the lease timeout)", code="lease_expired")
            removed = await conn.execute(q.delete().where(q.c.lease_id == lease_id, q.c.status == "leased"))
            return int(removed.rowcount)

    async def maintain(self, *, min_version: int | None, max_held_s: float) -> Maintenance:
        q, leases = queue_table, lease_table
        now = time.time()
        out = Maintenance()
        async with _translate("maintenance"):
            async with self.engine.connect() as conn:  # a read first: usually nothing is held
                held = (await conn.execute(
                    sa.select(q.c.id, q.c.n_rows, q.c.session_ids, q.c.held_at, q.c.min_version)
                    .where(q.c.status == "held"))).all()
            old = [r for r in held if r.held_at < now - max_held_s]
            fresh = [r for r in held if r.held_at >= now - max_held_s and not is_stale(r.min_version, min_version)]
            forget = now - self._leases_pruned_at > 60.0
            if not (old or fresh or forget):
                return out
            async with self.engine.begin() as conn:
                if old:
                    gone = await conn.execute(q.delete().where(q.c.id.in_([r.id for r in old]), q.c.status == "held"))
                    if gone.rowcount == len(old):
                        out.dropped_groups = len(old)
                        out.dropped_rows = sum(r.n_rows for r in old)
                        out.dropped_sessions = sum(len(r.session_ids) for r in old)
                if fresh:
                    res = await conn.execute(q.update().where(q.c.id.in_([r.id for r in fresh]), q.c.status == "held")
                                             .values(status="ready", held_at=None))
                    out.requeued = int(res.rowcount)
                if forget:
                    await conn.execute(leases.delete().where(leases.c.created_at < now - LEASE_RETENTION_S))
                    self._leases_pruned_at = now
        if out.requeued:
            self.notify()
        return out

    async def counts(self) -> QueueCounts:
        q = queue_table
        out = QueueCounts()
        async with _translate("counts"), self.engine.connect() as conn:
            rows = (await conn.execute(sa.select(q.c.status, q.c.n_rows, q.c.session_ids))).all()
        for r in rows:
            setattr(out, r.status, getattr(out, r.status) + 1)
            if r.status == "held":
                out.held_rows += r.n_rows
            out.pending_ids.update(r.session_ids)
        return out


def _row_group(row: Any) -> QueuedGroup:
    """The group of a ``trajectory_queue`` row (a mapping)."""
    return QueuedGroup(
        group_key=row["group_key"], group_id=row["group_id"], session_ids=list(row["session_ids"]),
        payload=bytes(row["payload"]), n_rows=row["n_rows"], n_tokens=row["n_tokens"],
        min_version=row["min_version"], complete=bool(row["complete"]), created_at=row["created_at"])


async def _insert(conn: Any, group: QueuedGroup, status: str) -> None:
    await conn.execute(
        queue_table.insert().values(
            group_key=group.group_key, group_id=group.group_id, session_ids=group.session_ids,
            payload=group.payload, n_rows=group.n_rows, n_tokens=group.n_tokens,
            min_version=group.min_version, complete=group.complete, created_at=group.created_at,
            status=status, deliveries=0,
        )
    )


# -------------------------------------------------------------------------------------------- Redis

# Idempotent put: the dedup key and the stream entry together or not at all.
_PUT_LUA = """
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('XADD', KEYS[2], '*', 'meta', ARGV[2], 'payload', ARGV[3])
return 1
"""

_ACK_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {-1} end
if status == 'acked' then return {-2} end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if status ~= 'open' or now_ms > tonumber(redis.call('HGET', KEYS[1], 'deadline_ms')) then
  redis.call('HSET', KEYS[1], 'status', 'expired')
  return {-3}
end
local ids = cjson.decode(redis.call('HGET', KEYS[1], 'ids'))
for _, id in ipairs(ids) do
  local p = redis.call('XPENDING', KEYS[2], ARGV[1], id, id, 1, ARGV[2])
  if #p == 0 then
    redis.call('HSET', KEYS[1], 'status', 'expired')
    return {-3}
  end
end
if #ids > 0 then
  redis.call('XACK', KEYS[2], ARGV[1], unpack(ids))
  redis.call('XDEL', KEYS[2], unpack(ids))
end
local keys = redis.call('HGET', KEYS[1], 'keys') or '[]'
if ARGV[3] == '1' then
  local list = cjson.decode(keys)
  if #list > 0 then redis.call('SADD', KEYS[3], unpack(list)) end
end
redis.call('HSET', KEYS[1], 'status', 'acked')
redis.call('XGROUP', 'DELCONSUMER', KEYS[2], ARGV[1], ARGV[2])
return {#ids, keys}
"""

# The end of a rebuild (RedisQueue._rebuild): mark the queue whole only if the marker is still the one this
# rebuild set, i.e. Redis did not restart again meanwhile (that would have emptied it) and no later rebuild
# took over.
_REBUILT_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], 'ok')
  return 1
end
return 0
"""


class RedisQueue:
    """The queue as a Redis stream with one consumer group; each lease is a consumer of that group."""

    GROUP = "trainers"

    def __init__(self, redis: Any, *, prefix: str, lease_timeout_s: float, engine: AsyncEngine | None = None) -> None:
        self.redis = redis
        self.engine = engine  # the SQL store: the outbox of staged groups (see the module docstring)
        self.lease_timeout_s = lease_timeout_s
        self.stream = f"{prefix}trajq:stream"
        self.held_meta = f"{prefix}trajq:held:meta"
        self.held_payload = f"{prefix}trajq:held:payload"
        self.keys = f"{prefix}trajq:keys"  # group keys ever queued (idempotent put)
        # group keys acknowledged or dropped whose SQL rows are still to be deleted (see _forget)
        self.done = f"{prefix}trajq:done"
        # "ok" while this Redis holds every published group; absent after it lost its data (see _rebuild)
        self.whole = f"{prefix}trajq:whole"
        self._lease_prefix = f"{prefix}trajq:lease:"
        self._waiter = _Waiter()
        self._ack = redis.register_script(_ACK_LUA)
        self._put = redis.register_script(_PUT_LUA)
        self._rebuilt = redis.register_script(_REBUILT_LUA)
        self._group_ready = False
        self.republished = 0  # groups published again after Redis lost them (this process's count)

    def notify(self) -> None:
        self._waiter.notify()

    @asynccontextmanager
    async def _translate(self, what: str) -> AsyncIterator[None]:
        """:func:`_translate`, and a stream or consumer group that Redis no longer has (it restarted
        without its data) is created again by the next call: until then every lease, count and upkeep
        failed with NOGROUP / "no such key", for as long as the gateway ran."""
        try:
            async with _translate(what):
                yield
        except errors.StoreUnavailable as exc:
            if _lost_group(exc.__cause__):
                self._group_ready = False
            raise

    async def close(self) -> None:
        return None

    async def _ensure_group(self) -> None:
        if self._group_ready:
            return
        import redis.exceptions

        try:
            await self.redis.xgroup_create(self.stream, self.GROUP, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    async def _add(self, group: QueuedGroup) -> None:
        await self.redis.xadd(self.stream, {"meta": group._meta_json(), "payload": group.payload})

    async def put(self, group: QueuedGroup) -> bool:
        async with self._translate("put"):
            await self._ensure_group()
            added = await self._put(keys=[self.keys, self.stream],
                                    args=[group.group_key, group._meta_json(), group.payload])
        if not added:
            return False
        self.notify()
        return True

    async def stage(self, conn: Any, group: QueuedGroup) -> None:
        """Write the group to the SQL outbox inside the caller's transaction."""
        if self.engine is None:
            raise RuntimeError("RedisQueue.stage needs the SQL engine (the outbox)")
        await _insert(conn, group, "outbox")

    async def publish(self, group: QueuedGroup) -> None:
        """Add a staged group to the stream (idempotent), then mark its row ``published``: the row stays
        until the ack, so that a Redis that loses its data can be given the group again."""
        await self.put(group)
        assert self.engine is not None
        q = queue_table
        async with self._translate("publish"):
            async with self.engine.begin() as conn:
                await conn.execute(q.update().where(q.c.group_key == group.group_key, q.c.status == "outbox")
                                   .values(status="published"))

    async def sweep(self) -> int:
        """The SQL side's upkeep (the lifecycle leader's, every few seconds): delete the rows of groups
        acknowledged or dropped whose delete failed then, publish every group left in the outbox (its
        exporter died between commit and publish; their number is returned), and publish again every
        ``published`` group if Redis lost the queue (:meth:`_rebuild`)."""
        if self.engine is None:
            return 0
        q = queue_table
        async with self._translate("sweep"):
            await self._forget(await self.redis.smembers(self.done))
            async with self.engine.connect() as conn:
                rows = (await conn.execute(sa.select(q).where(q.c.status == "outbox").order_by(q.c.id))).mappings().all()
        for row in rows:
            await self.publish(_row_group(row))
        await self._rebuild()
        return len(rows)

    async def _rebuild(self) -> None:
        """Publish again every ``published`` group when Redis no longer holds the queue.

        The key ``whole`` says "ok" while Redis holds every published group; a Redis restarted without its
        data has none. Then every ``published`` row is put again with the same group key and payload
        through the dedup script, whose dedup set is the new Redis's own: a second replica rebuilding at
        the same moment, or a group published again meanwhile, adds nothing twice. A group acknowledged
        before has no row (the ack deletes it), so it never comes back. ``whole`` becomes "ok" only if
        the marker is still this rebuild's: a Redis that restarted again during the rebuild is rebuilt
        by the next sweep."""
        assert self.engine is not None
        q = queue_table
        again = 0
        async with self._translate("rebuild"):
            if await self.redis.get(self.whole) in (b"ok", "ok"):
                return
            token = uuid.uuid4().hex
            await self.redis.set(self.whole, token)
            self._group_ready = False  # the consumer group went with the data: create it before adding
            await self._ensure_group()
            after = 0
            while True:
                async with self.engine.connect() as conn:
                    rows = (await conn.execute(
                        sa.select(q).where(q.c.status == "published", q.c.id > after).order_by(q.c.id)
                        .limit(REBUILD_BATCH))).mappings().all()
                for row in rows:
                    group = _row_group(row)
                    again += int(await self._put(keys=[self.keys, self.stream],
                                                 args=[group.group_key, group._meta_json(), group.payload]))
                if len(rows) < REBUILD_BATCH:
                    break
                after = rows[-1]["id"]
            await self._rebuilt(keys=[self.whole], args=[token])
        if again:
            self.republished += again
            log.warning("Redis had lost the trajectory queue (restarted without its data?): published %d "
                        "group(s) again from SQL", again)
            self.notify()

    async def _forget(self, keys: Any) -> None:
        """Delete the SQL rows of groups acknowledged or dropped (``keys``), then their entries in the
        ``done`` set. The ack and the drop add the keys to ``done`` in the same Redis step as themselves,
        so a delete that fails (the database is down) is done again by the next sweep rather than leaving
        a row that a later rebuild would publish again."""
        names = sorted(k.decode() if isinstance(k, bytes) else k for k in keys)
        if not names or self.engine is None:
            return
        q = queue_table
        async with self.engine.begin() as conn:
            await conn.execute(q.delete().where(q.c.group_key.in_(names), q.c.status.in_(("outbox", "published"))))
        await self.redis.srem(self.done, *names)

    async def _forget_soon(self, keys: list[str]) -> None:
        """:meth:`_forget` now if the database answers, else on the next sweep (the keys wait in ``done``):
        the ack or drop itself already happened in Redis and must be reported as done."""
        import redis.exceptions

        try:
            await self._forget(keys)
        except (SQLAlchemyError, OSError, redis.exceptions.RedisError) as exc:
            log.warning("the SQL rows of %d acknowledged or dropped group(s) are left to the next sweep: %s",
                        len(keys), exc)

    def _group_of(self, fields: dict[bytes, bytes], deliveries: int = 0) -> QueuedGroup:
        return QueuedGroup._from_meta(json.loads(fields[b"meta"]), bytes(fields[b"payload"]), deliveries)

    async def _hold(self, entry_id: bytes, group: QueuedGroup, consumer: str) -> None:
        meta = json.loads(group._meta_json())
        meta["held_at"] = time.time()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.held_meta, group.group_key, json.dumps(meta))
            pipe.hset(self.held_payload, group.group_key, group.payload)
            pipe.xack(self.stream, self.GROUP, entry_id)
            pipe.xdel(self.stream, entry_id)
            await pipe.execute()

    async def _take(self, consumer: str, want: int, min_version: int | None) -> list[tuple[bytes, QueuedGroup]]:
        """Claim up to ``want`` entries for ``consumer``: expired leases first, then new entries."""
        got: list[tuple[bytes, QueuedGroup]] = []
        timeout_ms = int(self.lease_timeout_s * 1000)
        reply = await self.redis.xautoclaim(self.stream, self.GROUP, consumer, timeout_ms, "0-0", count=want)
        entries = list(reply[1])
        if len(entries) < want:
            new = await self.redis.xreadgroup(self.GROUP, consumer, {self.stream: ">"}, count=want - len(entries))
            for _, stream_entries in new or []:
                entries.extend(stream_entries)
        for entry_id, fields in entries:
            if not fields:  # deleted while pending
                await self.redis.xack(self.stream, self.GROUP, entry_id)
                continue
            group = self._group_of(fields)
            if is_stale(group.min_version, min_version):
                await self._hold(entry_id, group, consumer)
                continue
            got.append((entry_id, group))
        return got

    async def lease(self, max_groups: int, wait_s: float, *, min_version: int | None = None) -> Lease | None:
        lease_id = "lease-" + uuid.uuid4().hex
        end = time.monotonic() + wait_s
        got: list[tuple[bytes, QueuedGroup]] = []
        async with self._translate("lease"):
            await self._ensure_group()
            while True:
                got += await self._take(lease_id, max_groups - len(got), min_version)
                left = end - time.monotonic()
                if len(got) >= max_groups or left <= 0:
                    break
                await self._waiter.wait(min(POLL_S, left))
            if not got:
                await self.redis.xgroup_delconsumer(self.stream, self.GROUP, lease_id)
                return None
            ids = [entry_id for entry_id, _ in got]
            # Restart the idle clock of everything claimed while waiting: the lease runs from now.
            await self.redis.xclaim(self.stream, self.GROUP, lease_id, 0, ids, justid=True)
            seconds, micros = await self.redis.time()
            now_ms = seconds * 1000 + micros // 1000
            deadline_ms = now_ms + int(self.lease_timeout_s * 1000)
            pending = await self.redis.xpending_range(self.stream, self.GROUP, "-", "+", len(ids),
                                                      consumername=lease_id)
            times = {p["message_id"]: p["times_delivered"] for p in pending}
            key = self._lease_prefix + lease_id
            await self.redis.hset(key, mapping={
                "status": "open", "deadline_ms": deadline_ms,
                "ids": json.dumps([i.decode() if isinstance(i, bytes) else i for i in ids]),
                "keys": json.dumps([group.group_key for _, group in got]),  # the ack deletes their SQL rows
            })
            await self.redis.expire(key, int(self.lease_timeout_s + LEASE_RETENTION_S))
        groups = []
        for entry_id, group in got:
            group.deliveries = int(times.get(entry_id, 1))
            groups.append(group)
        return Lease(id=lease_id, deadline=deadline_ms / 1000, groups=groups)

    async def ack(self, lease_id: str) -> int:
        async with self._translate("ack"):
            await self._ensure_group()
            reply = await self._ack(keys=[self._lease_prefix + lease_id, self.stream, self.done],
                                    args=[self.GROUP, lease_id, "1" if self.engine is not None else "0"])
        code = int(reply[0])
        if code == -1:
            raise errors.NotFound(f"no lease {lease_id!r} (never issued, or forgotten after a day)")
        if code == -2:
            raise errors.Conflict(f"lease {lease_id} was already acknowledged", code="lease_acked")
        if code == -3:
            raise errors.Conflict(
                f"lease {lease_id} expired before its ack; its groups return to the queue "
                "(lease again, and ack within the lease timeout)", code="lease_expired")
        if self.engine is not None:
            await self._forget_soon(json.loads(reply[1]))
        return code

    async def maintain(self, *, min_version: int | None, max_held_s: float) -> Maintenance:
        out = Maintenance()
        now = time.time()
        dropped: list[str] = []
        async with self._translate("maintenance"):
            await self._ensure_group()
            held = await self.redis.hgetall(self.held_meta)
            for key, raw in held.items():
                meta = json.loads(raw)
                held_at = meta.pop("held_at")
                if held_at < now - max_held_s:
                    # the HDEL picks one replica to count the drop; ``done`` has the SQL row deleted too (else
                    # a rebuild would publish the dropped group again and its budget be given back twice)
                    async with self.redis.pipeline(transaction=True) as pipe:
                        pipe.hdel(self.held_meta, key)
                        pipe.hdel(self.held_payload, key)
                        if self.engine is not None:
                            pipe.sadd(self.done, key)
                        won = (await pipe.execute())[0]
                    if won:
                        dropped.append(meta["group_key"])
                        out.dropped_groups += 1
                        out.dropped_rows += meta["n_rows"]
                        out.dropped_sessions += len(meta["session_ids"])
                elif not is_stale(meta["min_version"], min_version):
                    payload = await self.redis.hget(self.held_payload, key)
                    if payload is not None and await self.redis.hdel(self.held_meta, key):
                        await self.redis.hdel(self.held_payload, key)
                        await self._add(QueuedGroup._from_meta(meta, bytes(payload)))
                        out.requeued += 1
            await self._forget_idle_consumers()
        if dropped and self.engine is not None:
            await self._forget_soon(dropped)
        if out.requeued:
            self.notify()
        return out

    async def _forget_idle_consumers(self) -> None:
        """Consumers of expired leases whose entries were all re-claimed hold nothing: remove them."""
        for consumer in await self.redis.xinfo_consumers(self.stream, self.GROUP):
            idle_s = consumer["idle"] / 1000
            if consumer["pending"] == 0 and idle_s > self.lease_timeout_s:
                name = consumer["name"]
                await self.redis.xgroup_delconsumer(self.stream, self.GROUP, name)

    async def counts(self) -> QueueCounts:
        out = QueueCounts()
        async with self._translate("counts"):
            await self._ensure_group()
            summary = await self.redis.xpending(self.stream, self.GROUP)
            out.leased = int(summary["pending"])
            total = 0
            async for fields in self._iter_entries():
                total += 1
                out.pending_ids.update(json.loads(fields[b"meta"])["session_ids"])
            out.ready = total - out.leased
            for raw in (await self.redis.hgetall(self.held_meta)).values():
                meta = json.loads(raw)
                out.held += 1
                out.held_rows += meta["n_rows"]
                out.pending_ids.update(meta["session_ids"])
            if self.engine is not None:
                # the SQL rows are the groups not yet trained even when Redis lost them (until the rebuild);
                # a set, so a group both here and in the stream is counted once (the staleness budget)
                q = queue_table
                async with self.engine.connect() as conn:
                    for (ids,) in await conn.execute(
                            sa.select(q.c.session_ids).where(q.c.status.in_(("outbox", "published")))):
                        out.pending_ids.update(ids)
        return out

    async def _iter_entries(self, batch: int = 512) -> AsyncIterator[dict[bytes, bytes]]:
        start = "-"
        while True:
            chunk = await self.redis.xrange(self.stream, min=start, max="+", count=batch)
            for entry_id, fields in chunk:
                yield fields
            if len(chunk) < batch:
                return
            last = chunk[-1][0]
            last = last.decode() if isinstance(last, bytes) else last
            start = "(" + last


def lease_meta(lease: Lease, **extra: Any) -> dict[str, Any]:
    """The metadata block of a leased batch (what the trainer reads next to the rows)."""
    return {
        "lease_id": lease.id,
        "lease_deadline": lease.deadline,
        "groups": [g.describe() for g in lease.groups],
        **extra,
    }

