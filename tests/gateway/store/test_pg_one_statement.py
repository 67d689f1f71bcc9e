"""The PostgreSQL group commit's one-statement write (``gateway.store.writer._PG_WRITE_ALL``): a batch whose
jobs all pass is written in one round trip; anything else goes through the checks job by job, which give
each caller its own answer; a parent committed by another process while the statement waits is found."""

from __future__ import annotations

import asyncio
import re
import time
import uuid

import asyncpg
import pytest

from gateway.store import Conflict, NotFound, Store
from gateway.store.rows import interaction_to_row
from gateway.store.writer import (
    _PG_CHECK,
    _PG_INSERT_INTERACTION,
    _PG_WRITE_ALL,
    WRITER_SERVER_SETTINGS,
    PostgresBatchWriter,
    _values,
)
from tests.gateway.store.helpers import make_turn

pytestmark = pytest.mark.services


def _writer(store: Store) -> PostgresBatchWriter:
    direct = store._writer._direct
    assert isinstance(direct, PostgresBatchWriter)
    return direct


async def test_batches_that_pass_take_one_statement(pg_store: Store) -> None:
    """New episodes (session created with its first turn), children, siblings and a child queued behind
    its parent in the same batch: all written by the one statement, with their sessions and activity."""
    store, tag = pg_store, uuid.uuid4().hex[:8]
    session = await store.create_session()
    await store.record_interactions([make_turn(f"r-{tag}", session.id, None, prompt=[1], output=[2])])
    before = await store.get_session(session_id=session.id)
    await asyncio.gather(
        store.record_interactions([make_turn(f"a-{tag}", session.id, f"r-{tag}", prompt=[3], output=[4])]),
        store.record_interactions([make_turn(f"b-{tag}", session.id, f"r-{tag}", prompt=[5], output=[6])]),
        store.record_interactions([make_turn(f"c-{tag}", session.id, f"r-{tag}", prompt=[7], output=[8]),
                                   make_turn(f"d-{tag}", session.id, f"c-{tag}", prompt=[9], output=[10])]))
    assert _writer(store).checked_batches == 0
    assert {t.id for t in await store.session_interactions(session_id=session.id)} == {
        f"{k}-{tag}" for k in "rabcd"}
    assert await store.full_sequence(interaction_id=f"d-{tag}") == [1, 2, 7, 8, 9, 10]
    after = await store.get_session(session_id=session.id)
    assert after.last_activity_at > before.last_activity_at


async def test_a_failing_job_takes_the_checks_and_fails_alone(pg_store: Store) -> None:
    """A batch with an unknown parent, a duplicate id and a finished session beside good jobs: the one
    statement writes nothing of it, the checks fail exactly the bad callers and write the good ones."""
    store, tag = pg_store, uuid.uuid4().hex[:8]
    session, finished = await store.create_session(), await store.create_session()
    await store.record_interactions([make_turn(f"r-{tag}", session.id, None, prompt=[1], output=[2])])
    await store.finish_session(session_id=finished.id)
    results = await asyncio.gather(
        store.record_interactions([make_turn(f"ok-{tag}", session.id, f"r-{tag}", prompt=[3], output=[4])]),
        store.record_interactions([make_turn(f"orphan-{tag}", session.id, "ghost", prompt=[3], output=[4])]),
        store.record_interactions([make_turn(f"r-{tag}", session.id, None, prompt=[3], output=[4])]),
        store.record_interactions([make_turn(f"late-{tag}", finished.id, None, prompt=[3], output=[4])]),
        return_exceptions=True)
    assert results[0] is None
    assert isinstance(results[1], NotFound) and isinstance(results[2], Conflict)
    assert isinstance(results[3], Conflict)
    assert _writer(store).checked_batches >= 1
    assert {t.id for t in await store.session_interactions(session_id=session.id)} == {f"r-{tag}", f"ok-{tag}"}
    assert await store.session_interactions(session_id=finished.id) == []


async def test_a_parent_committed_while_the_statement_waits_is_found(pg_store: Store,
                                                                     shared_pg_url: str) -> None:
    """Another process holds the session's row and commits a parent after the statement began: the
    statement's snapshot does not see that parent, so it writes nothing and the checks (which read after
    the lock) record the child. Then the same with the session finished meanwhile: refused."""
    store, tag = pg_store, uuid.uuid4().hex[:8]
    session = await store.create_session()
    other = await asyncpg.connect(shared_pg_url.replace("+asyncpg", ""))
    observer = await asyncpg.connect(shared_pg_url.replace("+asyncpg", ""))  # outside other's transaction
    try:
        parent = make_turn(f"p-{tag}", session.id, None, prompt=[1], output=[2])
        tx = other.transaction()
        await tx.start()
        await other.execute("SELECT 1 FROM sessions WHERE id = $1 FOR UPDATE", session.id)
        await other.execute(_PG_INSERT_INTERACTION[0],
                            *_values([interaction_to_row(parent)], _PG_INSERT_INTERACTION[1])[0])
        child = asyncio.ensure_future(store.record_interactions(
            [make_turn(f"c-{tag}", session.id, f"p-{tag}", prompt=[3], output=[4])]))
        await _until_waiting_on_a_lock(observer)
        await tx.commit()
        await asyncio.wait_for(child, 30)
        assert _writer(store).checked_batches == 1
        assert await store.full_sequence(interaction_id=f"c-{tag}") == [1, 2, 3, 4]

        tx = other.transaction()
        await tx.start()
        await other.execute("UPDATE sessions SET status = 'finished' WHERE id = $1", session.id)
        late = asyncio.ensure_future(store.record_interactions(
            [make_turn(f"l-{tag}", session.id, f"c-{tag}", prompt=[5], output=[6])]))
        await _until_waiting_on_a_lock(observer)
        await tx.commit()
        with pytest.raises(Conflict, match="finished"):
            await asyncio.wait_for(late, 30)
        assert {t.id for t in await store.session_interactions(session_id=session.id)} == {f"p-{tag}", f"c-{tag}"}
    finally:
        await other.close()
        await observer.close()


async def _until_waiting_on_a_lock(observer: asyncpg.Connection) -> None:
    """Until some other backend of this database waits on a lock (the writer's statement). ``observer``
    must not be inside a transaction: there, pg_stat_activity keeps what it showed first."""
    deadline = time.monotonic() + 120  # a hang guard (was 300 polls: about 3 s on a quiet machine)
    while time.monotonic() < deadline:
        waiting = await observer.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'")
        if waiting:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the writer's statement never waited on the session's row lock")


@pytest.mark.parametrize("statement", ["write_all", "check"])
async def test_the_writers_generic_plans_read_by_key(shared_pg_url: str, statement: str) -> None:
    """The writers' connections keep one generic plan per statement (WRITER_SERVER_SETTINGS), planned
    whenever the connection first runs it, possibly on near-empty tables: it must look rows up by their
    keys (no sequential scan, no walk over a session's turns), or it would stay slow as the tables grow."""
    sql = {"write_all": _PG_WRITE_ALL, "check": _PG_CHECK}[statement]
    conn = await asyncpg.connect(shared_pg_url.replace("+asyncpg", ""), server_settings=WRITER_SERVER_SETTINGS)
    try:
        await conn.execute(f"PREPARE probe AS {sql}")
        params = {int(n) for n in re.findall(r"\$(\d+)", sql)}
        plan = "\n".join(r[0] for r in await conn.fetch(f"EXPLAIN EXECUTE probe({', '.join(['NULL'] * len(params))})"))
    finally:
        await conn.close()
    assert "Seq Scan" not in plan, plan
    assert "ix_interactions_session_created" not in plan, plan
    assert "sessions_pkey" in plan and "interactions_pkey" in plan, plan
