"""Dependency outages under load: 503 with Retry-After, never 500, and no duplicate siblings after the
client retries. Redis is a private ``redis-server`` on a free port, PostgreSQL a private cluster
(``initdb`` in a temporary directory, its own port and socket directory; both in ``tests/services.py``):
the machine's own servers stay untouched."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import redis

from tests.conftest import REDIS_URL
from tests.gateway.conftest import GatewayProc
from tests.gateway.test_openai_inprocess import AGENT, make_gw, tokenizer  # noqa: F401 (fixtures)
from tests.gateway.under_load import Agents, check_recorded
from tests.services import PrivatePostgres, PrivateRedis, private_postgres, private_redis  # noqa: F401 (fixtures)


@pytest.mark.slow
def test_postgres_restart_under_load_gives_503s_never_500s_and_loses_nothing(
        gateway_factory: Callable[..., GatewayProc], private_postgres: PrivatePostgres, redis_prefix: str) -> None:
    """A gateway process on a private PostgreSQL (+ Redis), four agents in multi-turn conversations; the
    database is stopped (fast shutdown), left down for a moment and started again. During the outage the
    agents see only 503s with Retry-After; afterwards every acknowledged turn is there under its parent, no
    turn is recorded twice, and the same gateway process serves every agent again."""
    gw = gateway_factory(db=private_postgres.url, redis=REDIS_URL, redis_prefix=redis_prefix)
    sessions = [gw.create_session(group_id=f"g{i}") for i in range(4)]
    agents = Agents(gw.base_url, sessions, expect_up=True).start()
    try:
        agents.wait_acked(8)
        before = dict(agents.statuses)
        private_postgres.stop("fast")  # connections are cut while turns are in flight
        agents.wait_status(503, more_than=before.get(503, 0))  # the agents meet the outage
        private_postgres.start()
        mark = len(agents.acked)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and (
                len(agents.acked_after(mark)) < len(sessions) or min(agents.acked_after(mark).values()) < 2):
            time.sleep(0.1)
    finally:
        agents.stop()
    assert agents.statuses[503] > before.get(503, 0), ("the outage was not seen", before, agents.statuses)
    assert set(agents.statuses) <= {200, 503}, (agents.statuses, agents.failures[:5])
    after = agents.acked_after(mark)
    assert len(after) == len(sessions) and min(after.values()) >= 2, (after, agents.statuses)  # serving again
    check_recorded(gw.db, agents.acked)
    print(f"PostgreSQL restart: {len(agents.acked)} turns acknowledged, answers {dict(agents.statuses)}")


async def test_redis_restart_under_load_gives_503s_never_500s_and_no_duplicate_siblings(
        make_gw: Any, private_redis: PrivateRedis) -> None:
    """Four agents each hold a conversation; Redis is stopped once every agent has three acknowledged turns
    and started again once the outage has answered 503s; each agent then makes three more turns. Driven by
    those counts, not by seconds: an unpaced agent on a fast machine once ran a conversation past the tiny
    model's 2,048-token context within the old test's 3 s window (a correct 400, not a 200)."""
    async with make_gw(["ok"], redis=private_redis.url, redis_prefix="outage:") as gw:
        statuses: Counter[int] = Counter()
        warm: set[int] = set()
        all_warm, outage, restarted = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def agent(i: int) -> int:
            """One conversation, each turn retried on 503 as an SDK would."""
            sess = await gw.session(group_id=f"g{i}")
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"agent {i}"}]
            turns = after = 0
            while after < 3:
                if turns == 3 and i not in warm:
                    warm.add(i)
                    if len(warm) == 4:
                        all_warm.set()
                    await outage.wait()  # every agent is mid-conversation when Redis goes away
                resp = await gw.post("/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 3},
                                     key=sess["api_key"])
                statuses[resp.status_code] += 1
                if resp.status_code == 503:
                    assert resp.headers.get("retry-after"), resp.headers
                    await asyncio.sleep(0.05)  # the client's back-off
                    continue  # retried with the same messages
                assert resp.status_code == 200, resp.text
                messages += [resp.json()["choices"][0]["message"], {"role": "user", "content": f"more {turns}"}]
                turns += 1
                after += restarted.is_set()
            rows = await gw.store.session_interactions(session_id=sess["session_id"])
            keys = Counter((r.parent_id, r.request_hash) for r in rows)
            assert max(keys.values()) == 1, "a retried turn was recorded twice"
            assert len(rows) == turns
            return turns

        agents = [asyncio.ensure_future(agent(i)) for i in range(4)]
        await asyncio.wait_for(all_warm.wait(), 120)
        private_redis.stop()
        outage.set()
        guard = time.monotonic() + 120  # a hang guard, not a window
        while statuses[503] == 0:
            await asyncio.sleep(0.02)
            assert not any(a.done() for a in agents), [a.exception() for a in agents if a.done()]
            assert time.monotonic() < guard, f"no 503 while Redis was down: {statuses}"
        private_redis.start()
        restarted.set()
        done = await asyncio.wait_for(asyncio.gather(*agents), 120)
        assert statuses[500] == 0 and statuses[503] > 0, statuses  # the outage was seen, as 503s only
        assert min(done) >= 6 and statuses[200] == sum(done)


def test_postgres_starting_up_shutting_down_or_refusing_is_store_unavailable() -> None:
    """asyncpg's errors while PostgreSQL starts or stops (SQLSTATE 57P03, 57P01), raw and as SQLAlchemy
    wraps them, and a refused connection, are 503s; a constraint violation stays a 409 and a bug a 500."""
    import asyncpg
    from sqlalchemy import exc as sa_exc

    from gateway.app import dependency_outage
    from gateway.store.dberrors import translate
    from gateway.store.errors import Conflict, StoreUnavailable

    starting = asyncpg.exceptions.CannotConnectNowError("the database system is starting up")
    stopping = asyncpg.exceptions.AdminShutdownError("terminating connection due to administrator command")
    for raw in (starting, stopping):
        assert isinstance(translate(raw), StoreUnavailable)
        assert isinstance(translate(sa_exc.DBAPIError("SELECT 1", {}, raw)), StoreUnavailable)
        assert dependency_outage(raw) is not None
    assert isinstance(translate(ConnectionRefusedError(111, "Connection refused")), StoreUnavailable)
    assert dependency_outage(ConnectionRefusedError(111, "Connection refused")) is not None
    assert dependency_outage(redis.ConnectionError("Connection refused")) is not None
    unique = asyncpg.exceptions.UniqueViolationError("duplicate key")
    assert isinstance(translate(sa_exc.IntegrityError("INSERT", {}, unique)), Conflict)
    assert dependency_outage(KeyError("a bug")) is None


async def test_an_implicit_follow_up_after_a_redis_restart_sends_its_lookup_script_again(
        make_gw: Any, private_redis: PrivateRedis) -> None:
    """A restarted Redis has lost the scripts the gateway loaded at connect and, without persistence, the
    episode index: the follow-up's lookup answers NOSCRIPT, is sent whole, finds nothing, and the episode is
    found through the stored turns (SQL): the turn is served and linked to its parent; so is the next one."""
    async with make_gw(["ok"], redis=private_redis.url, redis_prefix="restart:", tick_s=3600) as gw:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "before the restart"}]
        first = await gw.post("/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 3})
        assert first.status_code == 200, first.text
        private_redis.stop()
        private_redis.start()
        assert redis.Redis(port=private_redis.port).dbsize() == 0  # an empty server: no keys, no scripts
        messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "after"}]
        second = None
        for _ in range(50):  # the lean client's connection died with the server: 503 until it reconnects
            second = await gw.post("/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 3})
            if second.status_code != 503:
                break
            await asyncio.sleep(0.1)
        assert second is not None and second.status_code == 200, second.text
        t1, t2 = [await gw.store.get_interaction(interaction_id=r.json()["id"]) for r in (first, second)]
        assert t2.parent_id == t1.id and t2.session_id == t1.session_id and t2.root_reason is None
        messages += [second.json()["choices"][0]["message"], {"role": "user", "content": "and again"}]
        third = await gw.post("/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 3})
        assert third.status_code == 200, third.text
        t3 = await gw.store.get_interaction(interaction_id=third.json()["id"])
        assert t3.parent_id == t2.id and t3.session_id == t2.session_id


async def test_a_turn_whose_publish_loses_its_redis_connection_is_answered_and_its_follow_ups_link(
        make_gw: Any, private_redis: PrivateRedis) -> None:
    """Redis drops the gateway's connections (CLIENT KILL: the server and its keys stay) just as the
    after-commit publish of a turn goes out. The turn is committed, so it is answered 200 and recorded, and
    the publish is sent again on a new connection: the follow-up links to it. Both for a later turn of an
    episode and for its first turn, whose episode-index entry has no copy in SQL (without the second send,
    that follow-up became a new root, ``no_prefix_match``)."""
    async with make_gw(["ok"], redis=private_redis.url, redis_prefix="cut:", tick_s=3600) as gw:
        state = gw.store._redis
        publish = state.publish_turns
        cuts: list[int] = []

        async def cut_then_publish(*args: Any, **kwargs: Any) -> None:
            if armed:
                armed.pop()
                cuts.append(redis.Redis(port=private_redis.port).client_kill_filter(_type="normal", skipme=True))
            await publish(*args, **kwargs)

        state.publish_turns = cut_then_publish
        armed: list[bool] = []

        async def turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
            for _ in range(100):  # 503 while the lean client reconnects, retried as the SDK would
                resp = await gw.post("/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 3})
                if resp.status_code != 503:
                    break
                await asyncio.sleep(0.05)
            assert resp.status_code == 200, resp.text
            body: dict[str, Any] = resp.json()
            messages += [body["choices"][0]["message"], {"role": "user", "content": f"next {len(messages)}"}]
            return body

        for cut_at in (1, 0):  # the publish of the episode's second turn is cut, then of a first turn
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"episode cut at {cut_at}"}]
            ids = []
            for k in range(3):
                if k == cut_at:
                    armed.append(True)
                ids.append((await turn(messages))["id"])
                assert not armed
            turns = [await gw.store.get_interaction(interaction_id=i) for i in ids]
            assert [t.parent_id for t in turns] == [None, *ids[:-1]], (cut_at, [t.root_reason for t in turns])
            assert len({t.session_id for t in turns}) == 1
        assert len(cuts) == 2 and min(cuts) >= 1  # each cut killed the gateway's connections
        assert state.publish_resent == 2  # each cut publish failed and was sent again on a new connection


async def test_a_postgres_stall_under_load_holds_turns_until_it_ends_and_loses_nothing(
        make_gw: Any, pg_url: str, redis_prefix: str) -> None:
    """Another client holds an exclusive lock on ``interactions`` (a stalled database: a migration, a long
    lock, an I/O stall) while eight agents run implicit conversations on PostgreSQL + Redis. The turns wait
    for the database: none fails, none is answered while the lock is held, all are answered when it ends,
    and every agent's conversation is recorded as one chain, each acknowledged turn once, nothing else.

    Driven by events: each agent makes two turns, then one more once the lock is taken; the lock is released
    once PostgreSQL shows the gateway's write waiting for it and all eight turns are sent; then two more each.
    (The old form held the lock for 4 s while unpaced agents ran, and a fast run outgrew the tiny model's
    context.)"""
    import asyncpg

    async with make_gw(["ok"], db=pg_url, redis=REDIS_URL, redis_prefix=redis_prefix, tick_s=3600) as gw:
        statuses: Counter[int] = Counter()
        acked: dict[int, list[str]] = {i: [] for i in range(8)}
        warm: set[int] = set()
        stalled: set[int] = set()  # agents whose turn was sent while the lock is held
        all_warm, locked = asyncio.Event(), asyncio.Event()

        async def agent(i: int) -> None:
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"agent {i} under a stall"}]

            async def turn() -> None:
                resp = await gw.post("/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 3})
                statuses[resp.status_code] += 1
                assert resp.status_code == 200, resp.text
                acked[i].append(resp.json()["id"])
                messages.extend([resp.json()["choices"][0]["message"],
                                 {"role": "user", "content": f"more {len(acked[i])}"}])

            for _ in range(2):
                await turn()
            warm.add(i)
            if len(warm) == 8:
                all_warm.set()
            await locked.wait()
            stalled.add(i)
            await turn()  # caught by the stall
            for _ in range(2):
                await turn()

        agents = [asyncio.ensure_future(agent(i)) for i in range(8)]
        await asyncio.wait_for(all_warm.wait(), 120)
        locker = await asyncpg.connect(pg_url.replace("postgresql+asyncpg", "postgresql"))
        try:
            async with locker.transaction():
                await locker.execute("LOCK TABLE interactions IN ACCESS EXCLUSIVE MODE")
                locked.set()
                guard = time.monotonic() + 120  # a hang guard, not a window
                while len(stalled) < 8 or not await locker.fetchval(
                        "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'interactions'::regclass"):
                    assert time.monotonic() < guard, "the gateway's write never waited for the lock"
                    await asyncio.sleep(0.02)
                # a turn is answered only once committed: while the lock is held, none of the eight is
                assert all(len(ids) == 2 for ids in acked.values()), acked
        finally:
            await locker.close()
        await asyncio.wait_for(asyncio.gather(*agents), 120)
        assert statuses == {200: 8 * 5}, statuses  # the held turns and the later ones, all answered
        for i, ids in acked.items():
            turns = [await gw.store.get_interaction(interaction_id=turn_id) for turn_id in ids]
            assert [t.parent_id for t in turns] == [None, *ids[:-1]], i
            rows = await gw.store.session_interactions(session_id=turns[0].session_id)
            assert sorted(r.id for r in rows) == sorted(ids), i  # nothing recorded that was not acknowledged
