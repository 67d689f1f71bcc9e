"""Sessions: creation, lookup by key (cached with Redis), status changes, listing."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa

from gateway.store import Conflict, InvalidValue, NotFound, Store
from gateway.store import sessions as store_sessions
from tests.gateway.store.helpers import make_turn


async def test_create_and_lookup(store: Store) -> None:
    created = await store.create_session(group_id="g1", task_id="t1", metadata={"eval": True, "k": [1, 2]})
    assert created.api_key and created.api_key.startswith("sk-agentrl-")
    assert created.status == "active" and created.is_eval and created.group_id == "g1"

    by_id = await store.get_session(session_id=created.id)
    assert by_id.api_key is None  # the key is returned once, stored hashed
    assert (by_id.id, by_id.task_id, by_id.metadata) == (created.id, "t1", {"eval": True, "k": [1, 2]})
    for _ in range(2):  # second call is served from the cache when Redis is on
        by_key = await store.get_session_by_key(api_key=created.api_key)
        assert by_key.id == created.id and by_key.status == "active" and by_key.api_key is None

    with pytest.raises(NotFound):
        await store.get_session_by_key(api_key="sk-agentrl-not-a-key")
    with pytest.raises(NotFound):
        await store.get_session(session_id="sess-missing")


async def test_a_session_read_by_key_on_sqlites_writer_equals_the_sqlalchemy_read(store: Store) -> None:
    """On SQLite the auth read by key runs on the writer's own sqlite3 connection; the record it builds is
    the one SQLAlchemy's mapping gives, field for field (JSON metadata, booleans, nulls, floats), also after
    a status change and a reward, and an unknown key is NotFound."""
    import sqlalchemy as sa

    from gateway.store import schema
    from gateway.store.rows import hash_key
    from gateway.store.rows import session_from_row

    odd = {"eval": False, "text": "é \u2028 \"quoted\"", "nested": {"a": [1, 2.5, None, True]}, "empty": {}}
    sessions = [await store.create_session(group_id="g", task_id=None, metadata=odd),
                await store.create_session(metadata={"eval": True})]
    await store.finish_session(session_id=sessions[0].id)
    await store.set_reward(session_id=sessions[0].id, reward=-0.125, source="test")
    for created in sessions:
        assert created.api_key is not None
        by_key = await store.get_session_by_key(api_key=created.api_key)
        async with store.read_connection() as conn:
            row = (await conn.execute(sa.select(schema.sessions).where(
                schema.sessions.c.key_hash == hash_key(created.api_key)))).mappings().first()
        assert by_key == session_from_row(row)
    assert (await store.get_session_by_key(api_key=sessions[0].api_key)).status == "finished"
    with pytest.raises(NotFound):
        await store.get_session_by_key(api_key="sk-agentrl-unknown")


async def test_defaults_and_duplicate_id(store: Store) -> None:
    s = await store.create_session(session_id="implicit-1")
    assert s.group_id == "implicit-1" and not s.is_eval and s.metadata == {}
    with pytest.raises(Conflict):
        await store.create_session(session_id="implicit-1")
    other = await store.create_session()
    assert other.api_key != s.api_key and other.id != s.id


async def test_finish_is_idempotent_and_seen_by_key(store: Store) -> None:
    s = await store.create_session()
    assert s.api_key is not None
    await store.get_session_by_key(api_key=s.api_key)  # warm the cache
    done = await store.finish_session(session_id=s.id)
    assert done.status == "finished" and done.finished_at is not None and done.version == 1
    again = await store.finish_session(session_id=s.id)
    assert (again.status, again.finished_at, again.version) == ("finished", done.finished_at, 1)
    assert (await store.get_session_by_key(api_key=s.api_key)).status == "finished"

    consumed = await store.set_session_status(session_id=s.id, status="consumed", expected={"finished"})
    assert consumed.status == "consumed" and consumed.finished_at == done.finished_at
    assert (await store.finish_session(session_id=s.id)).status == "consumed"  # no step back
    with pytest.raises(Conflict):
        await store.set_session_status(session_id=s.id, status="abandoned", expected={"active"})
    with pytest.raises(InvalidValue):
        await store.set_session_status(session_id=s.id, status="paused")  # type: ignore[arg-type]
    with pytest.raises(NotFound):
        await store.finish_session(session_id="nope")


async def test_move_sessions_moves_each_one_in_expected_one_update_per_batch(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lifecycle's bulk move: only sessions in ``expected`` move (each on its own, an unknown id or one in
    another status is skipped, not a Conflict), one UPDATE per ``MOVE_BATCH`` ids, versions bumped, a
    finished_at kept where it was set, and the key and id caches see the new status."""
    monkeypatch.setattr(store_sessions, "MOVE_BATCH", 3)
    made = [await store.create_session() for _ in range(7)]
    done = await store.finish_session(session_id=made[0].id)
    watched = made[4]
    assert watched.api_key is not None
    assert (await store.get_session_by_key(api_key=watched.api_key)).status == "active"  # cached now
    assert (await store.get_session(session_id=watched.id, cached=True)).status == "active"
    updates: list[str] = []

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        if statement.lstrip().upper().startswith("UPDATE SESSIONS"):
            updates.append(statement)

    sa.event.listen(store.engine.sync_engine, "before_cursor_execute", count)
    try:
        moved = await store.move_sessions(session_ids=[s.id for s in made] + ["sess-nope"], status="finished",
                                          expected=["active"])
    finally:
        sa.event.remove(store.engine.sync_engine, "before_cursor_execute", count)
    assert sorted(r.id for r in moved) == sorted(s.id for s in made[1:])
    assert len(updates) == 3  # 8 ids in batches of 3; each batch's sessions in one statement
    assert all(r.status == "finished" and r.version == 1 and r.finished_at is not None for r in moved)
    for record in moved:
        stored = await store.get_session(session_id=record.id)
        assert (stored.status, stored.version, stored.finished_at) == ("finished", 1, record.finished_at)
    kept = await store.get_session(session_id=done.id)
    assert (kept.status, kept.version, kept.finished_at) == ("finished", 1, done.finished_at)
    assert (await store.get_session_by_key(api_key=watched.api_key)).status == "finished"
    assert (await store.get_session(session_id=watched.id, cached=True)).status == "finished"

    assert await store.move_sessions(session_ids=[s.id for s in made], status="abandoned", expected=["active"]) == []
    gone = await store.move_sessions(session_ids=[s.id for s in made], status="abandoned", expected=["finished"])
    assert len(gone) == 7 and {r.version for r in gone} == {2}
    assert (await store.get_session(session_id=done.id)).finished_at == done.finished_at
    assert (await store.get_session_by_key(api_key=watched.api_key)).status == "abandoned"
    with pytest.raises(InvalidValue):
        await store.move_sessions(session_ids=[made[0].id], status="paused", expected=["active"])  # type: ignore[arg-type]


async def test_rewarded_names_sessions_with_a_session_reward_or_any_reward_event(store: Store) -> None:
    plain, by_session, by_turn = [await store.create_session() for _ in range(3)]
    await store.set_reward(reward=1.0, source="test", session_id=by_session.id)
    await store.record_interactions([make_turn("rw1", by_turn.id, None, prompt=[1], output=[2])])
    await store.set_reward(reward=0.5, source="test", interaction_id="rw1")
    assert await store.rewarded(session_ids=[plain.id, by_session.id, by_turn.id, "sess-nope"]) == {
        by_session.id, by_turn.id}
    assert await store.rewarded(session_ids=[]) == set()


async def test_list(store: Store) -> None:
    a = await store.create_session(group_id="g")
    b = await store.create_session(group_id="g")
    c = await store.create_session(group_id="h")
    await store.finish_session(session_id=b.id)
    assert [s.id for s in await store.list_sessions(group_id="g")] == [a.id, b.id]
    assert [s.id for s in await store.list_sessions(status="active")] == [a.id, c.id]
    assert [s.id for s in await store.list_sessions(status=["finished", "consumed"])] == [b.id]


async def test_claim_sessions_is_all_or_nothing(store: Store) -> None:
    a = await store.create_session(group_id="g")
    b = await store.create_session(group_id="g")
    await store.finish_session(session_id=a.id)
    # b is still active: claiming the group changes nothing, not even a
    with pytest.raises(Conflict):
        await store.claim_sessions(session_ids=[a.id, b.id], status="consumed", expected={"finished"})
    assert [s.status for s in await store.list_sessions(group_id="g")] == ["finished", "active"]
    await store.finish_session(session_id=b.id)
    claimed = await store.claim_sessions(session_ids=[a.id, b.id], status="consumed", expected={"finished"})
    assert [(s.id, s.status) for s in claimed] == [(a.id, "consumed"), (b.id, "consumed")]
    assert all(r.version == 2 for r in claimed)  # created 0 -> finished 1 -> consumed 2
    # a second claimer loses the whole group
    with pytest.raises(Conflict):
        await store.claim_sessions(session_ids=[a.id, b.id], status="consumed", expected={"finished"})
    assert b.api_key is not None
    assert (await store.get_session_by_key(api_key=b.api_key)).status == "consumed"
    with pytest.raises(NotFound):
        await store.claim_sessions(session_ids=[a.id, "nope"], status="consumed", expected={"consumed"})


async def test_concurrent_claims_of_one_group_have_one_winner(store: Store) -> None:
    ids = []
    for _ in range(4):
        s = await store.create_session(group_id="g")
        await store.finish_session(session_id=s.id)
        ids.append(s.id)

    async def claim(order: list[str]) -> int:
        try:
            return len(await store.claim_sessions(session_ids=order, status="consumed", expected={"finished"}))
        except Conflict:
            return 0

    results = await asyncio.gather(claim(ids), claim(ids[::-1]), claim(ids[1:] + ids[:1]))
    assert sorted(results) == [0, 0, 4]


async def test_lifecycle_candidates_leave_out_idle_sessions_waiting_for_a_reward(store: Store) -> None:
    """The tick's SQL selection: an idle session is a candidate once rewarded (session or turn reward) or
    past the group timeout; one that only waits for its reward is not, so a big group of those is not read
    on every tick. A candidate brings its whole group id."""
    import time as _time

    from tests.gateway.store.helpers import make_turn

    members = [await store.create_session(group_id="g-wait") for _ in range(3)]
    other = await store.create_session(group_id="g-other")
    later = _time.time() + 60  # "idle since a minute from now": every session here counts as idle
    assert await store.lifecycle_sessions(idle_before=later, timeout_before=0.0) == []
    assert {s.id for s in await store.lifecycle_sessions(idle_before=0.0, timeout_before=later)} == \
        {m.id for m in members} | {other.id}
    await store.record_interactions([make_turn("t-wait", members[1].id, None, prompt=[1], output=[2])])
    await store.set_reward(reward=1.0, source="test", interaction_id="t-wait")  # a turn reward
    got = await store.lifecycle_sessions(idle_before=later, timeout_before=0.0)
    assert {s.id for s in got} == {m.id for m in members}  # the whole group, and only it
    await store.set_reward(reward=0.5, source="test", session_id=other.id)  # a session reward
    got = await store.lifecycle_sessions(idle_before=later, timeout_before=0.0)
    assert {s.id for s in got} == {m.id for m in members} | {other.id}
    assert await store.lifecycle_sessions(idle_before=0.0, timeout_before=0.0) == []


@pytest.mark.services
async def test_lifecycle_query_stays_cheap_when_the_tables_grew_after_it_was_first_planned(pg_url: str) -> None:
    """The lifecycle tick's query runs every 0.5 s. Prepared by asyncpg and first run on a new, empty database,
    PostgreSQL kept a generic plan for it (a nested loop over the sessions) as the table grew: one tick over
    9,000 active sessions of one group took 17.6 s of a core (seen in the gateway bench, 2026-12-01). The
    store's connections plan every statement for its parameters. Here the database cuts any statement off
    after 5 s, far above what the query needs (milliseconds), far below what the stale plan took."""
    import time

    import asyncpg

    admin = await asyncpg.connect(pg_url.replace("postgresql+asyncpg", "postgresql"))
    await admin.execute(f"ALTER DATABASE {pg_url.rsplit('/', 1)[1]} SET statement_timeout = '5s'")
    store = await Store.open(pg_url)
    try:
        await admin.execute("ALTER TABLE sessions SET (autovacuum_enabled = false)")  # no ANALYZE meanwhile
        now = time.time()
        for _ in range(8):  # past PostgreSQL's five custom plans, on an empty table
            assert await store.lifecycle_sessions(idle_before=now - 300, timeout_before=now - 900) == []
        await admin.execute(
            "INSERT INTO sessions (id, key_hash, group_id, task_id, metadata, status, is_eval, reward, version, "
            "created_at, finished_at, last_activity_at) SELECT 'grown-' || g, md5(g::text), 'one-group', NULL, '{}', "
            "'active', false, NULL, 0, $1, NULL, $1 FROM generate_series(1, 9000) AS g", now)
        assert await store.lifecycle_sessions(idle_before=now - 300, timeout_before=now - 900) == []
        await store.finish_session(session_id="grown-1")  # now the group is returned whole
        got = await store.lifecycle_sessions(idle_before=now - 300, timeout_before=now - 900)
        assert len(got) == 9000 and {s.group_id for s in got} == {"one-group"}
    finally:
        await store.close()
        await admin.close()
