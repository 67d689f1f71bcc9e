"""Group commit: concurrent callers share transactions; a failure touches only its own callers."""

from __future__ import annotations

import asyncio

import pytest

from gateway.store import Conflict, InvalidValue, NotFound, Store
from tests.gateway.store.helpers import make_turn


async def test_concurrent_calls_are_batched(store: Store) -> None:
    sessions = [await store.create_session() for _ in range(8)]
    before = store.commit_stats
    calls = [
        store.record_interactions([make_turn(f"c{s_i}-{k}", s.id, None, prompt=[k, k + 1], output=[k + 2])])
        for s_i, s in enumerate(sessions)
        for k in range(25)
    ]
    await asyncio.gather(*calls)
    stats = store.commit_stats
    transactions = stats.transactions - before.transactions
    assert stats.calls - before.calls == 200 and stats.rows - before.rows == 200
    assert transactions < 200 / 4, f"expected batching, got {transactions} transactions for 200 calls"
    assert stats.max_batch_calls > 1
    for s in sessions:
        assert len(await store.session_interactions(session_id=s.id)) == 25


async def test_failure_fails_only_its_callers_and_leaves_no_partial_rows(store: Store) -> None:
    s = await store.create_session()
    finished = await store.create_session()
    await store.finish_session(session_id=finished.id)
    await store.record_interactions([make_turn("p0", s.id, None, prompt=[1], output=[2])])

    good = [store.record_interactions([make_turn(f"ok{k}", s.id, "p0", prompt=[k], output=[k])]) for k in range(10)]
    # one call of two rows whose second row points at an unknown parent: neither row may land
    half_bad = store.record_interactions([
        make_turn("hb-a", s.id, "p0", prompt=[1], output=[1]),
        make_turn("hb-b", s.id, "ghost", prompt=[1], output=[1]),
    ])
    into_finished = store.record_interactions([make_turn("fin", finished.id, None, prompt=[1], output=[1])])
    # passes the checks but cannot be serialised: fails inside the transaction -> batch retried one by one
    unserialisable = make_turn("js", s.id, "p0", prompt=[1], output=[1])
    unserialisable.request = {"messages": [], "bad": object()}
    results = await asyncio.gather(*good, half_bad, into_finished, store.record_interactions([unserialisable]),
                                   return_exceptions=True)
    assert results[:10] == [None] * 10
    assert isinstance(results[10], NotFound)
    assert isinstance(results[11], Conflict)
    assert isinstance(results[12], InvalidValue)

    ids = {t.id for t in await store.session_interactions(session_id=s.id)}
    assert ids == {"p0"} | {f"ok{k}" for k in range(10)}
    assert await store.session_interactions(session_id=finished.id) == []
    assert store.commit_stats.failed_calls >= 3


async def test_parent_and_child_in_one_batch(store: Store) -> None:
    """A child queued right behind its parent (same batch) is accepted; one behind a failed parent is not."""
    s = await store.create_session()
    parent = make_turn("pb0", s.id, None, prompt=[1], output=[2])
    child = make_turn("pb1", s.id, "pb0", prompt=[3], output=[4])
    bad_parent = make_turn("pb0", s.id, None, prompt=[1], output=[2])  # duplicate id of `parent`
    orphan = make_turn("pb2", s.id, "nothing", prompt=[3], output=[4])
    results = await asyncio.gather(
        store.record_interactions([parent]),
        store.record_interactions([child]),
        store.record_interactions([bad_parent]),
        store.record_interactions([orphan]),
        return_exceptions=True,
    )
    assert results[0] is None and results[1] is None
    assert isinstance(results[2], Conflict) and isinstance(results[3], NotFound)
    assert await store.full_sequence(interaction_id="pb1") == [1, 2, 3, 4]


async def test_close_flushes_pending(backend) -> None:
    store = await backend.open()
    s = await store.create_session()
    pending = [asyncio.ensure_future(
        store.record_interactions([make_turn(f"cl{k}", s.id, None, prompt=[k], output=[k])])) for k in range(20)]
    await asyncio.sleep(0)
    await store.close()
    await asyncio.gather(*pending)
    reopened = await backend.open()
    try:
        assert len(await reopened.session_interactions(session_id=s.id)) == 20
    finally:
        await reopened.close()


@pytest.mark.parametrize("delay_s", [0.002])
async def test_commit_delay_still_commits(backend, delay_s: float) -> None:
    store = await backend.open(commit_delay_s=delay_s, max_batch_rows=16)
    try:
        s = await store.create_session()
        await asyncio.gather(*[
            store.record_interactions([make_turn(f"d{k}", s.id, None, prompt=[k], output=[k])]) for k in range(40)])
        stats = store.commit_stats
        assert stats.rows == 40 and stats.max_batch_calls <= 16 and stats.transactions >= 3
    finally:
        await store.close()


async def test_sessions_created_with_their_first_turns_commit_with_them_or_not_at_all(store: Store) -> None:
    """A new implicit episode and its first turn are one commit: the session exists only if the turn landed."""
    other = await store.create_session()
    await store.record_interactions([make_turn("taken", other.id, None, prompt=[1], output=[2])])
    fresh = [store.new_session(group_id="g-root", metadata={"implicit": True}) for _ in range(3)]
    doomed = store.new_session(group_id="g-root", metadata={"implicit": True})
    results = await asyncio.gather(
        *(store.record_interactions([make_turn(f"root{k}", new.id, None, prompt=[k], output=[k])], create=[new])
          for k, new in enumerate(fresh)),
        # its turn reuses a stored id: the job fails, and its session must not be left behind
        store.record_interactions([make_turn("taken", doomed.id, None, prompt=[1], output=[1])], create=[doomed]),
        return_exceptions=True)
    assert results[:3] == [None] * 3
    assert isinstance(results[3], Conflict)
    for k, new in enumerate(fresh):
        record = await store.get_session(session_id=new.id)
        assert (record.status, record.group_id, record.metadata) == ("active", "g-root", {"implicit": True})
        assert [t.id for t in await store.session_interactions(session_id=new.id)] == [f"root{k}"]
    with pytest.raises(NotFound):
        await store.get_session(session_id=doomed.id)


async def test_cached_session_and_parent_hints_follow_changes_made_through_the_store(store: Store) -> None:
    """``get_session(cached=True)`` and ``find_parent`` answer from memory without Redis; what they answer
    must still follow a status change, and the newest of two turns with the same chain hash wins."""
    new = store.new_session(metadata={"implicit": True})
    await store.record_interactions([make_turn("r", new.id, None, prompt=[1], output=[2], chain_hash="h1")],
                                    create=[new])
    assert (await store.get_session(session_id=new.id, cached=True)).status == "active"
    await store.record_interactions([make_turn("r2", new.id, None, prompt=[1], output=[3], chain_hash="h1")])
    match = await store.find_parent(session_id=new.id, candidates=[(3, "h1"), (1, "h0")])
    assert match is not None and (match.prefix_len, match.interaction.id) == (3, "r2")
    assert await store.find_parent(session_id="sess-other", candidates=[(3, "h1")]) is None
    await store.finish_session(session_id=new.id)
    assert (await store.get_session(session_id=new.id, cached=True)).status == "finished"
    await store.set_session_status(session_id=new.id, status="abandoned")
    assert (await store.get_session(session_id=new.id, cached=True)).status == "abandoned"


async def test_sqlite_writer_stores_what_sqlalchemy_stores_and_takes_turns_with_other_writers(
        tmp_path, sqlite_template) -> None:
    """On SQLite the group commit writes through its own sqlite3 connection in one thread hop per batch. Its
    rows must be byte for byte what SQLAlchemy writes for the same values (JSON text, packed arrays), and it
    must wait for a write transaction of another connection (the store's SQLAlchemy writer, another tool)
    instead of failing."""
    import shutil
    import sqlite3

    shutil.copy(sqlite_template, tmp_path / "s.db")
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/s.db")
    try:
        s = await store.create_session(metadata={"name": "é", "n": [1, 2.5, None]})
        turn = make_turn("w1", s.id, None, prompt=[1, -2, 2**31 - 1], output=[5, 6])
        turn.request = {"messages": [{"role": "user", "content": "naïve \u2028 \"q\""}], "tools": None}
        new = store.new_session(group_id="g", metadata={"implicit": True, "owner": None})
        await store.record_interactions([turn], create=[])
        await store.record_interactions([make_turn("w2", new.id, None, prompt=[3], output=[4])], create=[new])
        # the same values written by SQLAlchemy (the store's other write path) into a copy of the row
        import sqlalchemy as sa

        from gateway.store import schema
        from gateway.store.rows import interaction_to_row
        from gateway.store.rows import new_session_row

        copy = interaction_to_row(turn) | {"id": "w1-copy"}
        row, _ = new_session_row(group_id="g", task_id=None, metadata={"implicit": True, "owner": None})
        async with store.write_transaction() as conn:
            await conn.execute(sa.insert(schema.interactions).values(**copy))
            await conn.execute(sa.insert(schema.sessions).values(**row))
        raw = sqlite3.connect(tmp_path / "s.db")
        cols = ", ".join(c.name for c in schema.interactions.columns if c.name not in ("id", "created_at"))
        mine, theirs = (raw.execute(f"SELECT {cols} FROM interactions WHERE id = ?", (i,)).fetchone()
                        for i in ("w1", "w1-copy"))
        assert mine == theirs
        scols = "metadata, status, is_eval, reward, version, finished_at, typeof(is_eval), typeof(created_at)"
        assert raw.execute(f"SELECT {scols} FROM sessions WHERE id = ?", (new.id,)).fetchone() == \
            raw.execute(f"SELECT {scols} FROM sessions WHERE id = ?", (row["id"],)).fetchone()

        # another connection holds the write lock for a moment: the batch waits for it and commits
        raw.execute("BEGIN IMMEDIATE")
        pending = asyncio.ensure_future(store.record_interactions(
            [make_turn("w3", s.id, "w1", prompt=[7], output=[8])]))
        await asyncio.sleep(0.3)
        assert not pending.done()
        raw.execute("COMMIT")
        await asyncio.wait_for(pending, 10)
        assert [t.id for t in await store.session_interactions(session_id=s.id)] == ["w1", "w1-copy", "w3"]
        raw.close()
    finally:
        await store.close()


async def test_sqlite_writer_run_after_close_fails_instead_of_hanging(tmp_path, sqlite_template) -> None:
    """Review finding: a call on the SQLite writer's thread after Store.close() never resolved (the thread had
    exited; nothing read its queue). StalenessControl.admit/release and late give-backs run there. A job queued
    before close still runs; one submitted after it fails at once with StoreUnavailable."""
    import shutil

    from gateway.store import StoreUnavailable

    shutil.copy(sqlite_template, tmp_path / "store.db")
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'store.db'}", migrate=False)
    writer = store.backend.writer
    assert writer is not None
    assert await writer.run(lambda conn: 1) == 1
    queued = asyncio.ensure_future(writer.run(lambda conn: conn.execute("SELECT 2").fetchone()[0]))
    await asyncio.sleep(0)  # queued on the writer's thread before close
    await store.close()
    assert await asyncio.wait_for(queued, 5) == 2
    with pytest.raises(StoreUnavailable, match="closed"):
        await asyncio.wait_for(writer.run(lambda conn: 1), timeout=5)
    await writer.close()  # idempotent
    with pytest.raises(StoreUnavailable):
        await asyncio.wait_for(writer.write([]), timeout=5)


@pytest.mark.services
@pytest.mark.parametrize("option", ["ssl=disable", "prepared_statement_cache_size=0"])
async def test_turns_record_with_sqlalchemy_asyncpg_url_options(shared_pg_url: str, option: str) -> None:
    """Review finding on 27643d3: the PostgreSQL group-commit writer connected with the store's URL re-rendered
    as a plain asyncpg DSN, so query options that SQLAlchemy's asyncpg dialect passes to asyncpg.connect as
    keywords (``ssl``, ``prepared_statement_cache_size``) became server settings and the server refused the
    connection: the store opened and read, but every turn failed to record."""
    store = await Store.open(f"{shared_pg_url}?{option}", migrate=False)
    try:
        session = await store.create_session()  # through SQLAlchemy: works with the option
        await store.record_interactions([make_turn(f"opt-{option[:3]}", session.id, None, prompt=[1], output=[2])])
        assert len(await store.session_interactions(session_id=session.id)) == 1
    finally:
        await store.close()


@pytest.mark.services
async def test_postgres_writer_connection_refused_is_store_unavailable(shared_pg_url: str) -> None:
    """A connection the server refuses (here an unknown server setting, SQLSTATE 42704, which the error
    translation alone would let through as a 500) fails the turn with StoreUnavailable (503); the next turn
    connects again."""
    from gateway.store import StoreUnavailable
    from gateway.store.writer import PostgresBatchWriter

    store = await Store.open(shared_pg_url, migrate=False)
    try:
        direct = store._writer._direct
        assert isinstance(direct, PostgresBatchWriter)
        good = dict(direct._kwargs)
        direct._kwargs["server_settings"] = {"no_such_setting": "1"}
        session = await store.create_session()
        with pytest.raises(StoreUnavailable, match="cannot connect"):
            await store.record_interactions([make_turn("pgw-refused", session.id, None, prompt=[1], output=[2])])
        direct._kwargs = good
        await store.record_interactions([make_turn("pgw-accepted", session.id, None, prompt=[1], output=[2])])
        assert [t.id for t in await store.session_interactions(session_id=session.id)] == ["pgw-accepted"]
    finally:
        await store.close()


@pytest.mark.services
async def test_postgres_writer_plans_each_statement_for_its_ids_as_the_tables_grow(pg_url: str) -> None:
    """The writer's statements are prepared (asyncpg); PostgreSQL may then keep one generic plan per
    connection, made while the tables were small: a sequential scan, kept as they grow until the next ANALYZE
    (the gateway bench showed one scan of `interactions` every 4 turns). The writer's connection plans each
    execution for its own ids, so a lookup by id stays an index scan however the table changed since."""
    import asyncpg

    store = await Store.open(pg_url)
    admin = await asyncpg.connect(pg_url.replace("postgresql+asyncpg", "postgresql"))
    try:
        await admin.execute("ALTER TABLE interactions SET (autovacuum_enabled = false)")  # no ANALYZE meanwhile
        session = await store.create_session()
        await store.record_interactions([make_turn("grow-0", session.id, None, prompt=[1], output=[2])])
        conn = store._writer._direct._conn
        lookup = "SELECT id, session_id FROM interactions WHERE id = ANY($1::varchar[])"
        statement = await conn.prepare(lookup)
        for k in range(8):  # past PostgreSQL's five custom plans: a generic one could be cached now
            await statement.fetch([f"grow-{k}"])
        await admin.execute(
            "INSERT INTO interactions (id, session_id, parent_id, chain_hash, request_hash, request, response_message, "
            "prompt_ids, bridge_len, output_ids, output_logprobs, output_versions, finish_reason, timings, created_at) "
            "SELECT 'bulk-' || g, $1, NULL, md5(g::text), md5(g::text), '{}', '{}', '', 0, '', '', '', 'stop', '{}', 0 "
            "FROM generate_series(1, 20000) AS g", session.id)
        plan = "\n".join(row[0] for row in await conn.fetch(f"EXPLAIN EXECUTE {statement.get_name()}('{{grow-0}}')"))
        assert "Index" in plan and "Seq Scan" not in plan, plan
        await store.record_interactions([make_turn("grow-1", session.id, "grow-0", prompt=[3], output=[4])])
        assert [t.id for t in await store.session_interactions(session_id=session.id)][-1] == "grow-1"
    finally:
        await admin.close()
        await store.close()
