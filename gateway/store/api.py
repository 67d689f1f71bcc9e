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

from collections import OrderedDict
from contextlib import AbstractAsyncContextManager
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gateway.store.backend import Backend, open_backend
from gateway.store.errors import StoreUnavailable
from gateway.store.records import (
    SESSION_STATUSES,
    CommitStats,
    FinishReason,
    GroupRecord,
    Interaction,
    ParentMatch,
    RewardRecord,
    SessionRecord,
    SessionStatus,
)
from gateway.store.redis_state import Continued, Marker, RedisState
from gateway.store.rewards import RewardsPart
from gateway.store.rows import hash_key
from gateway.store.seqcache import SequenceCache, TurnCache
from gateway.store.sessions import SessionsPart
from gateway.store.turns import TurnsPart
from gateway.store.writer import GroupCommitWriter

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
    "hash_key",
]


class Store(SessionsPart, TurnsPart, RewardsPart):
    """The durable conversation store. Create with ``await Store.open(...)``; one per process.

    One class for callers, in parts of one concept each: sessions and groups
    (:class:`~gateway.store.sessions.SessionsPart`), turns (:class:`~gateway.store.turns.TurnsPart`),
    rewards (:class:`~gateway.store.rewards.RewardsPart`) over the caches they share
    (:class:`~gateway.store.caches.CachesPart`); this module opens, closes and exposes the backend."""

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

    async def close(self) -> None:
        """Flush pending writes, stop the writer, dispose of connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._writer.close()  # its last batch first; the backend closes the connection under it
        if self._redis is not None:
            await self._redis.close()
        await self._backend.close()

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

