"""Two Store instances on one database (+ Redis): what gateway replicas behind one address rely on."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from gateway.store import Conflict, Store
from gateway.store.api import hash_key
from gateway.store.packing import unpack_i32
from gateway.store.redis_state import RedisState
from tests.conftest import REDIS_URL
from tests.gateway.store.helpers import make_turn


async def test_two_stores_serve_alternate_turns(backend) -> None:
    a, b = await backend.open(), await backend.open()
    try:
        s = await a.create_session(group_id="g")
        assert s.api_key is not None
        assert (await b.get_session_by_key(api_key=s.api_key)).id == s.id

        parent = None
        full: list[int] = []
        for k in range(6):  # turns alternate between the replicas
            here = a if k % 2 == 0 else b
            if parent is not None:
                match = await here.find_parent(session_id=s.id, candidates=[(2 * k, f"chain-x{k - 1}"), (0, "nope")])
                assert match is not None and match.interaction.id == parent
                assert await here.full_sequence(interaction_id=parent) == full
            turn = make_turn(f"x{k}", s.id, parent, prompt=[100 + k, 200 + k], output=[300 + k])
            await here.record_interactions([turn])
            full += turn.prompt_ids + turn.output_ids
            parent = turn.id
        assert await a.full_sequence(interaction_id=parent) == await b.full_sequence(interaction_id=parent) == full

        await b.finish_session(session_id=s.id)  # the other replica sees it at once, cache or not
        assert (await a.get_session_by_key(api_key=s.api_key)).status == "finished"
        with pytest.raises(Conflict):
            await a.record_interactions([make_turn("late", s.id, parent, prompt=[1], output=[2])])
        await a.set_reward(session_id=s.id, reward=0.75, source="grader")
        assert (await b.get_session_by_key(api_key=s.api_key)).reward == 0.75
    finally:
        await a.close()
        await b.close()


async def test_concurrent_writers_on_one_session(backend) -> None:
    """Both replicas record siblings of one parent at the same time: everything lands, nothing twice."""
    a, b = await backend.open(), await backend.open()
    try:
        s = await a.create_session()
        await a.record_interactions([make_turn("root", s.id, None, prompt=[1], output=[2])])
        calls = [
            (a if k % 2 else b).record_interactions([make_turn(f"sib{k}", s.id, "root", prompt=[k], output=[k])])
            for k in range(30)
        ]
        await asyncio.gather(*calls)
        assert len(await b.session_interactions(session_id=s.id)) == 31
    finally:
        await a.close()
        await b.close()


@pytest.mark.services
async def test_redis_is_rebuildable_from_sql(pg_url: str, redis_prefix: str) -> None:
    """Wipe every Redis key: lookups fall back to SQL and refill the cache."""
    store = await Store.open(pg_url, redis_url=REDIS_URL, redis_prefix=redis_prefix)
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        s = await store.create_session()
        assert s.api_key is not None
        await store.record_interactions([make_turn("r0", s.id, None, prompt=[1, 2], output=[3])])
        await store.record_interactions([make_turn("r1", s.id, "r0", prompt=[4], output=[5])])
        keys = [k async for k in client.scan_iter(match=redis_prefix + "*")]
        assert {k.decode().split(":")[-2] for k in keys} >= {"skey", "chain", "seq"}
        await client.delete(*keys)

        fresh = await Store.open(pg_url, redis_url=REDIS_URL, redis_prefix=redis_prefix)  # cold memory too
        try:
            assert (await fresh.get_session_by_key(api_key=s.api_key)).id == s.id
            match = await fresh.find_parent(session_id=s.id, candidates=[(3, "chain-r1"), (1, "chain-r0")])
            assert match is not None and match.interaction.id == "r1"
            assert await fresh.full_sequence(interaction_id="r1") == [1, 2, 3, 4, 5]
        finally:
            await fresh.close()
        assert await client.hget(f"{redis_prefix}chain:{s.id}", "chain-r1") == b"r1"
        assert await client.exists(f"{redis_prefix}skey:{hash_key(s.api_key)}", f"{redis_prefix}seq:r1") == 2
    finally:
        await client.aclose()
        await store.close()


@pytest.mark.services
async def test_session_cache_never_goes_back(pg_url: str, redis_prefix: str) -> None:
    """A replica that read an old row and writes it to Redis late cannot undo a newer status."""
    store = await Store.open(pg_url, redis_url=REDIS_URL, redis_prefix=redis_prefix)
    try:
        s = await store.create_session()
        assert s.api_key is not None
        stale = await store.get_session(session_id=s.id)
        await store.finish_session(session_id=s.id)
        assert store._redis is not None
        await store._redis.put_session(hash_key(s.api_key), stale)  # the late, older write
        assert (await store.get_session_by_key(api_key=s.api_key)).status == "finished"
    finally:
        await store.close()


@pytest.mark.services
async def test_replicas_migrate_concurrently(pg_url: str, redis_prefix: str) -> None:
    """Two replicas starting together on an empty database: the advisory lock serialises the upgrade."""
    stores = await asyncio.gather(*[Store.open(pg_url, redis_url=REDIS_URL, redis_prefix=redis_prefix) for _ in range(2)])
    try:
        s = await stores[0].create_session()
        assert (await stores[1].get_session(session_id=s.id)).id == s.id
    finally:
        for st in stores:
            await st.close()


@pytest.mark.services
async def test_hot_path_needs_no_sql_with_redis(pg_url: str, redis_prefix: str) -> None:
    """Auth, parent lookup and the parent's tokens for the next turn come from Redis and memory."""
    from sqlalchemy import event

    store = await Store.open(pg_url, redis_url=REDIS_URL, redis_prefix=redis_prefix)
    try:
        s = await store.create_session()
        assert s.api_key is not None
        await store.record_interactions([make_turn("h0", s.id, None, prompt=[1, 2], output=[3])])
        statements: list[str] = []
        listener = lambda _c, _cur, sql, *_a: statements.append(sql)  # noqa: E731
        event.listen(store.engine.sync_engine, "before_cursor_execute", listener)
        try:
            await store.get_session_by_key(api_key=s.api_key)
            match = await store.find_parent(session_id=s.id, candidates=[(2, "chain-h0")])
            assert match is not None and match.interaction.id == "h0"
            assert await store.full_sequence(interaction_id="h0") == [1, 2, 3]
        finally:
            event.remove(store.engine.sync_engine, "before_cursor_execute", listener)
        assert statements == []
    finally:
        await store.close()


async def test_sessions_created_with_turns_and_published_entries_reach_redis_with_the_turns(
        pg_url: str, redis_prefix: str) -> None:
    """A session created with its first turn (an implicit episode) and the caller's ``publish`` entries go to
    Redis in the after-commit pipeline of the turns: another replica finds the session by key without SQL.
    After Redis lost its scripts (a restart), the version-guarded session write still lands."""
    from sqlalchemy import event

    one = await Store.open(pg_url, redis_url=REDIS_URL, redis_prefix=redis_prefix)
    two = await Store.open(pg_url, redis_url=REDIS_URL, redis_prefix=redis_prefix)
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        for k in range(2):
            if k == 1:
                await client.script_flush()  # as after a Redis restart: EVALSHA answers NOSCRIPT
            new = one.new_session(metadata={"implicit": True})
            extra = f"{redis_prefix}test:published:{k}"
            await one.record_interactions([make_turn(f"p{k}", new.id, None, prompt=[1], output=[2])],
                                          create=[new], publish=[(extra, new.id, 60)])
            await one.published()  # sent before the caller is answered, its reply (a NOSCRIPT resend) after
            assert (await client.get(extra)) == new.id.encode()
            assert await client.ttl(extra) > 0
            statements: list[str] = []
            listener = lambda _c, _cur, sql, *_a: statements.append(sql)  # noqa: E731
            event.listen(two.engine.sync_engine, "before_cursor_execute", listener)
            try:
                found = await two.get_session_by_key(api_key=new.api_key)
            finally:
                event.remove(two.engine.sync_engine, "before_cursor_execute", listener)
            assert (found.id, found.status, found.metadata) == (new.id, "active", {"implicit": True})
            assert statements == [], k
        # a newer version cached first is never overwritten by the creation's (version 0) copy
        newer = one.new_session()
        row = dict(newer.row, version=5, status="finished")
        from gateway.store.rows import session_from_row

        await one._redis.put_session(newer.row["key_hash"], session_from_row(row))  # type: ignore[union-attr]
        await one.record_interactions([make_turn("p9", newer.id, None, prompt=[1], output=[2])], create=[newer])
        assert (await two.get_session_by_key(api_key=newer.api_key)).status == "finished"
    finally:
        await client.aclose()
        await one.close()
        await two.close()


async def test_implicit_session_lookup_by_id_comes_from_redis_and_follows_status_changes(
        pg_url: str, redis_prefix: str) -> None:
    """``get_session(cached=True)`` (an implicit-mode child turn) reads Redis by id, not SQL, and sees a
    status change made through another replica; a miss (evicted key) is refilled from SQL."""
    from sqlalchemy import event

    one = await Store.open(pg_url, redis_url=REDIS_URL, redis_prefix=redis_prefix)
    two = await Store.open(pg_url, redis_url=REDIS_URL, redis_prefix=redis_prefix)
    client = aioredis.Redis.from_url(REDIS_URL)
    statements: list[str] = []
    listener = lambda _c, _cur, sql, *_a: statements.append(sql)  # noqa: E731
    try:
        new = one.new_session(metadata={"implicit": True, "owner": "o"})
        await one.record_interactions([make_turn("i0", new.id, None, prompt=[1], output=[2])], create=[new])
        event.listen(two.engine.sync_engine, "before_cursor_execute", listener)
        record = await two.get_session(session_id=new.id, cached=True)
        assert (record.status, record.metadata["owner"]) == ("active", "o") and statements == []
        await one.finish_session(session_id=new.id)
        assert (await two.get_session(session_id=new.id, cached=True)).status == "finished"
        assert statements == []
        await client.delete(f"{redis_prefix}sid:{new.id}")
        assert (await two.get_session(session_id=new.id, cached=True)).status == "finished"
        assert len(statements) == 1  # the miss read SQL once and refilled the key
        assert (await two.get_session(session_id=new.id, cached=True)).status == "finished"
        assert len(statements) == 1
    finally:
        event.remove(two.engine.sync_engine, "before_cursor_execute", listener)
        await client.aclose()
        await one.close()
        await two.close()


@pytest.mark.services
async def test_redis_outage_falls_back_to_sql(pg_url: str, redis_prefix: str) -> None:
    """With Redis gone mid-run, every call still answers from SQL; the failures are counted."""
    store = await Store.open(pg_url, redis_url=REDIS_URL, redis_prefix=redis_prefix, turn_cache_size=0)
    live = store._redis
    dead = RedisState(aioredis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2), redis_prefix)
    store._redis = dead
    try:
        s = await store.create_session()
        assert s.api_key is not None
        await store.record_interactions([make_turn("o0", s.id, None, prompt=[1], output=[2])])
        await store.record_interactions([make_turn("o1", s.id, "o0", prompt=[3], output=[4])])
        assert (await store.get_session_by_key(api_key=s.api_key)).id == s.id
        match = await store.find_parent(session_id=s.id, candidates=[(3, "chain-o1")])
        assert match is not None and match.interaction.id == "o1"
        store._seqs = type(store._seqs)(1000)  # cold memory: the sequence must come from SQL
        assert await store.full_sequence(interaction_id="o1") == [1, 2, 3, 4]
        await store.finish_session(session_id=s.id)
        assert dead.errors >= 5
    finally:
        store._redis = live
        await dead.close()
        await store.close()


async def test_with_redis_a_turn_superseded_by_its_child_leaves_process_memory_not_redis(backend) -> None:
    """A conversation's next turn extends the newest one: with Redis, once a turn's child is committed its
    sequence leaves the in-process cache (Redis still has it, and a branch from it reads it there); without
    Redis the process cache is the only one and keeps it."""
    store = await backend.open()
    try:
        s = await store.create_session()
        await store.record_interactions([make_turn("p0", s.id, None, prompt=[1, 2], output=[3])])
        await store.record_interactions([make_turn("p1", s.id, "p0", prompt=[4], output=[5])])
        await store.record_interactions([make_turn("p1b", s.id, "p0", prompt=[6], output=[7])])  # a branch
        await store.published()  # with Redis the branch reads its parent there after the caller's answer
        kept = {turn for turn in ("p0", "p1", "p1b") if turn in store._seqs}
        if backend.redis_url is None:
            assert kept == {"p0", "p1", "p1b"}
        else:
            assert kept == {"p1", "p1b"}
            assert unpack_i32(await store._redis.seq_get("p0")) == [1, 2, 3]
        assert await store.full_sequence(interaction_id="p0") == [1, 2, 3]
        assert await store.full_sequence(interaction_id="p1b") == [1, 2, 3, 6, 7]
        assert store._seqs.tokens == sum(len(packed) // 4 for packed in store._seqs._items.values())
    finally:
        await store.close()


async def test_redis_failing_while_a_branch_reads_its_parent_leaves_the_branch_to_sql(pg_url: str,
                                                                                       redis_prefix: str) -> None:
    """A branch committed after its parent's copy left the process reads the parent from Redis after its
    commit's publish (one MGET). Redis failing right then is only a cache miss: the branch is committed and answered, its
    sequence is not cached anywhere, and it is rebuilt from SQL when asked for; the failure is counted."""
    store = await Store.open(pg_url, redis_url=REDIS_URL, redis_prefix=redis_prefix)
    try:
        s = await store.create_session()
        await store.record_interactions([make_turn("p0", s.id, None, prompt=[1, 2], output=[3])])
        await store.record_interactions([make_turn("p1", s.id, "p0", prompt=[4], output=[5])])
        assert "p0" not in store._seqs  # its child is committed: only Redis has it now
        hot, errors = store._redis.hot, store._redis.errors

        async def refused(*args: object) -> object:
            if args[0] == "MGET":
                raise redis.exceptions.ConnectionError("Redis connection lost (injected)")
            return await type(hot).execute_command(hot, *args)

        hot.execute_command = refused
        await store.record_interactions([make_turn("p1b", s.id, "p0", prompt=[6], output=[7])])
        await store.published()
        del hot.execute_command
        assert store._redis.errors == errors + 1
        assert "p1b" not in store._seqs and await store._redis.seq_get("p1b") is None
        assert await store.full_sequence(interaction_id="p1b") == [1, 2, 3, 6, 7]  # from SQL
        assert (await store.get_interaction(interaction_id="p1b")).parent_id == "p0"
    finally:
        await store.close()


async def test_the_caller_is_answered_before_redis_answers_the_publish(pg_url: str, redis_prefix: str) -> None:
    """The after-commit publish is written to Redis before the caller is answered and its reply is not
    waited for: with Redis holding every write (``CLIENT PAUSE WRITE``) the turn is still answered, and a
    lookup sent after the answer on the same connection sees the publish (a retry recorded during the pause
    is the newest turn of its chain hash, so a lookup that overtook the publish would name the older one)."""
    store = await Store.open(pg_url, redis_url=REDIS_URL, redis_prefix=redis_prefix)
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        s = await store.create_session()
        first = make_turn("q1", s.id, None, prompt=[1], output=[2], chain_hash="chain-q")
        await store.record_interactions([first])
        await store.published()
        retry = make_turn("q1-retry", s.id, None, prompt=[1], output=[3], chain_hash="chain-q",
                          created_at=first.created_at + 1)
        # Redis holds writes until the UNPAUSE below (60 s is only its own hang guard): a record answered
        # within 30 s was answered while Redis held its publish
        await client.execute_command("CLIENT", "PAUSE", "60000", "WRITE")
        try:
            await asyncio.wait_for(store.record_interactions([retry]), 30)  # answered while Redis holds it
            published = asyncio.ensure_future(store.published())
            lookup = asyncio.ensure_future(store.find_parent(session_id=s.id, candidates=[(1, "chain-q")]))
            await asyncio.sleep(0.2)
            assert not published.done() and not lookup.done()  # both wait for Redis, in that order
        finally:
            await client.execute_command("CLIENT", "UNPAUSE")
        await published
        match = await lookup
        assert match is not None and match.interaction.id == "q1-retry"
    finally:
        await client.aclose()
        await store.close()


async def test_sessions_moved_in_bulk_are_seen_by_another_replica_even_when_redis_fails_the_write(
        pg_url: str, redis_prefix: str) -> None:
    """The lifecycle's bulk move (``move_sessions``) updates the cached records in one pipeline; another
    replica then reads the new status by key. When Redis fails that pipeline (connection lost, twice), the
    move still stands in SQL, the failure is counted, the stale cached records are dropped, and the other
    replica reads the new status from SQL."""
    one = await Store.open(pg_url, redis_url=REDIS_URL, redis_prefix=redis_prefix)
    two = await Store.open(pg_url, redis_url=REDIS_URL, redis_prefix=redis_prefix)
    try:
        made = [await one.create_session() for _ in range(4)]
        for s in made:  # cached in Redis as active, through the other replica too
            assert (await two.get_session_by_key(api_key=s.api_key)).status == "active"
        moved = await one.move_sessions(session_ids=[s.id for s in made[:2]], status="finished", expected=["active"])
        assert [r.status for r in moved] == ["finished", "finished"]
        assert [(await two.get_session_by_key(api_key=s.api_key)).status for s in made[:2]] == ["finished"] * 2

        hot, errors = one._redis.hot, one._redis.errors  # type: ignore[union-attr]

        async def refused(*args: object, **kwargs: object) -> object:
            raise redis.exceptions.ConnectionError("Redis connection lost (injected)")

        hot.execute_many = refused  # the pipeline; single commands (the drops) still go through
        try:
            moved = await one.move_sessions(session_ids=[s.id for s in made], status="abandoned",
                                            expected=["active"])
        finally:
            del hot.execute_many
        assert sorted(r.id for r in moved) == sorted(s.id for s in made[2:])
        assert one._redis.errors == errors + 1  # type: ignore[union-attr]
        statuses = [(await two.get_session_by_key(api_key=s.api_key)).status for s in made]
        assert statuses == ["finished", "finished", "abandoned", "abandoned"]
    finally:
        await one.close()
        await two.close()
