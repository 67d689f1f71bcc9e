"""The public API of the conversation store: records, and the ``Store`` that the gateway and export call.

The store keeps sessions, their turn trees (one ``Interaction`` per turn), rewards with an audit trail,
and the hot state that gateway replicas must share. SQL (SQLite by default, PostgreSQL by URL) is the
truth; Redis, when given, is a cache of things rebuildable from SQL (session-by-key, the chain-hash index
that finds a turn's parent, full token sequences). Every method is async and keyword-only.

    store = await Store.open("sqlite+aiosqlite:///var/agentrl.db")          # runs `alembic upgrade head`
    session = await store.create_session(group_id="g1", task_id="t1", metadata={})
    match = await store.find_parent(session_id=session.id, candidates=[(4, h4), (2, h2)])
    prompt = (await store.full_sequence(interaction_id=match.interaction.id)) + delta if match else delta
    await store.record_interactions([Interaction(...)])                    # returns once committed
    await store.close()

Times are unix seconds (float). Token arrays are plain Python lists here and packed int32/float32
little-endian bytes in SQL. Errors: see ``gateway.store.errors``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Awaitable, Callable

import sqlalchemy as sa
from redis.exceptions import RedisError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gateway.store import schema
from gateway.store.backend import Backend, open_backend
from gateway.store.dberrors import db_errors
from gateway.store.errors import Conflict, InvalidValue, NotFound, StoreUnavailable
from gateway.store.packing import unpack_i32

from gateway.store.records import (
    SESSION_STATUSES,
    CommitStats,
    FinishReason,
    NewSession,
    GroupRecord,
    Interaction,
    ParentMatch,
    RewardRecord,
    SessionRecord,
    SessionStatus,
)

from gateway.store.redis_state import Continued, Marker, RedisState
from gateway.store.rows import (
    check_interaction,
    interaction_from_row,
    interaction_to_row,
    group_from_row,
    reward_from_row,
    session_from_row,
)
from gateway.sizedlru import CacheSize
from gateway.store.seqcache import SequenceCache, TurnCache
from gateway.store.tree import parents_first, tree_json
from gateway.store.writer import GroupCommitWriter

log = logging.getLogger(__name__)

__all__ = [
    "SESSION_STATUSES",
    "CommitStats",
    "Continued",
    "FinishReason",
    "GroupRecord",
    "Interaction",
    "Marker",
    "ParentMatch",
    "RewardRecord",
    "SessionRecord",
    "SessionStatus",
    "Store",
]


def hash_key(api_key: str) -> str:
    """The SHA-256 (hex) under which a session's api key is stored and cached."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def _ancestors_sql() -> sa.TextClause:
    return sa.text(
        """
        WITH RECURSIVE anc(id, parent_id, prompt_ids, output_ids, depth) AS (
            SELECT id, parent_id, prompt_ids, output_ids, 0 FROM interactions WHERE id = :id
            UNION ALL
            SELECT i.id, i.parent_id, i.prompt_ids, i.output_ids, anc.depth + 1
            FROM interactions i JOIN anc ON i.id = anc.parent_id
        )
        SELECT id, prompt_ids, output_ids FROM anc ORDER BY depth DESC
        """
    )


def _path_ids_sql() -> sa.TextClause:
    return sa.text(
        """
        WITH RECURSIVE anc(id, parent_id, depth) AS (
            SELECT id, parent_id, 0 FROM interactions WHERE id = :id
            UNION ALL
            SELECT i.id, i.parent_id, anc.depth + 1 FROM interactions i JOIN anc ON i.id = anc.parent_id
        )
        SELECT id FROM anc ORDER BY depth DESC
        """
    )


FIND_BY_CHAIN_ROWS = 64  # find_session_by_chain reads at most this many of the newest matching turns
MOVE_BATCH = 500  # sessions per transaction in Store.move_sessions


class Store:
    """The durable conversation store. Create with ``await Store.open(...)``; one per process."""

    def __init__(
        self,
        *,
        backend: Backend,
        redis: RedisState | None,
        redis_prefix: str,
        max_batch_rows: int,
        commit_delay_s: float,
        seq_cache_tokens: int,
        turn_cache_size: int,
    ) -> None:
        """Use ``Store.open``."""
        self._backend = backend
        self._engine = backend.engine
        self._write_engine = backend.write_engine
        self._redis = redis
        self._redis_prefix = redis_prefix
        self._seqs = SequenceCache(seq_cache_tokens)
        self._turns = TurnCache(turn_cache_size)
        # Without Redis this process is the store's only writer of turns (SQLite refuses several), so two
        # things the hot path asks SQL for on every turn are kept here: session records by id (what an
        # implicit-mode request checks; dropped on every status/reward change made through this store) and
        # the chain-hash index of the turns committed here ((session, chain hash) -> newest turn). Both are
        # hints: the group-commit writer re-checks the session's status and the parent in its transaction.
        self._local = redis is None
        self._sessions: OrderedDict[str, SessionRecord] = OrderedDict()
        self._chains: OrderedDict[tuple[str, str], str] = OrderedDict()
        # api key hash -> session id, for the keys this process resolved (``known_session_id``)
        self._key_sessions: OrderedDict[str, str] = OrderedDict()
        self._local_entries = max(1024, 64 * turn_cache_size)
        self._writer = GroupCommitWriter(backend.writer, max_batch_rows=max_batch_rows, delay_s=commit_delay_s,
                                         after_commit=self._after_commit)
        self._closed = False

    @classmethod
    async def open(
        cls,
        db_url: str,
        *,
        redis_url: str | None = None,
        redis_prefix: str = "agentrl:",
        migrate: bool = True,
        max_batch_rows: int = 256,
        commit_delay_s: float = 0.0,
        seq_cache_tokens: int = 8_000_000,
        turn_cache_size: int = 1024,
    ) -> Store:
        """Connect, run ``alembic upgrade head`` (unless ``migrate=False``) and start the group-commit writer.

        ``db_url``: ``sqlite+aiosqlite:///path/to.db`` (WAL and foreign keys are switched on) or
        ``postgresql+asyncpg://user@host/db``. ``redis_url``: share hot state with other gateway
        processes on the same database; every key lives under ``redis_prefix``. The writer commits
        everything pending as one transaction as soon as the previous commit ends (so batches grow with
        load), waiting ``commit_delay_s`` first if set, and at most ``max_batch_rows`` rows per
        transaction. ``seq_cache_tokens`` bounds the in-process cache of full token sequences and
        ``turn_cache_size`` the cache of recent turns that ``find_parent`` uses with Redis.
        Raises StoreUnavailable when the database or Redis cannot be reached.
        """
        backend = await open_backend(db_url, migrate=migrate)
        redis = None
        if redis_url:
            try:
                redis = await RedisState.connect(redis_url, redis_prefix)
            except StoreUnavailable:
                await backend.close()
                raise
        return cls(
            backend=backend,
            redis=redis,
            redis_prefix=redis_prefix,
            max_batch_rows=max_batch_rows,
            commit_delay_s=commit_delay_s,
            seq_cache_tokens=seq_cache_tokens,
            turn_cache_size=turn_cache_size,
        )

    def cache_sizes(self) -> list[CacheSize]:
        """The store's in-process caches (``/metrics``: ``agentrl_gateway_cache_*``)."""
        out = [CacheSize("turns", len(self._turns), len(self._turns), self._turns.max_items),
               CacheSize("sequences", len(self._seqs), self._seqs.tokens, self._seqs.max_tokens)]
        if self._local:
            out += [CacheSize("sessions", len(self._sessions), len(self._sessions), self._local_entries),
                    CacheSize("chain_index", len(self._chains), len(self._chains), self._local_entries)]
        else:
            out.append(CacheSize("session_keys", len(self._key_sessions), len(self._key_sessions),
                                 self._local_entries))
        return out

    async def close(self) -> None:
        """Flush pending writes, stop the writer, dispose of connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._writer.close()  # its last batch first; the backend closes the connection under it
        if self._redis is not None:
            await self._redis.close()
        await self._backend.close()

    # ---- for other store modules (export/leasing, issue 4) ----
    @property
    def engine(self) -> AsyncEngine:
        """The SQLAlchemy ``AsyncEngine`` for modules that add their own tables (Alembic 0002+).

        On SQLite this is the store's single writer connection: every transaction on it starts with
        ``BEGIN IMMEDIATE``, so read-then-write transactions cannot fail with SQLITE_BUSY, and they take
        turns with the group-commit writer (its own connection) through SQLite's write lock (keep them
        short). On PostgreSQL it is the shared pool."""
        return self._write_engine

    @property
    def backend(self) -> Backend:
        """The database backend (``gateway.store.backend``): for other store-side modules (the trajectory
        queue, the staleness budget) that need its row locks or its one-statement admission."""
        return self._backend

    @property
    def redis(self) -> Any | None:
        """The ``redis.asyncio.Redis`` client, or None without Redis."""
        return self._redis.client if self._redis is not None else None

    @property
    def redis_hot(self) -> Any | None:
        """The lean pipelined client for the commands of a turn's path (``gateway.store.resp``; it has
        ``redis-py``'s methods for those), or None without Redis."""
        return self._redis.hot if self._redis is not None else None

    @property
    def redis_prefix(self) -> str:
        return self._redis_prefix

    @property
    def commit_stats(self) -> CommitStats:
        """A copy of the group-commit counters."""
        s = self._writer.stats
        return CommitStats(
            transactions=s.transactions,
            rows=s.rows,
            calls=s.calls,
            failed_calls=s.failed_calls,
            retried_batches=s.retried_batches,
            max_batch_calls=s.max_batch_calls,
        )

    def write_transaction(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A write transaction (``async with store.write_transaction() as conn``), committed on exit.
        Database errors inside are raised as StoreError."""
        return self._write_tx()

    def read_connection(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A connection for read-only queries of other store modules (``gateway.store.browse``);
        database errors inside are raised as StoreError."""
        return self._read()

    def connection_slot(self) -> AbstractAsyncContextManager[None]:
        """Wait in arrival order for one of the pool's connections (PostgreSQL; see ``gateway.store.gate``)
        and hold it for the block: for modules using :attr:`engine` on a request's path."""
        return self._backend.slot()

    @asynccontextmanager
    async def _write_tx(self) -> AsyncIterator[AsyncConnection]:
        async with self.connection_slot(), db_errors(), self._write_engine.begin() as conn:
            yield conn

    @asynccontextmanager
    async def _read(self) -> AsyncIterator[AsyncConnection]:
        async with self.connection_slot(), db_errors(), self._engine.connect() as conn:
            yield conn

    # ---- sessions ----
    async def create_session(
        self,
        *,
        group_id: str | None = None,
        task_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        session_id: str | None = None,
    ) -> SessionRecord:
        """Create an active session with a fresh random api key (returned here only, kept hashed).

        ``group_id`` defaults to the session id (a group of one). ``is_eval`` = ``metadata["eval"] is True``.
        ``session_id`` may be given (implicit episodes); a duplicate raises Conflict.
        """
        row, api_key = _new_session_row(group_id=group_id, task_id=task_id, metadata=metadata,
                                        session_id=session_id)
        try:
            async with self._write_tx() as conn:
                await conn.execute(sa.insert(schema.sessions).values(**row))
        except Conflict as exc:
            raise Conflict(f"session {row['id']} already exists") from exc
        return (await self._cache_new_sessions([(row, api_key)]))[0]

    async def _cache_new_sessions(self, made: list[tuple[dict[str, Any], str]]) -> list[SessionRecord]:
        """Put new sessions into the Redis cache; their records (with their plain api keys)."""
        out = []
        for row, api_key in made:
            if self._local:
                self._remember(self._sessions, row["id"], session_from_row(row))
            if self._redis is not None:
                self._remember(self._key_sessions, row["key_hash"], row["id"])
                await self._redis.put_session(row["key_hash"], session_from_row(row))
            out.append(session_from_row(row, api_key=api_key))
        return out

    # ---- groups (admitted as a whole; see gateway.groups) ----
    async def create_group(
        self, *, group_id: str | None, size: int, task_id: str | None = None, metadata: dict[str, Any] | None = None
    ) -> tuple[GroupRecord, list[SessionRecord]]:
        """A group and all ``size`` of its sessions, in one transaction. Conflict if the group id is taken
        (by a group or by any session)."""
        if size < 1:
            raise InvalidValue(f"group size must be >= 1, got {size}")
        gid = group_id or f"grp-{uuid.uuid4().hex}"
        meta = dict(metadata or {})
        g, s = schema.groups, schema.sessions
        now = time.time()
        group_row = {"id": gid, "size": size, "places": size, "created": size, "status": "open",
                     "task_id": task_id, "meta": meta, "created_at": now}
        made = [_new_session_row(group_id=gid, task_id=task_id, metadata={**meta, "group_size": size})
                for _ in range(size)]
        async with self._write_tx() as conn:
            taken = (await conn.execute(sa.select(s.c.id).where(s.c.group_id == gid).limit(1))).first()
            if taken is not None:
                raise Conflict(f"group {gid} already exists")
            try:
                await conn.execute(sa.insert(g).values(**group_row))
            except Conflict as exc:
                raise Conflict(f"group {gid} already exists") from exc
            await conn.execute(sa.insert(s), [row for row, _ in made])
        return group_from_row(group_row), await self._cache_new_sessions(made)

    async def join_group(
        self, *, group_id: str, size: int, task_id: str | None = None, metadata: dict[str, Any] | None = None,
        charge: Callable[[AsyncConnection, int], Awaitable[int]] | None = None,
    ) -> SessionRecord | None:
        """A new session in a free place of group ``group_id``; ONE transaction decides.

        With a place free, the session takes it (nothing is charged). With none (no group row yet, every
        place taken, or the group closed) and no ``charge``: None, nothing changed. Otherwise the group gets
        a new batch of places (``size`` for a new row, the row's own size after that), paid for by
        ``await charge(conn, places)`` on this transaction's connection (the staleness budget lives in the
        same database), so the charge commits or rolls back with the places: an exception from ``charge``
        (a 429) leaves nothing changed. The group row is locked (PostgreSQL ``FOR UPDATE``; SQLite has one
        writer), so of concurrent first sessions exactly one charges and the others take its places.
        Conflict when two callers insert the same new group row at once (PostgreSQL): the loser's
        transaction is rolled back whole, charge included; retry and it finds the row."""
        g, s = schema.groups, schema.sessions
        row, api_key = _new_session_row(group_id=group_id, task_id=task_id, metadata=metadata)
        async with self._write_tx() as conn:
            query = sa.select(g).where(g.c.id == group_id)
            query = self._backend.lock(query)
            found = (await conn.execute(query)).mappings().first()
            current = group_from_row(found) if found is not None else None
            if current is not None and not current.sealed:
                values: dict[str, Any] = {"created": current.created + 1}
            elif charge is None:
                return None
            else:
                if current is None:
                    new = {"id": group_id, "size": size, "places": 0, "created": 0, "status": "open",
                           "task_id": task_id, "meta": dict(metadata or {}), "created_at": time.time()}
                    # inserted before the charge: a concurrent creator of the same id waits on this row
                    # (PostgreSQL) and then fails with Conflict instead of charging too
                    await conn.execute(sa.insert(g).values(**new))
                    current = group_from_row(new)
                await charge(conn, current.size)
                values = {"places": current.created + current.size, "status": "open", "created": current.created + 1}
            await conn.execute(sa.update(g).where(g.c.id == group_id).values(**values))
            await conn.execute(sa.insert(s).values(**row))
        return (await self._cache_new_sessions([(row, api_key)]))[0]

    async def get_groups(self, *, group_ids: Collection[str]) -> dict[str, GroupRecord]:
        """The admitted groups among ``group_ids`` (ids without a group row are left out)."""
        ids = list(set(group_ids))
        if not ids:
            return {}
        g = schema.groups
        async with self._read() as conn:
            rows = (await conn.execute(sa.select(g).where(g.c.id.in_(ids)))).mappings().all()
        return {row["id"]: group_from_row(row) for row in rows}

    async def open_groups(self, *, created_before: float) -> list[GroupRecord]:
        """Open groups with places never taken, created before ``created_before`` (for the lifecycle to
        close when none of their sessions is left)."""
        g = schema.groups
        query = sa.select(g).where(g.c.status == "open", g.c.created < g.c.places, g.c.created_at < created_before)
        async with self._read() as conn:
            rows = (await conn.execute(query)).mappings().all()
        return [group_from_row(row) for row in rows]

    async def close_group(self, *, group_id: str, status: str) -> int:
        """Move an open group to ``status`` (``closed`` or ``abandoned``) and return its unused places
        (reserved, never created), which the caller gives back to the budget; 0 if it was not open."""
        g = schema.groups
        async with self._write_tx() as conn:
            query = sa.select(g).where(g.c.id == group_id)
            query = self._backend.lock(query)
            found = (await conn.execute(query)).mappings().first()
            if found is None or found["status"] != "open":
                return 0
            await conn.execute(sa.update(g).where(g.c.id == group_id)
                               .values(status=status, places=found["created"]))
        return int(found["places"] - found["created"])

    async def get_session(self, *, session_id: str, cached: bool = False) -> SessionRecord:
        """The session as stored in SQL (authoritative). NotFound if unknown.

        ``cached=True`` (the implicit-mode hot path, which only needs its status and owner): without
        Redis, a record this process read or changed before, kept until a status or reward change made
        through this store (``last_activity_at`` may lag). Other processes' changes are not seen; the
        group-commit writer refuses a turn of a session that is no longer active in its transaction. With
        Redis, the record cached by id (``sid:<id>``, written with every status or reward change, ordered by
        ``version``; ``last_activity_at`` may lag)."""
        if cached and self._local:
            record = self._sessions.get(session_id)
            if record is not None:
                self._sessions.move_to_end(session_id)
                return record
        if cached and self._redis is not None:
            found = await self._redis.get_session_by_id(session_id)
            if found is not None:
                return found
        async with self._read() as conn:
            row = (await conn.execute(sa.select(schema.sessions).where(schema.sessions.c.id == session_id))).mappings().first()
        if row is None:
            raise NotFound(f"unknown session {session_id}")
        record = session_from_row(row)
        if cached and self._local:
            self._remember(self._sessions, session_id, record)
        if cached and self._redis is not None:
            await self._redis.put_session(row["key_hash"], record)
        return record

    def _remember(self, cache: OrderedDict[Any, Any], key: Any, value: Any) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > self._local_entries:
            cache.popitem(last=False)

    async def get_session_by_key(self, *, api_key: str) -> SessionRecord:
        """The session whose api key this is (the gateway's auth path; Redis-cached when Redis is on).

        ``status``, ``reward`` and ids are exact (writes go through to the cache, ordered by
        ``version``); ``last_activity_at`` of a cached record may lag. NotFound if no session has it.
        """
        key_hash = hash_key(api_key)
        if self._redis is not None:
            cached = await self._redis.get_session(key_hash)
            if cached is not None:
                self._remember(self._key_sessions, key_hash, cached.id)
                return cached
        row = await self._backend.session_row_by_key(key_hash)
        if row is None:
            raise NotFound("no session has this api key")
        record = session_from_row(row)
        if self._redis is not None:
            self._remember(self._key_sessions, key_hash, record.id)
            await self._redis.put_session(key_hash, record)
        return record

    async def finish_session(self, *, session_id: str) -> SessionRecord:
        """Mark an active session finished (sets ``finished_at``). Idempotent: a session that is already
        finished, consumed or abandoned is returned unchanged. NotFound if unknown."""
        return await self._change_session(session_id=session_id, status="finished", expected=None, only_from_active=True)

    async def set_session_status(
        self,
        *,
        session_id: str,
        status: SessionStatus,
        expected: Collection[str] | None = None,
    ) -> SessionRecord:
        """Set the status (compare-and-set when ``expected`` is given: Conflict unless the current status
        is in it). Moving to "finished" sets ``finished_at`` if unset. NotFound; InvalidValue for an
        unknown status."""
        if status not in SESSION_STATUSES:
            raise InvalidValue(f"unknown session status {status!r}; valid: {', '.join(SESSION_STATUSES)}")
        return await self._change_session(session_id=session_id, status=status, expected=expected, only_from_active=False)

    async def _change_session(
        self, *, session_id: str, status: str, expected: Collection[str] | None, only_from_active: bool
    ) -> SessionRecord:
        s = schema.sessions
        async with self._write_tx() as conn:
            query = sa.select(s).where(s.c.id == session_id)
            query = self._backend.lock(query)
            row = (await conn.execute(query)).mappings().first()
            if row is None:
                raise NotFound(f"unknown session {session_id}")
            current = session_from_row(row)
            if expected is not None and current.status not in expected:
                raise Conflict(f"session {session_id} is {current.status}, expected one of {sorted(expected)}")
            if current.status == status or (only_from_active and current.status != "active"):
                return current
            values = _status_change(row, status)
            await conn.execute(sa.update(s).where(s.c.id == session_id).values(**values))
        updated = session_from_row({**row, **values})
        await self._recache([(row["key_hash"], updated)])
        return updated

    async def move_sessions(
        self, *, session_ids: Sequence[str], status: SessionStatus, expected: Collection[str],
    ) -> list[SessionRecord]:
        """Move each of ``session_ids`` that is currently in ``expected`` to ``status``, each on its own
        (one in another status, or unknown, is left as it is: unlike :meth:`claim_sessions`, not all or
        none), ``MOVE_BATCH`` sessions per transaction and one ``UPDATE`` each; the records moved. For the
        lifecycle, which abandons or finishes many sessions at a time: one transaction per session cost
        more than the turns that made them (a single-turn agent leaves one session per request)."""
        if status not in SESSION_STATUSES:
            raise InvalidValue(f"unknown session status {status!r}; valid: {', '.join(SESSION_STATUSES)}")
        s = schema.sessions
        ids = list(dict.fromkeys(session_ids))
        moved: list[tuple[str, SessionRecord]] = []
        for start in range(0, len(ids), MOVE_BATCH):
            part = ids[start:start + MOVE_BATCH]
            now = time.time()
            async with self._write_tx() as conn:
                query = sa.select(s).where(s.c.id.in_(part), s.c.status.in_(list(expected))).order_by(s.c.id)
                query = self._backend.lock(query)
                rows = (await conn.execute(query)).mappings().all()
                if not rows:
                    continue
                await conn.execute(sa.update(s).where(s.c.id.in_([row["id"] for row in rows]))
                                   .values(**_status_update(status, now)))
            moved += [(row["key_hash"], session_from_row({**row, **_status_change(row, status, now)})) for row in rows]
        await self._recache(moved)
        return [record for _, record in moved]

    async def _recache(self, changed: Sequence[tuple[str, SessionRecord]]) -> None:
        """Sessions whose row just changed (``(key hash, record)``): out of the process cache, and into
        Redis's (one round trip for all of them)."""
        for _, record in changed:
            self._sessions.pop(record.id, None)
        if self._redis is not None and changed:
            await self._redis.put_sessions(changed)

    async def claim_sessions(
        self, *, session_ids: Sequence[str], status: SessionStatus, expected: Collection[str],
        versions: Mapping[str, int] | None = None,
        then: Callable[[AsyncConnection], Awaitable[None]] | None = None,
    ) -> list[SessionRecord]:
        """Move several sessions to ``status`` in one transaction, all or none: Conflict (and nothing
        changed) unless every one of them is currently in ``expected`` (and, with ``versions``, still at
        that version: nothing changed since the caller read it); NotFound for an unknown id. ``then(conn)``
        runs inside the same transaction after the claim (export enqueues the group there, so a group is
        claimed and queued together or not at all). This is how a GRPO group is claimed for export, so two
        exporters can never split a group between them."""
        if status not in SESSION_STATUSES:
            raise InvalidValue(f"unknown session status {status!r}; valid: {', '.join(SESSION_STATUSES)}")
        s = schema.sessions
        ids = list(dict.fromkeys(session_ids))
        async with self._write_tx() as conn:
            query = sa.select(s).where(s.c.id.in_(ids)).order_by(s.c.id)
            query = self._backend.lock(query)
            rows = {row["id"]: row for row in (await conn.execute(query)).mappings().all()}
            missing = [i for i in ids if i not in rows]
            if missing:
                raise NotFound(f"unknown session(s) {missing}")
            wrong = {i: rows[i]["status"] for i in ids if rows[i]["status"] not in expected}
            if wrong:
                raise Conflict(f"sessions not in {sorted(expected)}: {wrong}")
            moved = {i: rows[i]["version"] for i in ids if versions is not None and rows[i]["version"] != versions.get(i)}
            if moved:
                raise Conflict(f"sessions changed since they were read: {moved}")
            now = time.time()
            await conn.execute(sa.update(s).where(s.c.id.in_(ids)).values(**_status_update(status, now)))
            updated = [(rows[i]["key_hash"], session_from_row({**rows[i], **_status_change(rows[i], status, now)}))
                       for i in ids]
            if then is not None:
                await then(conn)
        await self._recache(updated)
        return [record for _, record in updated]

    async def list_sessions(
        self,
        *,
        status: str | Collection[str] | None = None,
        group_id: str | None = None,
        limit: int | None = None,
        after: tuple[float, str] | None = None,
    ) -> list[SessionRecord]:
        """Sessions filtered by status (one or several) and group, oldest first (by ``created_at``, then
        id); ``after`` = the ``(created_at, id)`` of the last session of the previous page (keyset)."""
        s = schema.sessions
        query = sa.select(s).order_by(s.c.created_at, s.c.id)
        if status is not None:
            query = query.where(s.c.status.in_([status] if isinstance(status, str) else list(status)))
        if group_id is not None:
            query = query.where(s.c.group_id == group_id)
        if after is not None:
            query = query.where(sa.or_(s.c.created_at > after[0],
                                       sa.and_(s.c.created_at == after[0], s.c.id > after[1])))
        if limit is not None:
            query = query.limit(limit)
        async with self._read() as conn:
            rows = (await conn.execute(query)).mappings().all()
        return [session_from_row(row) for row in rows]

    async def lifecycle_sessions(self, *, idle_before: float, timeout_before: float,
                                 idle: bool = True) -> list[SessionRecord]:
        """What one lifecycle tick must look at, selected in SQL so that the finished history is never read:
        every active or finished session of each group id that has a finished session, or an active one
        that can move: idle since ``idle_before`` and rewarded (an idle-finish candidate: a session reward
        or any reward event), or idle since ``timeout_before`` (a group-timeout candidate); oldest first.
        A group id is returned whole (all its live sessions), so that it is cut into GRPO groups as the
        full list would be. (Idle sessions that wait for a reward are left out until their group times
        out: they used to be selected, with their whole group, on every tick.) With ``idle=False`` only the
        groups with a finished session: the idle and timeout candidates cost the database a pass over every
        idle active session (50 ms for 66,364 of them on PostgreSQL), which the lifecycle makes less often."""
        s = schema.sessions
        moving = [s.c.status == "finished"]
        if idle:
            moving += [sa.and_(s.c.status == "active", s.c.last_activity_at <= timeout_before),
                       sa.and_(s.c.status == "active", s.c.last_activity_at <= idle_before, _is_rewarded())]
        hot = sa.select(s.c.group_id).where(sa.or_(*moving))
        query = (sa.select(s).where(s.c.status.in_(("active", "finished")), s.c.group_id.in_(hot))
                 .order_by(s.c.created_at, s.c.id))
        async with self._read() as conn:
            rows = (await conn.execute(query)).mappings().all()
        return [session_from_row(row) for row in rows]

    async def live_group_ids(self, *, group_ids: Collection[str]) -> set[str]:
        """The ids among ``group_ids`` that still have an active or finished session."""
        if not group_ids:
            return set()
        s = schema.sessions
        query = sa.select(s.c.group_id).distinct().where(s.c.group_id.in_(list(group_ids)),
                                                         s.c.status.in_(("active", "finished")))
        async with self._read() as conn:
            return {row[0] for row in (await conn.execute(query)).all()}

    # ---- turns ----
    async def find_continued(self, *, index_keys: Sequence[str], longest_hash: str,
                             marker: Marker | None = None) -> Continued | None:
        """With Redis, one round trip for an implicit-mode turn: the session of the first of ``index_keys``
        (the gateway's episode index, longest candidate first) that is set, its cached record, the parent
        index's entry for ``longest_hash`` (give it to :meth:`find_parent` as ``indexed``) and, with a
        cached record, the in-flight ``marker`` added (``gateway.store.redis_state``). None without Redis
        or when no key is set. Raises StoreUnavailable when Redis fails."""
        if self._redis is None:
            return None
        try:
            return await self._redis.find_continued(index_keys, longest_hash, marker)
        except RedisError as exc:
            raise StoreUnavailable(f"Redis failed: {exc}") from exc

    async def mark_session(self, *, session_id: str, longest_hash: str | None, marker: Marker,
                           record: SessionRecord | None = None) -> Continued | None:
        """With Redis, one round trip for a turn of a named session: add its in-flight ``marker``, read the
        parent index's entry for ``longest_hash`` (None: a first turn; give the result to :meth:`find_parent`
        as ``indexed``) and, unless its ``record`` is given, the session's cached record (``Continued.record``
        is None when it is not cached: read it with :meth:`get_session_by_key`). None without Redis. Raises
        StoreUnavailable when Redis fails."""
        if self._redis is None:
            return None
        try:
            cached, parent = await self._redis.mark_session(session_id, longest_hash, marker,
                                                            read_record=record is None)
        except RedisError as exc:
            raise StoreUnavailable(f"Redis failed (in-flight marker): {exc}") from exc
        return Continued(session_id, record or cached, parent, True)

    def known_session_id(self, *, api_key: str) -> str | None:
        """The id of the session whose api key this is, if this process has resolved that key before (a key
        never moves to another session and sessions are never deleted, so the pair stays true); None
        otherwise, and always without Redis (where nothing would read the record in the same round trip)."""
        if self._redis is None:
            return None
        key_hash = hash_key(api_key)
        session_id = self._key_sessions.get(key_hash)
        if session_id is not None:
            self._key_sessions.move_to_end(key_hash)
        return session_id

    async def find_parent(
        self, *, session_id: str, candidates: Sequence[tuple[int, str]], indexed: Continued | None = None
    ) -> ParentMatch | None:
        """The parent of a new turn: the first candidate, in the order given (longest message prefix
        first), whose chain hash is the ``chain_hash`` of a turn of this session. If several turns share
        that hash (retries), the most recent wins. One index probe per candidate (Redis hash, else one
        indexed SQL query for all candidates); None when nothing matches.

        The turn itself comes from an in-process cache of recent turns when it is there, so with Redis
        the longest candidate's hit needs no SQL at all. ``interaction.reward`` may then lag a reward
        set via another replica (``get_interaction`` reads SQL). ``indexed``: what :meth:`find_continued`
        read of this session's index for the longest candidate (then it is not read again).
        """
        if not candidates:
            return None
        hashes = [h for _, h in candidates]
        if self._local:
            known = self._chains.get((session_id, hashes[0]))
            if known is not None:  # the longest candidate, committed here: nothing can beat it
                try:
                    return ParentMatch(candidates[0][0], await self._turn(known))
                except NotFound:
                    self._chains.pop((session_id, hashes[0]), None)
        if self._redis is not None:
            found = [indexed.parent_id] if indexed is not None and indexed.session_id == session_id \
                else await self._redis.chain_lookup(session_id, hashes[:1])
            if found[0] is not None:  # the longest candidate: nothing can beat it
                try:
                    return ParentMatch(candidates[0][0], await self._turn(found[0]))
                except NotFound:
                    log.warning("redis chain index points at unknown interaction %s; using SQL", found[0])
        i = schema.interactions
        query = (  # ids only: a long conversation matches many candidates, and only one row is needed
            sa.select(i.c.id, i.c.chain_hash)
            .where(i.c.session_id == session_id, i.c.chain_hash.in_(set(hashes)))
            .order_by(i.c.created_at.desc(), i.c.id.desc())
        )
        async with self._read() as conn:
            rows = (await conn.execute(query)).all()
        newest: dict[str, str] = {}
        for row in rows:
            newest.setdefault(row.chain_hash, row.id)
        if self._redis is not None and newest:
            await self._redis.chain_add([(session_id, h, iid) for h, iid in newest.items()], only_missing=True)
        for prefix_len, chain_hash in candidates:
            if chain_hash in newest:
                return ParentMatch(prefix_len, await self._turn(newest[chain_hash]))
        return None

    async def _turn(self, interaction_id: str) -> Interaction:
        """A turn from the recent-turn cache, else SQL (then cached)."""
        turn = self._turns.get(interaction_id)
        if turn is None:
            turn = await self.get_interaction(interaction_id=interaction_id)
            self._turns.put(turn)
        return turn

    async def find_session_by_chain(
        self, *, chain_hashes: Sequence[str], implicit_only: bool = True
    ) -> SessionRecord | None:
        """The session holding a turn with one of ``chain_hashes`` (tried in order, longest prefix first;
        the most recent turn wins), across all sessions: how an implicit-mode request, which names no
        session, finds its episode. ``implicit_only`` considers only sessions created with
        ``metadata={"implicit": True}``. One indexed SQL query; the gateway may keep a faster index in
        front of it (this is the rebuild-from-SQL path)."""
        if not chain_hashes:
            return None
        i, s = schema.interactions, schema.sessions
        query = (
            sa.select(i.c.chain_hash, s)
            .join(s, s.c.id == i.c.session_id)
            .where(i.c.chain_hash.in_(set(chain_hashes)))
            .order_by(i.c.created_at.desc(), i.c.id.desc())
            # the newest turns only: a prefix repeated by many episodes (identical greedy answers) must not
            # read them all; a conversation's longest prefix is its newest turn, so it is among these
            .limit(FIND_BY_CHAIN_ROWS)
        )
        async with self._read() as conn:
            rows = (await conn.execute(query)).mappings().all()
        newest: dict[str, Any] = {}
        for row in rows:
            if implicit_only and not (isinstance(row["meta"], dict) and row["meta"].get("implicit") is True):
                continue
            newest.setdefault(row["chain_hash"], row)
        for chain_hash in chain_hashes:
            if chain_hash in newest:
                return session_from_row(newest[chain_hash])
        return None

    async def full_sequence(self, *, interaction_id: str) -> list[int]:
        """All tokens of a turn: parent's full sequence + its prompt delta + its output. Cached (memory,
        then Redis); a miss walks the ancestors in one SQL query. NotFound if unknown."""
        return unpack_i32(await self._full_packed(interaction_id))

    async def _full_packed(self, interaction_id: str) -> bytes:
        packed = self._seqs.get(interaction_id)
        if packed is not None:
            return packed
        if self._redis is not None:
            packed = await self._redis.seq_get(interaction_id)
            if packed is not None:
                self._seqs.put(interaction_id, packed)
                return packed
        async with self._read() as conn:
            rows = (await conn.execute(_ancestors_sql(), {"id": interaction_id})).all()
        if not rows:
            raise NotFound(f"unknown interaction {interaction_id}")
        packed = b"".join(bytes(part) for row in rows for part in (row.prompt_ids, row.output_ids))
        self._seqs.put(interaction_id, packed)
        if self._redis is not None:
            await self._redis.seq_put([(interaction_id, packed)])
        return packed

    def new_session(self, *, group_id: str | None = None, task_id: str | None = None,
                    metadata: dict[str, Any] | None = None) -> NewSession:
        """A session to create together with its first turns (``record_interactions(create=[...])``): its
        id is known at once and it exists only if those turns commit. No I/O."""
        row, api_key = _new_session_row(group_id=group_id, task_id=task_id, metadata=metadata)
        return NewSession(row=row, api_key=api_key)

    async def record_interactions(self, interactions: Sequence[Interaction], *,
                                  create: Sequence[NewSession] = (),
                                  publish: Sequence[tuple[str, str, int]] = (),
                                  release: Sequence[tuple[str, str]] = ()) -> None:
        """Durably record turns; returns only after they are committed.

        ``create``: sessions (from :meth:`new_session`) inserted in the same transaction as the turns,
        before them (a new implicit episode and its first turn: one commit, all or nothing); they are
        cached (Redis included) with the turns. ``publish``: Redis ``(key, value, ttl)`` entries set in the
        same round trip as the turns' index after the commit (the gateway's implicit-episode index;
        ignored without Redis). ``release``: Redis sorted-set ``(key, member)`` entries removed in that
        round trip (the turn's in-flight markers, ``InFlight.releases``; ignored without Redis). That round
        trip is sent before this returns and answered after (:meth:`published` waits for it).

        Group commit: rows of concurrent callers are written in one transaction by a background writer;
        each caller awaits its own outcome. All rows of one call commit together or not at all; a
        failure fails exactly the callers whose rows failed (the batch is retried caller by caller) and
        leaves no partial rows. Raises NotFound (unknown session or parent), Conflict (session not
        active, parent from another session, duplicate id), InvalidValue (array lengths disagree),
        StoreUnavailable. Also sets the sessions' ``last_activity_at`` and updates the Redis index.
        """
        if not interactions:
            return
        for it in interactions:
            check_interaction(it)
        rows = [interaction_to_row(it) for it in interactions]
        await self._writer.submit(list(interactions), rows, [new.row for new in create], publish, release)

    async def published(self) -> None:
        """Return once Redis has answered the after-commit publish of every turn recorded so far (what
        :meth:`record_interactions` sends to Redis without waiting for its reply)."""
        await self._writer.published()

    def _after_commit(self, jobs: list[Any]) -> Awaitable[None] | None:
        """Cache the new turns and the sessions created with them in the process, and return what is left
        to do with Redis (None without it): publishing all that (and the jobs' ``publish`` entries, and
        the removal of their ``release`` entries) in one round trip. The writer answers the jobs' callers
        and then awaits it: its command is on Redis's socket before any caller is answered (so a follow-up,
        which can only come after the answer, finds the turn in Redis from any replica), and the caller
        does not wait for Redis's reply (a lost publish costs a follow-up a SQL lookup, not its link)."""
        committed = [pair for job in jobs for pair in zip(job.interactions, job.rows)]
        created = [row for job in jobs for row in job.sessions]
        if self._local:
            for row in created:
                self._remember(self._sessions, row["id"], session_from_row(row))
        sequences: list[tuple[str, bytes]] = []
        unknown: list[tuple[Interaction, dict[str, Any]]] = []  # turns whose parent's sequence is not here
        for it, row in committed:
            self._turns.put(it)
            if self._local:
                self._remember(self._chains, (it.session_id, it.chain_hash), it.id)
            parent = b"" if it.parent_id is None else self._seqs.get(it.parent_id)
            if parent is None:
                unknown.append((it, row))
            else:
                sequences.append(self._extend(parent, it, row))
        if self._redis is None:
            return None  # the unknown ones are computed from SQL on first use
        # A conversation's next turn extends this one, not its parent, so with Redis (which holds every
        # sequence cached here, SEQ_TTL_S) the parents' copies leave this process: the cache then holds
        # about one sequence per live conversation instead of every turn of each (its bound filled in
        # about a minute of the 1,000-agent soak, ~36 MB). A retry or branch from a parent reads Redis.
        for it, _ in committed:
            if it.parent_id is not None:
                self._seqs.discard(it.parent_id)
        return self._publish_committed(jobs, committed, created, sequences, unknown)

    def _extend(self, parent: bytes, it: Interaction, row: dict[str, Any]) -> tuple[str, bytes]:
        """Cache the full sequence of a committed turn from its parent's; returns ``(turn id, sequence)``."""
        packed = parent + row["prompt_ids"] + row["output_ids"]
        self._seqs.put(it.id, packed)
        return it.id, packed

    async def _publish_committed(self, jobs: list[Any], committed: list[tuple[Interaction, dict[str, Any]]],
                                 created: list[dict[str, Any]], sequences: list[tuple[str, bytes]],
                                 unknown: list[tuple[Interaction, dict[str, Any]]]) -> None:
        redis = self._redis
        assert redis is not None
        chain = [(it.session_id, it.chain_hash, it.id) for it, _ in committed]
        # Nothing is awaited before this write: the callers are answered after it is on Redis's socket, so
        # their next command on this connection (a follow-up's lookup) comes after it.
        await redis.publish_turns(chain, sequences,
                                  sessions=[(row["key_hash"], session_from_row(row)) for row in created],
                                  extra=[entry for job in jobs for entry in job.publish],
                                  release=[entry for job in jobs for entry in job.release])
        # A branch from a turn whose copy already left this process: its parent's sequence is in Redis, and
        # the branch's own is cached after (until then, a follow-up of the branch reads SQL for it).
        missing = list(dict.fromkeys(it.parent_id for it, _ in unknown if it.parent_id is not None))
        if not missing:
            return
        fetched = await redis.seq_get_many(missing)
        later = [self._extend(fetched[it.parent_id], it, row) for it, row in unknown
                 if it.parent_id is not None and it.parent_id in fetched]
        if later:
            await redis.seq_put(later)

    async def get_interaction(self, *, interaction_id: str) -> Interaction:
        """One turn. NotFound if unknown."""
        i = schema.interactions
        async with self._read() as conn:
            row = (await conn.execute(sa.select(i).where(i.c.id == interaction_id))).mappings().first()
        if row is None:
            raise NotFound(f"unknown interaction {interaction_id}")
        return interaction_from_row(row)

    async def path(self, *, interaction_id: str) -> list[Interaction]:
        """The turns from the root down to ``interaction_id`` (root first): two queries whatever the depth
        (how ``previous_response_id`` recovers a conversation). NotFound if unknown."""
        i = schema.interactions
        async with self._read() as conn:
            ids = [row.id for row in (await conn.execute(_path_ids_sql(), {"id": interaction_id})).all()]
            if not ids:
                raise NotFound(f"unknown interaction {interaction_id}")
            rows = (await conn.execute(sa.select(i).where(i.c.id.in_(ids)))).mappings().all()
        by_id = {row["id"]: interaction_from_row(row) for row in rows}
        return [by_id[turn_id] for turn_id in ids]

    async def session_interactions(self, *, session_id: str) -> list[Interaction]:
        """Every turn of a session (the whole tree), parents before children, oldest first. NotFound if
        the session is unknown."""
        i = schema.interactions
        async with self._read() as conn:
            rows = (await conn.execute(sa.select(i).where(i.c.session_id == session_id))).mappings().all()
            if not rows:
                exists = (await conn.execute(sa.select(schema.sessions.c.id).where(schema.sessions.c.id == session_id))).first()
                if exists is None:
                    raise NotFound(f"unknown session {session_id}")
        return parents_first([interaction_from_row(row) for row in rows])

    async def session_tree_json(
        self, *, session_id: str, decode: Callable[[list[int]], str] | None = None
    ) -> dict[str, Any]:
        """The session and its turn tree as JSON for people and the UI (``GET /v1/sessions/{id}``).

        Shape: ``{"session": {...}, "roots": [node...], "num_interactions": int}`` where a node is
        ``{"id", "parent_id", "created_at", "request", "response_message", "finish_reason", "reward",
        "root_reason", "bridge_len", "prompt_tokens", "output_tokens", "versions": [min, max] | None,
        "timings", "children": [node...]}``; with ``decode``, nodes also carry ``prompt_text`` and
        ``output_text``. Token arrays themselves are summarised by length."""
        session = await self.get_session(session_id=session_id)
        return tree_json(session, await self.session_interactions(session_id=session_id), decode)

    # ---- rewards ----
    async def set_reward(
        self,
        *,
        reward: float,
        source: str,
        interaction_id: str | None = None,
        session_id: str | None = None,
    ) -> RewardRecord:
        """Set the reward of one turn (``interaction_id``) or of a session (``session_id``); exactly one.

        The value replaces any earlier one on that target; every call adds an audit row. InvalidValue for
        a non-finite value or both/neither target; NotFound for unknown ids; Conflict when the session is
        consumed."""
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise InvalidValue(f"reward must be a finite number, got {reward!r}")
        if (interaction_id is None) == (session_id is None):
            raise InvalidValue("give exactly one of interaction_id and session_id")
        s, i = schema.sessions, schema.interactions
        now = time.time()
        updated: SessionRecord | None = None
        key_hash = ""
        async with self._write_tx() as conn:
            if interaction_id is not None:
                found = (await conn.execute(sa.select(i.c.session_id).where(i.c.id == interaction_id))).first()
                if found is None:
                    raise NotFound(f"unknown interaction {interaction_id}")
                target_session: str = found.session_id
            else:
                assert session_id is not None
                target_session = session_id
            query = sa.select(s).where(s.c.id == target_session)
            query = self._backend.lock(query)
            row = (await conn.execute(query)).mappings().first()
            if row is None:
                raise NotFound(f"unknown session {target_session}")
            if row["status"] == "consumed":
                raise Conflict(f"session {target_session} was already consumed by training; its rewards are final")
            if interaction_id is not None:
                await conn.execute(sa.update(i).where(i.c.id == interaction_id).values(reward=float(reward)))
                # the session's version moves too: an exporter that read the turns before this reward
                # sees the change when it claims the session (claim_sessions(versions=...)) and re-reads
                await conn.execute(sa.update(s).where(s.c.id == target_session).values(version=row["version"] + 1))
                updated = session_from_row({**row, "version": row["version"] + 1})
                key_hash = row["key_hash"]
            else:
                values = {"reward": float(reward), "version": row["version"] + 1}
                await conn.execute(sa.update(s).where(s.c.id == target_session).values(**values))
                updated = session_from_row({**row, **values})
                key_hash = row["key_hash"]
            result = await conn.execute(
                sa.insert(schema.reward_events).values(
                    session_id=target_session,
                    interaction_id=interaction_id,
                    reward=float(reward),
                    source=source,
                    created_at=now,
                )
            )
            assert result.inserted_primary_key is not None
            event_id = int(result.inserted_primary_key[0])
        if interaction_id is not None:
            self._turns.set_reward(interaction_id, float(reward))
        self._sessions.pop(target_session, None)
        if updated is not None and self._redis is not None:
            await self._redis.put_session(key_hash, updated)
        return RewardRecord(
            id=event_id,
            session_id=target_session,
            interaction_id=interaction_id,
            reward=float(reward),
            source=source,
            created_at=now,
        )

    async def rewarded(self, *, session_ids: Collection[str]) -> set[str]:
        """The ids among ``session_ids`` with a session reward or any reward event (a query per
        ``MOVE_BATCH`` ids)."""
        ids = list(set(session_ids))
        s = schema.sessions
        found: set[str] = set()
        for start in range(0, len(ids), MOVE_BATCH):
            query = sa.select(s.c.id).where(s.c.id.in_(ids[start:start + MOVE_BATCH]), _is_rewarded())
            async with self._read() as conn:
                found.update(row[0] for row in (await conn.execute(query)).all())
        return found

    async def reward_history(
        self, *, session_id: str | None = None, interaction_id: str | None = None
    ) -> list[RewardRecord]:
        """The audit rows for a session (all its targets) or one turn, oldest first."""
        r = schema.reward_events
        query = sa.select(r).order_by(r.c.id)
        if session_id is not None:
            query = query.where(r.c.session_id == session_id)
        if interaction_id is not None:
            query = query.where(r.c.interaction_id == interaction_id)
        async with self._read() as conn:
            rows = (await conn.execute(query)).mappings().all()
        return [reward_from_row(row) for row in rows]


def _new_session_row(
    *, group_id: str | None, task_id: str | None, metadata: dict[str, Any] | None, session_id: str | None = None
) -> tuple[dict[str, Any], str]:
    """The SQL row of a new active session, and its plain api key (only its hash is stored)."""
    metadata = dict(metadata or {})
    sid = session_id or f"sess-{uuid.uuid4().hex}"
    api_key = f"sk-agentrl-{secrets.token_urlsafe(32)}"
    now = time.time()
    row = {"id": sid, "key_hash": hash_key(api_key), "group_id": group_id or sid, "task_id": task_id,
           "meta": metadata, "status": "active", "is_eval": metadata.get("eval") is True, "reward": None,
           "version": 0, "created_at": now, "finished_at": None, "last_activity_at": now}
    return row, api_key


def _is_rewarded() -> sa.ColumnElement[bool]:
    """A session row has a session reward or any reward event."""
    s, r = schema.sessions, schema.reward_events
    return sa.or_(s.c.reward.is_not(None), sa.exists(sa.select(r.c.id).where(r.c.session_id == s.c.id)))


def _status_update(status: str, now: float) -> dict[str, Any]:
    """:func:`_status_change` as SQL expressions, for one UPDATE of many rows (locked by the caller)."""
    s = schema.sessions
    values: dict[str, Any] = {"status": status, "version": s.c.version + 1}
    if status == "finished":
        values["finished_at"] = sa.func.coalesce(s.c.finished_at, now)
    return values


def _status_change(row: Mapping[Any, Any], status: str, now: float | None = None) -> dict[str, Any]:
    """Column values for moving a session row to ``status``: bump its version; stamp finished_at once."""
    values: dict[str, Any] = {"status": status, "version": row["version"] + 1}
    if status == "finished" and row["finished_at"] is None:
        values["finished_at"] = time.time() if now is None else now
    return values
