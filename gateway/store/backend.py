"""The database backend: everything that differs between SQLite and PostgreSQL, in one object per dialect.

A backend owns its SQLAlchemy engines (a read pool and the engine other store modules write through), the
group commit's own connection (``writer``: :class:`~gateway.store.writer.SqliteBatchWriter` or
:class:`~gateway.store.writer.PostgresBatchWriter`), the staleness budget's one-statement admission, the
translation of its driver's errors into the store's error tree, and the row locks it takes. Nobody outside
``gateway/store/`` asks which database it is: a query that must lock the rows it reads says
``backend.lock(query)``; an admission says ``backend.admit(n)``. Adding a database is one more subclass
here (and its writer), not a branch in every module that touches SQL.

    backend = await open_backend("postgresql+asyncpg://postgres@127.0.0.1/agentrl")
    async with backend.slot(), backend.write_engine.begin() as conn:
        row = (await conn.execute(backend.lock(sa.select(sessions).where(...)))).first()
    counted, state = await backend.admit(n=2)      # the trainer_state row's UPDATE, in one statement

The tables are ``gateway.store.schema`` (one ``MetaData`` for the store, the trajectory queue and the
staleness budget).
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager, nullcontext
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import QueuePool

from gateway.store import schema
from gateway.store.dberrors import db_errors, postgres_error, sqlite_error, translate
from gateway.store.errors import InvalidValue, StoreError, StoreUnavailable
from gateway.store.gate import ConnectionGate
from gateway.store.migrate import upgrade as alembic_upgrade
from gateway.store.writer import PG_SERVER_SETTINGS, SQLITE_PRAGMAS, PostgresBatchWriter, SqliteBatchWriter

Q = TypeVar("Q", bound=sa.Select[Any])

_UNGATED_CONNECTIONS = 2  # of the PostgreSQL pool, for users of ``Store.engine`` that do not take a slot
TRAINER_ROW = 1  # the one row of ``trainer_state``

# The staleness budget's admission (gateway.staleness): count ``n`` sessions if they fit the trainer's
# window. The UPDATE is the same on both databases; PostgreSQL also reads the state as it was before it in
# the same statement (what a refusal reports; the UPDATE did nothing then), and READ COMMITTED re-checks
# the UPDATE's condition after waiting for a concurrent admission's row lock.
_LIMIT = "(staleness_bound + version - base_version + 1) * batch_size * group_size"
_STATE_COLUMNS = "version, batch_size, staleness_bound, group_size, base_version, admitted"
_ADMIT_PG = (
    f"WITH upd AS (UPDATE trainer_state SET admitted = admitted + $1 WHERE id = $2 AND admitted + $1 <= {_LIMIT} "
    "RETURNING id) SELECT (SELECT count(*) FROM upd) AS done, t.version, t.batch_size, t.staleness_bound, "
    "t.group_size, t.base_version, t.admitted FROM (SELECT 1) AS one LEFT JOIN trainer_state AS t ON t.id = $2")
_ADMIT_SQLITE = f"UPDATE trainer_state SET admitted = admitted + ? WHERE id = ? AND admitted + ? <= {_LIMIT}"
_RELEASE_SQLITE = "UPDATE trainer_state SET admitted = CASE WHEN admitted >= ? THEN admitted - ? ELSE 0 END WHERE id = ?"

# a state row of trainer_state: (version, batch_size, staleness_bound, group_size, base_version, admitted)
StateRow = tuple[int, int, int, int, int, int]


class Backend:
    """What the store needs of a database; see the module docstring. Build with :func:`open_backend`."""

    name: str  # SQLAlchemy's dialect name: "sqlite" or "postgresql"

    def __init__(self, engine: AsyncEngine, write_engine: AsyncEngine,
                 writer: SqliteBatchWriter | PostgresBatchWriter) -> None:
        self.engine = engine  # reads
        # writes of other store modules (and the trajectory queue's and the staleness budget's tables)
        self.write_engine = write_engine
        self.writer = writer  # the group commit's own connection (gateway.store.writer)

    # ------------------------------------------------------------------ what differs by dialect
    def lock(self, query: Q, *, skip_locked: bool = False) -> Q:
        """``query`` taking row locks on what it reads (``FOR UPDATE``, skipping rows locked by others with
        ``skip_locked``) where the database has them; as it is where one writer at a time is the lock."""
        return query

    def slot(self) -> AbstractAsyncContextManager[None]:
        """Hold one of the pool's connections in arrival order for the block (``gateway.store.gate``);
        for users of :attr:`write_engine` on a request's path."""
        return nullcontext()

    def translate(self, exc: BaseException) -> StoreError | None:
        """The store error for an exception of this backend's driver (its own connections' or SQLAlchemy's
        around it), or None for a bug."""
        return translate(exc)

    async def admit(self, n: int) -> tuple[bool, StateRow | None]:
        """Count ``n`` sessions against the staleness budget in one statement if they fit: ``(True, _)``;
        else ``(False, state)`` with the trainer's state row (None: no trainer registered). StoreError when
        the database fails. Runs to its end once started (the caller shields it)."""
        raise NotImplementedError

    async def release(self, n: int) -> None:
        """Give back ``n`` sessions of the staleness budget (never below 0)."""
        t = schema.trainer_state
        async with self.slot(), db_errors(), self.write_engine.begin() as conn:
            await conn.execute(t.update().where(t.c.id == TRAINER_ROW)
                               .values(admitted=sa.case((t.c.admitted >= n, t.c.admitted - n), else_=0)))

    async def session_row_by_key(self, key_hash: str) -> Mapping[str, Any] | None:
        """The sessions row of ``key_hash`` (column keys, JSON decoded), or None: the named-session turn's
        read of its own record. StoreError when the database fails."""
        s = schema.sessions
        async with self.slot(), db_errors(), self.engine.connect() as conn:
            return (await conn.execute(sa.select(s).where(s.c.key_hash == key_hash))).mappings().first()

    async def close(self) -> None:
        await self.writer.close()
        for engine in {id(e): e for e in (self.engine, self.write_engine)}.values():
            await engine.dispose()


class SqliteBackend(Backend):
    """One file; one writer at a time. Writes go through one connection that opens every transaction with
    ``BEGIN IMMEDIATE`` (:attr:`write_engine`, pool of one) and through the group commit's own ``sqlite3``
    connection and thread (:attr:`writer`), which also runs the hot path's admission and key lookups in one
    hop off the event loop, without SQLAlchemy's per-statement Python."""

    name = "sqlite"
    writer: SqliteBatchWriter

    def __init__(self, engine: AsyncEngine, write_engine: AsyncEngine) -> None:
        super().__init__(engine, write_engine, SqliteBatchWriter(os.path.abspath(str(write_engine.url.database))))

    def translate(self, exc: BaseException) -> StoreError | None:
        return sqlite_error(exc) if isinstance(exc, sqlite3.Error) else translate(exc)

    async def admit(self, n: int) -> tuple[bool, StateRow | None]:
        def admit(conn: sqlite3.Connection) -> tuple[bool, StateRow | None]:
            if conn.execute(_ADMIT_SQLITE, (n, TRAINER_ROW, n)).rowcount:
                return True, None
            row = conn.execute(f"SELECT {_STATE_COLUMNS} FROM trainer_state WHERE id = ?", (TRAINER_ROW,)).fetchone()
            return False, tuple(row) if row is not None else None  # type: ignore[return-value]

        return await self.writer.run(admit)

    async def release(self, n: int) -> None:
        await self.writer.run(lambda conn: conn.execute(_RELEASE_SQLITE, (n, n, TRAINER_ROW)))

    async def session_row_by_key(self, key_hash: str) -> Mapping[str, Any] | None:
        # every turn of a named session on SQLite reads its record here: on the writer's own sqlite3
        # connection it costs one hop and a prepared SELECT instead of SQLAlchemy's Python and aiosqlite's
        # thread (not cached in the process: another process may finish the session)
        return await self.writer.read(lambda conn: _sqlite_session_row(conn, key_hash))


class PostgresBackend(Backend):
    """A shared pool (callers wait their turn for its connections at :attr:`gate`), row locks, and two
    ``asyncpg`` connections of the store's own: the group commit's (:attr:`writer`) and one for the
    one-statement writes of a request's path (:attr:`statements`: the staleness admission), without the
    pool's checkout and SQLAlchemy's statement machinery."""

    name = "postgresql"
    writer: PostgresBatchWriter

    def __init__(self, engine: AsyncEngine) -> None:
        # the writers connect with the asyncpg arguments SQLAlchemy derives from the same URL
        super().__init__(engine, engine, PostgresBatchWriter.for_engine(engine))
        self.statements = PostgresBatchWriter.for_engine(engine)
        # callers wait their turn for the pool's connections instead of failing after its 30 s timeout; a
        # few connections stay outside the gate for background users of ``write_engine``
        pool = engine.pool
        self.gate = (ConnectionGate(pool.size() + max(0, pool._max_overflow) - _UNGATED_CONNECTIONS)  # noqa: SLF001
                     if isinstance(pool, QueuePool) else None)

    def lock(self, query: Q, *, skip_locked: bool = False) -> Q:
        return query.with_for_update(skip_locked=skip_locked)

    def slot(self) -> AbstractAsyncContextManager[None]:
        return self.gate.slot() if self.gate is not None else nullcontext()

    def translate(self, exc: BaseException) -> StoreError | None:
        return postgres_error(exc)

    async def admit(self, n: int) -> tuple[bool, StateRow | None]:
        row = await self.statements.fetchrow(_ADMIT_PG, n, TRAINER_ROW)
        if row["done"]:
            return True, None
        if row["version"] is None:
            return False, None
        return False, (row["version"], row["batch_size"], row["staleness_bound"], row["group_size"],
                       row["base_version"], row["admitted"])

    async def close(self) -> None:
        await self.statements.close()
        await super().close()


async def open_backend(db_url: str, *, migrate: bool = True) -> Backend:
    """Connect to ``db_url`` (``sqlite+aiosqlite:///PATH`` with WAL and foreign keys on, or
    ``postgresql+asyncpg://...``; ``sqlite://`` and ``postgresql://`` get the async driver) and run
    ``alembic upgrade head`` unless ``migrate=False``. InvalidValue for another database or an in-memory
    SQLite; StoreUnavailable when it cannot be reached or has no tables."""
    url = make_url(db_url)
    backend = url.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise InvalidValue(f"unsupported database URL {db_url!r}: use sqlite+aiosqlite:///PATH or postgresql+asyncpg://...")
    if backend == "sqlite":
        if url.drivername != "sqlite+aiosqlite":
            url = url.set(drivername="sqlite+aiosqlite")
        if not url.database or url.database == ":memory:":
            raise InvalidValue("SQLite needs a file path (sqlite+aiosqlite:///PATH); in-memory databases are not shared between connections")
        Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    elif url.drivername != "postgresql+asyncpg":
        url = url.set(drivername="postgresql+asyncpg")
    if migrate:
        async with db_errors():
            await alembic_upgrade(url.render_as_string(hide_password=False))
    if backend == "sqlite":
        engine = create_async_engine(url)
        # one writer connection: SQLite allows one writer at a time anyway, and waiting for the pool is
        # cheaper than polling the file lock
        write_engine = create_async_engine(url, pool_size=1, max_overflow=0)
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        event.listen(write_engine.sync_engine, "connect", _sqlite_pragmas_autobegin_off)
        event.listen(write_engine.sync_engine, "begin", _sqlite_begin_immediate)
        engines = (engine, write_engine)
    else:
        engine = write_engine = create_async_engine(url, pool_size=10, max_overflow=20,
                                                    connect_args={"server_settings": PG_SERVER_SETTINGS})
        engines = (engine,)
    try:
        async with db_errors(), engine.connect() as conn:
            await conn.execute(sa.select(schema.sessions.c.id).limit(1))
    except StoreUnavailable:
        await _dispose(*engines)
        raise
    except sa_exc.ProgrammingError as exc:  # PostgreSQL without the tables (migrate=False)
        await _dispose(*engines)
        raise StoreUnavailable(f"the store's tables are missing; run `alembic upgrade head`: {exc.orig}") from exc
    return SqliteBackend(engine, write_engine) if backend == "sqlite" else PostgresBackend(engine)


async def _dispose(*engines: AsyncEngine) -> None:
    for engine in engines:
        await engine.dispose()


_SESSION_COLUMNS = [(c.key, c.name, isinstance(c.type, sa.JSON)) for c in schema.sessions.columns]
_SELECT_SESSION_BY_KEY = (f"SELECT {', '.join(name for _, name, _ in _SESSION_COLUMNS)} FROM sessions "
                          "WHERE key_hash = ?")


def _sqlite_session_row(conn: sqlite3.Connection, key_hash: str) -> dict[str, Any] | None:
    """The sessions row of ``key_hash`` as SQLAlchemy maps it (column keys; JSON decoded), or None."""
    values = conn.execute(_SELECT_SESSION_BY_KEY, (key_hash,)).fetchone()
    if values is None:
        return None
    return {key: json.loads(value) if is_json and value is not None else value
            for (key, _, is_json), value in zip(_SESSION_COLUMNS, values)}


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    for pragma in SQLITE_PRAGMAS:
        cursor.execute(pragma)
    cursor.close()


def _sqlite_pragmas_autobegin_off(dbapi_connection: Any, record: Any) -> None:
    _sqlite_pragmas(dbapi_connection, record)
    dbapi_connection.isolation_level = None  # we emit BEGIN IMMEDIATE ourselves


def _sqlite_begin_immediate(conn: Any) -> None:
    # take the write lock up front: a deferred transaction that reads, then writes, can fail with
    # SQLITE_BUSY under WAL when another process wrote in between
    conn.exec_driver_sql("BEGIN IMMEDIATE")
