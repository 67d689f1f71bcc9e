"""Every error asyncpg raises while PostgreSQL is going away or coming back becomes the store's 503.

The failures are injected at the asyncpg boundary only: the store's group-commit writer and SQLAlchemy's
asyncpg adapter get a real connection (to the machine's PostgreSQL) wrapped so that one chosen call raises
a real asyncpg (or socket) exception instance; everything above that boundary is the real code. The
PostgreSQL restart test in tests/gateway/test_outages.py met one of these as a 500 (main 1020ca9)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import pytest

asyncpg = pytest.importorskip("asyncpg")

import sqlalchemy as sa  # noqa: E402
from sqlalchemy.ext.asyncio import create_async_engine  # noqa: E402

from gateway import errors as gw_errors  # noqa: E402
from gateway.app import dependency_outage  # noqa: E402
from gateway.store import Store, StoreUnavailable  # noqa: E402
from gateway.store.dberrors import db_errors  # noqa: E402
from gateway.store.writer import PostgresBatchWriter  # noqa: E402
from tests.gateway.store.helpers import make_turn  # noqa: E402

pytestmark = pytest.mark.services

E = asyncpg.exceptions
# what a client can meet while the server shuts down, is down, starts up, or drops the socket
OUTAGE_ERRORS: list[Callable[[], BaseException]] = [
    lambda: E.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
    lambda: E.ConnectionFailureError("connection failure"),
    lambda: E.CannotConnectNowError("the database system is starting up"),
    lambda: E.CannotConnectNowError("the database system is shutting down"),
    lambda: E.AdminShutdownError("terminating connection due to administrator command"),
    lambda: E.CrashShutdownError("terminating connection because of crash of another server process"),
    lambda: E.TooManyConnectionsError("sorry, too many clients already"),
    lambda: E.QueryCanceledError("canceling statement due to user request"),
    lambda: E.InterfaceError("connection is closed"),
    lambda: E.InterfaceError("cannot perform operation: another operation is in progress"),
    lambda: E.InternalClientError("unexpected connection state"),
    lambda: E.ProtocolError("protocol error"),
    lambda: ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 5432)"),
    lambda: ConnectionResetError(104, "Connection reset by peer"),
    lambda: BrokenPipeError(32, "Broken pipe"),
    lambda: OSError(113, "No route to host"),
    lambda: asyncio.TimeoutError(),
]
IDS = [f"{type(make()).__name__}:{str(make())[:24]}" for make in OUTAGE_ERRORS]


# the calls of the writer's transaction path (gateway.store.writer._write_postgres); "fetchval" is the
# one-statement write tried first
TRANSACTION_CALLS = ("fetch", "executemany", "execute", "commit")


def assert_503(exc: BaseException) -> None:
    """``exc`` is the store's StoreUnavailable, answered 503 with Retry-After by the gateway."""
    assert isinstance(exc, StoreUnavailable), repr(exc)
    answer = gw_errors.from_store_error(exc)
    assert answer.status == 503 and answer.retry_after_s, (answer.status, answer.retry_after_s)


class FailingConnection:
    """A real asyncpg connection whose first call of ``where`` (fetch, executemany, execute, commit or
    prepare) raises ``error``; with ``lose`` the connection is first terminated, as a server going away
    leaves it. Everything else is the real connection."""

    def __init__(self, conn: Any, where: str, error: BaseException, lose: bool) -> None:
        self._conn, self._where, self._error, self._lose = conn, where, error, lose
        self.fired = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def _fail(self, where: str) -> None:
        if where == self._where and not self.fired:
            self.fired = True
            if self._lose:
                self._conn.terminate()
            raise self._error

    async def fetchval(self, *args: Any, **kwargs: Any) -> Any:
        """The batch's one-statement write. When the failure is to come later, in the transaction path,
        the statement answers false, as it does when its snapshot misses a parent committed meanwhile."""
        self._fail("fetchval")
        if self._where in TRANSACTION_CALLS and not self.fired:
            return False
        return await self._conn.fetchval(*args, **kwargs)

    async def fetch(self, *args: Any, **kwargs: Any) -> Any:
        self._fail("fetch")
        return await self._conn.fetch(*args, **kwargs)

    async def executemany(self, *args: Any, **kwargs: Any) -> Any:
        self._fail("executemany")
        return await self._conn.executemany(*args, **kwargs)

    async def execute(self, *args: Any, **kwargs: Any) -> Any:
        self._fail("execute")
        return await self._conn.execute(*args, **kwargs)

    async def prepare(self, *args: Any, **kwargs: Any) -> Any:
        self._fail("prepare")
        return await self._conn.prepare(*args, **kwargs)

    def transaction(self, *args: Any, **kwargs: Any) -> Any:
        tx = self._conn.transaction(*args, **kwargs)
        outer = self

        class Transaction:  # asyncpg's transaction; as ``async with`` started and ended by hand
            def __getattr__(self, name: str) -> Any:
                return getattr(tx, name)  # SQLAlchemy's adapter: start(), commit(), rollback()

            async def __aenter__(self) -> Any:
                await tx.start()
                return tx

            async def __aexit__(self, exc_type: Any, *_: Any) -> None:
                if exc_type is None and outer._where == "commit" and not outer.fired:
                    if not outer._lose:
                        await tx.rollback()
                    outer._fail("commit")
                if outer._conn.is_closed():
                    return  # nothing to end: the connection is gone
                await (tx.commit() if exc_type is None else tx.rollback())

        return Transaction()


def _inject(store: Store, where: str, error: BaseException | None, lose: bool = False) -> list[Any]:
    """The writer's next connection fails at ``where`` (at connect itself when ``where`` is "connect")."""
    direct = store._writer._direct
    assert isinstance(direct, PostgresBatchWriter)
    direct._drop()
    made: list[Any] = []

    async def creator(*args: Any, **kwargs: Any) -> Any:
        if where == "connect" and not made:
            made.append(None)
            assert error is not None
            raise error
        conn = FailingConnection(await asyncpg.connect(*args, **kwargs), where, error, lose) \
            if error is not None and not made else await asyncpg.connect(*args, **kwargs)
        made.append(conn)
        return conn

    direct._creator = creator
    return made


@pytest.mark.parametrize("where", ["connect", "fetchval", *TRANSACTION_CALLS])
@pytest.mark.parametrize("make_error", OUTAGE_ERRORS, ids=IDS)
async def test_writer_turns_every_asyncpg_outage_error_into_503(pg_store: Store, where: str,
                                                                make_error: Callable[[], BaseException]) -> None:
    """Each error at the writer's connect or at any call of its transaction fails the turn with
    StoreUnavailable (503 + Retry-After), nothing is half-written, and the next turn reconnects and
    records."""
    store, tag = pg_store, uuid.uuid4().hex[:8]
    session = await store.create_session()
    made = _inject(store, where, make_error())
    with pytest.raises(StoreUnavailable) as raised:
        await store.record_interactions([make_turn(f"inj-{where}-1-{tag}", session.id, None, prompt=[1], output=[2])])
    assert_503(raised.value)
    assert where == "connect" or made[0].fired
    assert await store.session_interactions(session_id=session.id) == []
    await store.record_interactions([make_turn(f"inj-{where}-2-{tag}", session.id, None, prompt=[1], output=[2])])
    assert [t.id for t in await store.session_interactions(session_id=session.id)] == [f"inj-{where}-2-{tag}"]


@pytest.mark.parametrize("where", ["fetchval", "fetch", "executemany", "commit"])
async def test_writer_error_of_unknown_kind_is_503_when_the_connection_is_gone_and_a_bug_otherwise(
        pg_store: Store, where: str) -> None:
    """An exception the translation does not know is an outage when it left the writer's connection
    closed (503), and stays a bug (raised as is: the gateway's 500) when the connection is still fine."""
    store, tag = pg_store, uuid.uuid4().hex[:8]
    session = await store.create_session()
    _inject(store, where, RuntimeError("unheard of"), lose=True)
    with pytest.raises(StoreUnavailable) as raised:
        await store.record_interactions([make_turn(f"unk-{where}-1-{tag}", session.id, None, prompt=[1], output=[2])])
    assert_503(raised.value)
    _inject(store, where, RuntimeError("a bug"), lose=False)
    with pytest.raises(RuntimeError, match="a bug"):
        await store.record_interactions([make_turn(f"unk-{where}-2-{tag}", session.id, None, prompt=[1], output=[2])])
    assert dependency_outage(RuntimeError("a bug")) is None
    await store.record_interactions([make_turn(f"unk-{where}-3-{tag}", session.id, None, prompt=[1], output=[2])])
    assert [t.id for t in await store.session_interactions(session_id=session.id)] == [f"unk-{where}-3-{tag}"]


@pytest.mark.parametrize("where", ["connect", "prepare"])
@pytest.mark.parametrize("make_error", OUTAGE_ERRORS, ids=IDS)
async def test_sqlalchemy_path_turns_every_asyncpg_outage_error_into_503(
        shared_pg_url: str, where: str, make_error: Callable[[], BaseException]) -> None:
    """The same errors met by SQLAlchemy's asyncpg adapter (the store's reads, staleness, lifecycle): as
    the store translates them (``db_errors``) and as the gateway's last-resort handler does for one that
    escaped translation (``dependency_outage``), each is a 503."""
    made: list[Any] = []

    async def creator(*args: Any, **kwargs: Any) -> Any:
        if where == "connect":
            raise make_error()
        conn = FailingConnection(await asyncpg.connect(*args, **kwargs), where, make_error(), lose=False)
        made.append(conn)
        return conn

    engine = create_async_engine(shared_pg_url, connect_args={"async_creator_fn": creator})
    try:
        with pytest.raises(Exception) as raw:  # what escapes SQLAlchemy, untranslated
            async with engine.connect() as conn:
                await conn.execute(sa.text("SELECT count(*) FROM sessions"))
        outage = dependency_outage(raw.value)
        assert outage is not None and outage.status == 503 and outage.retry_after_s, repr(raw.value)
        await engine.dispose()
        made.clear()
        with pytest.raises(StoreUnavailable) as translated:
            async with db_errors(), engine.connect() as conn:
                await conn.execute(sa.text("SELECT count(*) FROM sessions"))
        assert_503(translated.value)
    finally:
        await engine.dispose()
