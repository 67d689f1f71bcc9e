"""Group commit: one background task writes the turns of many concurrent callers in one transaction.

Callers put a job (their rows) on a queue and await its future. The writer takes everything pending (up
to ``max_batch_rows``), checks it against the database inside one transaction (session still active,
parents known and in the same session, ids new), inserts the rows that pass, moves the sessions'
``last_activity_at``, commits, runs the after-commit hook (the process's caches) and only then resolves
the futures; the hook's Redis publish (the index other replicas read) is written to Redis's socket before
the callers resume, and its reply is awaited by the writer alone, before the next batch. There is no
timer on the fast path: while one transaction commits, the next batch gathers, so batches grow with load
and an idle store answers at once (``delay_s`` adds a wait if wanted).

On SQLite the whole transaction of a batch (``BEGIN IMMEDIATE``, the checks, the inserts, the activity
update, ``COMMIT``) is one call in the writer's own thread on its own ``sqlite3`` connection
(:class:`SqliteBatchWriter`): one hop off the event loop per batch, instead of a hop to aiosqlite's thread
(and a SQLAlchemy statement compilation) per statement. The stored values are those SQLAlchemy writes
(JSON columns through ``json.dumps``, token arrays as packed bytes). The store's other write transactions
take turns with it through SQLite's write lock (``busy_timeout``). On PostgreSQL the same transaction runs
on the writer's own ``asyncpg`` connection (:class:`PostgresBatchWriter`: constant statements, prepared
and planned once, ``= ANY($1)`` for the id lists), without SQLAlchemy's compilation and greenlet switch per
statement; it reconnects after the connection was lost. A batch whose jobs all pass (the usual case) is
written by one statement, one round trip without ``BEGIN`` and ``COMMIT`` (:data:`_PG_WRITE_ALL`); the
checks job by job in a transaction (:func:`_write_postgres`) run only when that statement declines.

A job is all-or-nothing. Jobs that fail the checks fail alone; if the batch transaction itself fails for
a data reason (a race the checks could not see), it is rolled back and retried job by job, so exactly the
offending callers get the error and no partial rows remain. If the database is unreachable, every job of
the batch fails with StoreUnavailable.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from gateway.store import schema
from gateway.store.dberrors import postgres_error, sqlite_error
from gateway.store.errors import Conflict, InvalidValue, NotFound, StoreError, StoreUnavailable
from gateway.store.records import CommitStats, Interaction

log = logging.getLogger(__name__)
T = TypeVar("T")

# what every SQLite connection of the store runs first (the SQLAlchemy engines too: gateway.store.api)
SQLITE_PRAGMAS = (
    "PRAGMA journal_mode=WAL",
    "PRAGMA foreign_keys=ON",
    "PRAGMA synchronous=NORMAL",  # durable across process crashes; WAL makes this safe
    "PRAGMA busy_timeout=10000",
)


# What every PostgreSQL connection of the store sets (the SQLAlchemy pool's and the writers' own): plan each
# statement for its parameters. asyncpg prepares statements, and after five executions PostgreSQL may keep
# one generic plan for the connection's life. Planned while the tables were small (a new database), it
# stayed as they grew, until the next ANALYZE: a sequential scan of `interactions` per group-commit batch,
# and the lifecycle tick's query as a nested loop, 17.6 s for one tick over 9,000 active sessions.
PG_SERVER_SETTINGS = {"plan_cache_mode": "force_custom_plan"}
# What the writers' own connections (the group commit's and the request path's one-statement writes) set
# instead: their statements are lookups by key (primary keys, ``= ANY($n)`` over arrays of keys), so one
# generic plan per connection serves every call, and no sequential scan may be chosen for it, whatever the
# tables' sizes when it was planned. Planning each call (force_custom_plan) cost 0.5 ms of the database's
# time per group-commit statement here, more than executing it (0.36 ms).
WRITER_SERVER_SETTINGS = {"plan_cache_mode": "force_generic_plan", "enable_seqscan": "off"}


@dataclass(slots=True)
class _Job:
    interactions: Sequence[Interaction]
    rows: list[dict[str, Any]]
    future: asyncio.Future[None]
    sessions: list[dict[str, Any]]  # session rows created with these turns (new implicit episodes)
    publish: Sequence[tuple[str, str, int]] = ()  # Redis (key, value, ttl) to set with the turns after commit
    release: Sequence[tuple[str, str]] = ()  # Redis sorted-set (key, member) to remove then (in-flight markers)


class GroupCommitWriter:
    """Batches ``submit`` calls into shared transactions (see the module docstring)."""

    def __init__(
        self,
        direct: SqliteBatchWriter | PostgresBatchWriter,
        *,
        max_batch_rows: int,
        delay_s: float,
        after_commit: Callable[[list[_Job]], Awaitable[None] | None],
    ) -> None:
        self._direct = direct
        self._max_rows = max(1, max_batch_rows)
        self._delay_s = delay_s
        self._after_commit = after_commit
        self._queue: list[_Job] = []
        self._wake = asyncio.Event()
        self._published = asyncio.Event()  # clear while an after-commit publish awaits its reply
        self._published.set()
        self._closing = False
        self.stats = CommitStats()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="store-group-commit")

    async def submit(self, interactions: Sequence[Interaction], rows: list[dict[str, Any]],
                     sessions: Sequence[dict[str, Any]] = (), publish: Sequence[tuple[str, str, int]] = (),
                     release: Sequence[tuple[str, str]] = ()) -> None:
        """Queue one job; return when it is committed (or raise its StoreError). ``sessions``: rows of
        sessions to create in the same transaction, before the turns (all or nothing with them);
        ``publish`` and ``release``: what the after-commit hook also sets and removes in Redis for this job."""
        if self._closing:
            raise StoreUnavailable("the store is closed")
        if self._task.done():
            raise StoreUnavailable("the store's commit writer has stopped; restart the process")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(_Job(interactions, rows, future, list(sessions), publish, release))
        self._wake.set()
        # shield: a caller that goes away (client disconnect) does not cancel a write already queued
        await asyncio.shield(future)

    async def published(self) -> None:
        """Return once the after-commit publish of the batches committed so far has its reply."""
        await self._published.wait()

    async def close(self) -> None:
        """Write what is queued, then stop."""
        self._closing = True
        self._wake.set()
        await self._task  # the connection is its backend's to close (gateway.store.backend)

    def _take_batch(self) -> list[_Job]:
        batch: list[_Job] = []
        rows = 0
        while self._queue and (not batch or rows + len(self._queue[0].rows) <= self._max_rows):
            job = self._queue.pop(0)
            batch.append(job)
            rows += len(job.rows)
        return batch

    async def _run(self) -> None:
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._delay_s > 0 and len(self._queue) < self._max_rows:
                await asyncio.sleep(self._delay_s)
            batch = self._take_batch()
            try:
                await self._commit(batch)
            except BaseException as exc:  # the writer must outlive any one batch; its callers get the error
                log.exception("group commit: unexpected failure of a batch of %d jobs", len(batch))
                for job in batch:
                    _fail(job, exc if isinstance(exc, Exception) else StoreUnavailable("writer cancelled"))
                if not isinstance(exc, Exception):
                    raise

    async def _commit(self, batch: list[_Job]) -> None:
        try:
            committed = await self._write(batch)
        except (Conflict, InvalidValue, NotFound) as exc:
            if len(batch) == 1:
                self.stats.transactions += 1
                _fail(batch[0], exc)
                self.stats.failed_calls += 1
                return
            self.stats.retried_batches += 1
            log.warning("group commit: batch of %d jobs failed (%s); retrying one by one", len(batch), exc)
            committed = []
            for job in batch:
                try:
                    committed += await self._write([job])
                except StoreError as job_exc:
                    _fail(job, job_exc)
                    self.stats.failed_calls += 1
        except StoreError as exc:
            self.stats.transactions += 1
            for job in batch:
                _fail(job, exc)
            self.stats.failed_calls += len(batch)
            return
        publish: Awaitable[None] | None = None
        if committed:
            try:
                publish = self._after_commit(committed)
            except Exception:  # caches only; the rows are durable, so the callers still succeed
                log.exception("group commit: after-commit hook failed")
        for job in committed:
            if not job.future.done():
                job.future.set_result(None)
        self.stats.calls += len(committed)
        self.stats.rows += sum(len(job.rows) for job in committed)
        self.stats.max_batch_calls = max(self.stats.max_batch_calls, len(committed))
        if publish is not None:
            # Awaited here, before the next batch: its first step (up to the Redis command's write) runs
            # now, before the callers resume, and its reply is waited for by this task alone.
            self._published.clear()
            try:
                await publish
            except Exception:  # caches only, as above
                log.exception("group commit: after-commit publish failed")
            finally:
                self._published.set()

    async def _write(self, batch: list[_Job]) -> list[_Job]:
        """One transaction for ``batch`` on the backend's own connection. Jobs failing the checks are
        failed here and left out; returns the committed jobs. Raises StoreError when the transaction as a
        whole fails."""
        self.stats.transactions += 1
        failed = await self._direct.write(batch)
        for index, error in failed:
            _fail(batch[index], error)
        self.stats.failed_calls += len(failed)
        bad = {index for index, _ in failed}
        return [job for index, job in enumerate(batch) if index not in bad]


class SqliteBatchWriter:
    """The SQLite group commit's own ``sqlite3`` connection and thread: :meth:`run` executes a function on
    the connection inside ``BEGIN IMMEDIATE`` ... ``COMMIT``, in one hop off the event loop."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None
        # its own thread fed by a SimpleQueue, answering through call_soon_threadsafe: a hop costs less
        # Python than a ThreadPoolExecutor's (a concurrent Future with its Condition, chained to an asyncio one)
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future[Any]]
                                      | None] = queue.SimpleQueue()
        self._closed = False  # set by close(): no job is queued after it (nobody would run it)
        self._thread = threading.Thread(target=self._serve, name="agentrl-sqlite-writer", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._fail_pending()
                return
            call, loop, future = job
            try:
                result, error = call(), None
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(_resolve, future, result, error)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def _fail_pending(self) -> None:
        """Fail the jobs still queued once the thread stops (a race with close): their callers get an
        error instead of waiting forever."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:
                continue
            _, loop, future = job
            try:
                loop.call_soon_threadsafe(_resolve, future, None, StoreUnavailable("the store is closed"))
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def _submit(self, call: Callable[[], T]) -> asyncio.Future[T]:
        if self._closed:
            raise StoreUnavailable("the store is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((call, loop, future))
        return future

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=10.0)
            for pragma in SQLITE_PRAGMAS:
                conn.execute(pragma)
            self._conn = conn
        return self._conn

    async def write(self, batch: list[_Job]) -> list[tuple[int, StoreError]]:
        """One batch of the group commit (its failed jobs' indexes and errors; the rest is committed)."""
        return await self.run(lambda conn: _write_sqlite(conn, batch))

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn(conn)`` in one write transaction, committed if it returns; rolled back if it raises.
        sqlite3 errors (and values SQLite or JSON cannot take) are raised as StoreError. The transaction
        runs to its end in the writer's thread even if the awaiting task is cancelled."""
        return await self._submit(lambda: self._transaction(fn))

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn(conn)`` outside a transaction (one SELECT reads one consistent snapshot): a read on the
        request's path in one hop off the loop, without SQLAlchemy's per-statement Python. It waits behind
        the jobs queued before it; sqlite3 errors are raised as StoreError."""
        return await self._submit(lambda: self._read(fn))

    def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        try:
            return fn(self._connection())
        except sqlite3.Error as exc:
            translated = sqlite_error(exc)
            if translated is None:  # a bug (ProgrammingError): as it is
                raise
            raise translated from exc

    def _transaction(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        try:
            conn = self._connection()
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise sqlite_error(exc) from exc
        try:
            result = fn(conn)
            conn.execute("COMMIT")
        except BaseException as exc:
            if conn.in_transaction:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    log.exception("SQLite writer: rollback failed")
            if isinstance(exc, (sqlite3.Error, TypeError, ValueError, OverflowError)) and not isinstance(
                    exc, StoreError):
                translated = sqlite_error(exc)
                if translated is not None:
                    raise translated from exc
            raise
        return result

    async def close(self) -> None:
        """Run the jobs queued so far, close the connection and stop the thread; later calls raise
        StoreUnavailable at once. Idempotent."""
        def close() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        if self._closed:
            return
        if self._thread.is_alive():
            future = self._submit(close)
            self._closed = True  # nothing queued after the close job (it would reopen the connection)
            self._jobs.put(None)
            await future
        else:
            self._closed = True
            self._fail_pending()


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():  # the caller went away; the transaction ran to its end anyway
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class PostgresBatchWriter:
    """The PostgreSQL group commit's own ``asyncpg`` connection (opened on first use, and again after it
    was lost), opened with the arguments SQLAlchemy's asyncpg dialect gives ``asyncpg.connect`` for the
    same URL (:meth:`for_engine`): URL options such as ``?ssl=require`` are keywords of ``asyncpg.connect``
    there, not server settings."""

    def __init__(self, connect_args: Sequence[Any] = (), connect_kwargs: dict[str, Any] | None = None) -> None:
        import asyncpg

        kwargs = dict(connect_kwargs or {})
        # what SQLAlchemy's asyncpg adapter takes for itself before calling asyncpg.connect (its own
        # prepared-statement cache and naming; this writer uses asyncpg's statement cache directly)
        self._creator: Callable[..., Awaitable[Any]] = kwargs.pop("async_creator_fn", None) or asyncpg.connect
        kwargs.pop("prepared_statement_cache_size", None)
        kwargs.pop("prepared_statement_name_func", None)
        kwargs.setdefault("timeout", 10)
        kwargs["server_settings"] = {**PG_SERVER_SETTINGS, **WRITER_SERVER_SETTINGS,
                                     **(kwargs.get("server_settings") or {})}
        self._args = list(connect_args)
        self._kwargs = kwargs
        self._conn: Any = None
        self._turn = asyncio.Lock()  # fetchrow's callers (the group commit has one caller: its task)
        self.checked_batches = 0  # batches the one-statement write did not take (written by the checks)

    @classmethod
    def for_engine(cls, engine: Any, connect_args: dict[str, Any] | None = None) -> PostgresBatchWriter:
        """A writer connecting as ``engine`` (a ``postgresql+asyncpg`` engine) does: the dialect's
        ``create_connect_args`` for its URL, updated with the ``connect_args`` it was created with."""
        args, kwargs = engine.dialect.create_connect_args(engine.url)
        return cls(args, {**kwargs, **(connect_args or {})})

    async def _connect(self) -> Any:
        """A new connection; any failure to get one is StoreUnavailable (a 503), whatever the server or the
        driver said (a refused option, TLS, authentication, an unreachable host)."""
        try:
            return await self._creator(*self._args, **self._kwargs)
        except Exception as exc:
            raise StoreUnavailable(f"database unavailable: cannot connect: {type(exc).__name__}: {exc}") from exc

    async def write(self, batch: list[_Job]) -> list[tuple[int, StoreError]]:
        """One batch of the group commit in one transaction (its failed jobs' indexes and errors; the rest
        is committed). Database errors are raised as StoreError.

        First as one statement (:data:`_PG_WRITE_ALL`: one round trip, no ``BEGIN``/``COMMIT``), which
        writes the batch only if every job passes; if one does not (or the database refuses a row), nothing
        of that statement was written and the batch goes through the checks job by job in a transaction
        (:func:`_write_postgres`), which says which job failed and why."""
        try:
            args = _write_all_args(batch)
        except (TypeError, ValueError, OverflowError):  # a value that cannot be written: said below, per job
            args = None
        if args is not None:
            try:
                if await self._on_connection(lambda conn: conn.fetchval(_PG_WRITE_ALL, *args)):
                    return []
            except (Conflict, NotFound, InvalidValue):
                pass  # the transaction below finds the job it was, and fails only that one
        self.checked_batches += 1

        async def in_transaction(conn: Any) -> list[tuple[int, StoreError]]:
            async with conn.transaction():
                return await _write_postgres(conn, batch)

        return await self._on_connection(in_transaction)

    async def fetchrow(self, sql: str, *args: Any, timeout_s: float = 30.0) -> Any:
        """One statement in autocommit, its first row (callers take turns on the connection). Database
        errors are raised as StoreError; a statement cut off (timeout, cancelled) drops the connection."""
        async with self._turn:
            return await self._on_connection(lambda conn: conn.fetchrow(sql, *args, timeout=timeout_s))

    async def _on_connection(self, work: Callable[[Any], Awaitable[T]]) -> T:
        """``work(conn)`` on the connection, opened first if needed; errors translated as in ``write``."""
        try:
            if self._conn is None or self._conn.is_closed():
                self._conn = None
                self._conn = await self._connect()
            return await work(self._conn)
        except Exception as exc:
            if isinstance(exc, StoreError):
                raise
            error = postgres_error(exc)
            if error is None and (self._conn is None or self._conn.is_closed()):
                # whatever was raised, the connection is gone: an outage, not a bug in this batch
                error = StoreUnavailable(f"database unavailable: connection lost: {type(exc).__name__}: {exc}")
            if error is None:
                raise
            if isinstance(error, StoreUnavailable):
                self._drop()
            raise error from exc
        except BaseException:  # cancelled mid-transaction: the connection's state is unknown
            self._drop()
            raise

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.terminate()
            self._conn = None

    async def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            try:
                await conn.close(timeout=5)
            except Exception:  # noqa: BLE001 - closing a broken connection
                conn.terminate()


def _insert(table: sa.Table, mark: Callable[[int, sa.Column[Any]], str], source: str = "VALUES ({})"
            ) -> tuple[str, list[tuple[str, bool]]]:
    """``INSERT`` of every column of ``table``, the values from ``source`` filled with each column's
    ``mark(index, column)`` (a placeholder), and the row keys in that order with whether the column holds
    JSON (what :func:`_values` takes)."""
    names = ", ".join(f'"{c.name}"' for c in table.columns)
    marks = ", ".join(mark(k, c) for k, c in enumerate(table.columns))
    keys = [(c.key, isinstance(c.type, sa.JSON)) for c in table.columns]
    return f'INSERT INTO "{table.name}" ({names}) {source.format(marks)}', keys


_PG_INSERT_SESSION = _insert(schema.sessions, lambda k, _: f"${k + 1}")
_PG_INSERT_INTERACTION = _insert(schema.interactions, lambda k, _: f"${k + 1}")


# the batch's checks in one statement: its sessions' status, locked in id order (FOR UPDATE, so no
# deadlocks), and which of its turns' ids and parents' ids exist, in which session
_PG_CHECK = (
    "WITH s AS (SELECT id, status FROM sessions WHERE id = ANY($1::varchar[]) ORDER BY id FOR UPDATE) "
    "SELECT 's', id, status FROM s UNION ALL "
    "SELECT 'i', id, session_id FROM interactions WHERE id = ANY($2::varchar[])")


def _pg_unnest(table: sa.Table, first: int) -> tuple[str, list[tuple[str, bool]]]:
    """:func:`_insert` from one array parameter per column (``unnest``, numbered from ``$first``)."""
    return _insert(table, lambda k, c: f"${first + k}::{c.type.compile(dialect=postgresql.dialect())}[]",
                   "SELECT * FROM unnest({})")


_PG_UNNEST_SESSION = _pg_unnest(schema.sessions, 5)
_PG_UNNEST_INTERACTION = _pg_unnest(schema.interactions, 5 + len(schema.sessions.columns))

# The whole batch in one statement, when every job passes the checks of _write_postgres (which is what
# nearly always happens): the batch's existing sessions ($1) locked and all active, and the parents it does
# not create itself ($2, in sessions $3) in the database, in the same sessions; then the new sessions, the
# turns and the sessions' last activity ($4) are written. Otherwise it writes nothing and returns false.
# One statement is one transaction and sees one snapshot: a parent committed by another process after it
# began is not seen (false: the transaction path reads it), and what the database guarantees itself
# (unique ids and key hashes, existing sessions and parents) is refused with an error (the same path then
# says which job it was). A status changed meanwhile is seen: FOR UPDATE reads the newest row.
_PG_WRITE_ALL = (
    "WITH locked AS (SELECT id, status FROM sessions WHERE id = ANY($1::varchar[]) ORDER BY id FOR UPDATE), "
    "found AS MATERIALIZED (SELECT id, session_id FROM interactions WHERE id = ANY($2::varchar[])), "
    "verdict AS (SELECT (SELECT count(*) FROM locked WHERE status = 'active') = cardinality($1::varchar[]) "
    "AND (SELECT count(*) FROM found JOIN unnest($2::varchar[], $3::varchar[]) AS p(id, session_id) "
    "ON found.id = p.id AND found.session_id = p.session_id) = cardinality($2::varchar[]) AS pass), "
    f"new_sessions AS ({_PG_UNNEST_SESSION[0]} WHERE (SELECT pass FROM verdict)), "
    f"new_turns AS ({_PG_UNNEST_INTERACTION[0]} WHERE (SELECT pass FROM verdict)), "
    "touched AS (UPDATE sessions SET last_activity_at = $4 WHERE id = ANY($1::varchar[]) "
    "AND (SELECT pass FROM verdict)) "
    "SELECT pass FROM verdict")


def _write_all_args(batch: list[_Job]) -> list[Any] | None:
    """The parameters of :data:`_PG_WRITE_ALL` for ``batch``, or None when the batch itself shows that a
    job fails (a turn id twice, a parent in another session, a new session that is not active): then only
    the checks job by job can say which."""
    created = {row["id"]: row for job in batch for row in job.sessions}
    if any(row["status"] != "active" for row in created.values()):
        return None
    produced: dict[str, str] = {}
    parents: dict[str, str] = {}
    for job in batch:
        for it in job.interactions:
            if it.id in produced:
                return None
            if it.parent_id is not None:
                session = produced.get(it.parent_id) or parents.setdefault(it.parent_id, it.session_id)
                if session != it.session_id:
                    return None
            produced[it.id] = it.session_id
    rows = [row for job in batch for row in job.rows]
    if not rows:
        return None
    existing = sorted(set(produced.values()) - created.keys())
    return [existing, list(parents), list(parents.values()), time.time(),
            *_columns_of(list(created.values()), _PG_UNNEST_SESSION[1]),
            *_columns_of(rows, _PG_UNNEST_INTERACTION[1])]


def _columns_of(rows: list[dict[str, Any]], keys: list[tuple[str, bool]]) -> list[list[Any]]:
    """``rows`` as one list per column (``unnest``'s arrays), values as :func:`_values` writes them."""
    values = _values(rows, keys)
    return [[value[k] for value in values] for k in range(len(keys))]


async def _write_postgres(conn: Any, batch: list[_Job]) -> list[tuple[int, StoreError]]:
    """:func:`_write_sqlite` on an ``asyncpg`` connection (inside its transaction); the sessions' rows are
    locked (``FOR UPDATE``, in id order, so no deadlocks) against concurrent status changes."""
    session_ids = sorted({it.session_id for job in batch for it in job.interactions})
    wanted = list({it.id for job in batch for it in job.interactions}
                  | {it.parent_id for job in batch for it in job.interactions if it.parent_id})
    status: dict[str, str] = {}
    known: dict[str, str] = {}
    for kind, key, value in await conn.fetch(_PG_CHECK, session_ids, wanted):  # one round trip for both
        (status if kind == "s" else known)[key] = value
    for job in batch:
        status.update({row["id"]: row["status"] for row in job.sessions if row["id"] not in status})
    failed, ok = _checked(batch, status, known)
    created = [row for job in ok for row in job.sessions]
    if created:
        await conn.executemany(_PG_INSERT_SESSION[0], _values(created, _PG_INSERT_SESSION[1]))
    if ok:
        await conn.executemany(_PG_INSERT_INTERACTION[0], _values([row for job in ok for row in job.rows],
                                                                  _PG_INSERT_INTERACTION[1]))
        touched = sorted({it.session_id for job in ok for it in job.interactions} - {row["id"] for row in created})
        if touched:
            await conn.execute("UPDATE sessions SET last_activity_at = $1 WHERE id = ANY($2::varchar[])",
                               time.time(), touched)
    return failed


def _checked(batch: list[_Job], status: dict[str, str], known: dict[str, str]
             ) -> tuple[list[tuple[int, StoreError]], list[_Job]]:
    """The batch's jobs that fail the checks (index, error) and those that pass, in order (a passing job's
    turns may be the parents of later jobs' turns)."""
    failed: list[tuple[int, StoreError]] = []
    ok: list[_Job] = []
    for index, job in enumerate(batch):
        error = _job_error(job, status, known)
        if error is not None:
            failed.append((index, error))
            continue
        ok.append(job)
        for it in job.interactions:
            known[it.id] = it.session_id
    return failed, ok


_INSERT_SESSION = _insert(schema.sessions, lambda *_: "?")
_INSERT_INTERACTION = _insert(schema.interactions, lambda *_: "?")


def _values(rows: list[dict[str, Any]], keys: list[tuple[str, bool]]) -> list[tuple[Any, ...]]:
    # JSON as SQLAlchemy's JSON type writes it on SQLite (json.dumps; None as 'null')
    return [tuple(json.dumps(row[key]) if is_json else row[key] for key, is_json in keys) for row in rows]


def _marks(n: int) -> str:
    return ", ".join("?" * n)


def _write_sqlite(conn: sqlite3.Connection, batch: list[_Job]) -> list[tuple[int, StoreError]]:
    """The group commit's checks and writes on the SQLite writer's connection (inside its transaction):
    each job's sessions active, its turns' ids new, its parents known and in the same session. Returns the failed jobs' indexes with
    their errors; the others are written."""
    session_ids = sorted({it.session_id for job in batch for it in job.interactions})
    status: dict[str, str] = dict(conn.execute(
        f"SELECT id, status FROM sessions WHERE id IN ({_marks(len(session_ids))})", session_ids).fetchall())
    for job in batch:
        status.update({row["id"]: row["status"] for row in job.sessions if row["id"] not in status})
    wanted = list({it.id for job in batch for it in job.interactions}
                  | {it.parent_id for job in batch for it in job.interactions if it.parent_id})
    known: dict[str, str] = dict(conn.execute(
        f"SELECT id, session_id FROM interactions WHERE id IN ({_marks(len(wanted))})", wanted).fetchall())
    failed, ok = _checked(batch, status, known)
    created = [row for job in ok for row in job.sessions]
    if created:
        conn.executemany(_INSERT_SESSION[0], _values(created, _INSERT_SESSION[1]))
    if ok:
        conn.executemany(_INSERT_INTERACTION[0], _values([row for job in ok for row in job.rows],
                                                         _INSERT_INTERACTION[1]))
        touched = sorted({it.session_id for job in ok for it in job.interactions} - {row["id"] for row in created})
        if touched:
            conn.execute(f"UPDATE sessions SET last_activity_at = ? WHERE id IN ({_marks(len(touched))})",
                         [time.time(), *touched])
    return failed


def _job_error(job: _Job, status: dict[str, str], known: dict[str, str]) -> StoreError | None:
    seen: dict[str, str] = {}
    for it in job.interactions:
        state = status.get(it.session_id)
        if state is None:
            return NotFound(f"unknown session {it.session_id}")
        if state != "active":
            return Conflict(f"session {it.session_id} is {state}; it takes no more turns")
        if it.id in known or it.id in seen:
            return Conflict(f"interaction {it.id} already exists")
        if it.parent_id is not None:
            parent_session = seen.get(it.parent_id) or known.get(it.parent_id)
            if parent_session is None:
                return NotFound(f"unknown parent interaction {it.parent_id}")
            if parent_session != it.session_id:
                return Conflict(f"parent {it.parent_id} belongs to another session than {it.session_id}")
        seen[it.id] = it.session_id
    return None


def _fail(job: _Job, exc: BaseException) -> None:
    if not job.future.done():
        job.future.set_exception(exc)
        job.future.exception()  # mark retrieved: a caller that went away must not trigger a warning
