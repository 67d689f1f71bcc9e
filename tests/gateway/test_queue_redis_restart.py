"""Regression tests for a chaos finding (issue 36, bench/chaos.py, 2026-12-04): a Redis restart without
persistence lost every group waiting in the trajectory queue for good.

The Redis queue staged a group in the SQL outbox with its sessions' claim, published it to the stream and
then deleted the outbox row; the sessions are ``consumed``. When Redis came back empty the group was in
neither place, so it was never trained (the 5-minute chaos run lost 145 of 155 exported groups over three
Redis kills). Now the row stays (``published``) until the ack, and the lifecycle's upkeep (``sweep``)
publishes every such row again when Redis has lost the queue. The other side of the contract is checked
too: a group acknowledged (or dropped as too stale) never comes back, a group comes back with its own key
and payload, once per Redis even with two replicas rebuilding at once, and the staleness budget's count
of pending sessions does not count it twice.

Each test runs a private ``redis-server`` without persistence and kills it with SIGKILL (what the bench
does), on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from gateway import errors
from gateway.errors import StoreUnavailable
from gateway.queue import QueuedGroup, RedisQueue, queue_table
from gateway.store.backend import Backend, open_backend
from tests.conftest import free_port
from tests.gateway.test_trajectories_queue import make_group
from tests.services import PrivateRedis, private_redis  # noqa: F401 (fixture)

LONG_LEASE_S = 300.0  # no lease in these tests may expire (a slow machine cannot make one lapse)
PREFIX = "restart:"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.services)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return request.getfixturevalue("pg_url") if request.param == "postgresql" else f"sqlite+aiosqlite:///{tmp_path}/q.db"


@pytest.fixture
async def db(db_url: str) -> AsyncIterator[Backend]:
    opened = await open_backend(db_url)  # migrated
    yield opened
    await opened.close()


@pytest.fixture
async def client(private_redis: PrivateRedis) -> AsyncIterator[Any]:
    redis = aioredis.Redis.from_url(private_redis.url, decode_responses=False)
    yield redis
    await redis.aclose()


def make_queue(client: Any, db: Backend) -> RedisQueue:
    # the lifecycle builds it on Store.engine, which is the backend's write engine
    return RedisQueue(client, prefix=PREFIX, lease_timeout_s=LONG_LEASE_S, engine=db.write_engine)


async def export(queue: RedisQueue, db: Backend, group: QueuedGroup) -> None:
    """What the exporter does: stage in the claim's transaction, publish after the commit."""
    async with db.write_engine.begin() as conn:
        await queue.stage(conn, group)  # in the transaction that claims the group's sessions
    await queue.publish(group)


async def restart(server: PrivateRedis, client: Any) -> None:
    """kill -9 and start again, without persistence: the new Redis is empty."""
    server.stop()
    server.start()
    await client.connection_pool.disconnect()  # the old connections are dead


async def sql_rows(db: Backend) -> dict[str, str]:
    q = queue_table
    async with db.engine.connect() as conn:
        return {r.group_key: r.status for r in await conn.execute(sa.select(q.c.group_key, q.c.status))}


async def test_a_published_group_is_leased_after_redis_restarts_empty(private_redis: PrivateRedis, db: Backend,
                                                                      client: Any) -> None:
    queue = make_queue(client, db)
    group = make_group("g-restart")
    await export(queue, db, group)
    assert await sql_rows(db) == {"g-restart": "published"}  # kept after publishing, until the ack
    await restart(private_redis, client)
    lease = None
    for _ in range(3):  # the lifecycle's upkeep on its next ticks, and the trainer's next leases
        await queue.sweep()
        try:  # a lease before any upkeep may answer NOGROUP (a 503) and have the next call recreate it
            lease = await queue.lease(1, 0.5)
        except StoreUnavailable:
            continue
        break
    assert lease is not None and [g.group_key for g in lease.groups] == ["g-restart"]
    back = lease.groups[0]  # the same group: its key, id, sessions and rows (the trainer dedups by them)
    assert (back.group_id, back.session_ids, back.payload, back.min_version) == \
        (group.group_id, group.session_ids, group.payload, group.min_version)
    assert queue.republished == 1
    assert await queue.ack(lease.id) == 1
    assert await sql_rows(db) == {}


async def test_an_acknowledged_group_never_comes_back(private_redis: PrivateRedis, db: Backend, client: Any) -> None:
    queue = make_queue(client, db)
    await queue.sweep()  # the upkeep of a running gateway: this Redis holds the whole queue
    for key in ("g-acked", "g-waiting"):
        await export(queue, db, make_group(key))
    lease = await queue.lease(1, 0.0)
    assert lease is not None and [g.group_key for g in lease.groups] == ["g-acked"]
    assert await queue.ack(lease.id) == 1
    assert await sql_rows(db) == {"g-waiting": "published"}  # the ack deleted its row
    assert queue.republished == 0  # nothing was lost yet: the upkeep before the restart added nothing

    await restart(private_redis, client)
    await queue.sweep()
    lease = await queue.lease(2, 0.5)  # asks for two, gets the one that was never acknowledged
    assert lease is not None and [g.group_key for g in lease.groups] == ["g-waiting"]
    assert await queue.ack(lease.id) == 1
    await queue.sweep()  # the upkeep again: nothing to publish
    assert await queue.lease(1, 0.0) is None
    assert await sql_rows(db) == {}
    assert queue.republished == 1


async def test_two_restarts_in_a_row_and_one_while_leased(private_redis: PrivateRedis, db: Backend, client: Any) -> None:
    queue = make_queue(client, db)
    await export(queue, db, make_group("g0"))
    await restart(private_redis, client)
    await restart(private_redis, client)  # again before any upkeep saw the first
    await queue.sweep()
    lease = await queue.lease(1, 0.5)
    assert lease is not None and [g.group_key for g in lease.groups] == ["g0"]

    # leased, not acknowledged, and Redis restarts: the lease is gone with it and the group comes back
    await restart(private_redis, client)
    await queue.sweep()
    with pytest.raises(errors.NotFound):  # the old lease is unknown to the new Redis (404)
        await queue.ack(lease.id)
    again = await queue.lease(1, 0.5)
    assert again is not None and [g.group_key for g in again.groups] == ["g0"]
    assert await queue.ack(again.id) == 1

    await restart(private_redis, client)  # a third restart after the ack: nothing comes back
    await queue.sweep()
    assert await queue.lease(1, 0.0) is None
    assert queue.republished == 2


async def test_two_replicas_rebuild_at_once_and_each_group_is_queued_once(private_redis: PrivateRedis, db: Backend,
                                                                           client: Any) -> None:
    other = aioredis.Redis.from_url(private_redis.url, decode_responses=False)  # the second replica's client
    try:
        first, second = make_queue(client, db), make_queue(other, db)
        keys = [f"g{i}" for i in range(5)]
        for i, key in enumerate(keys):
            await export(first if i % 2 else second, db, make_group(key))
        sessions = {s for key in keys for s in make_group(key).session_ids}
        assert (await first.counts()).pending_ids == sessions

        await restart(private_redis, client)
        await other.connection_pool.disconnect()
        # before any upkeep the new Redis is empty, yet the pending sessions are still counted (from SQL);
        # the first call after the restart answers NOGROUP (a 503) and has the next one recreate the group
        with pytest.raises(StoreUnavailable):
            await first.counts()
        assert (await first.counts()).pending_ids == sessions
        await asyncio.gather(first.sweep(), second.sweep())
        assert await client.xlen(first.stream) == len(keys)  # once each, not once per replica
        assert first.republished + second.republished == len(keys)
        counts = await second.counts()  # in the stream and in SQL: each session once
        assert (counts.ready, counts.pending_ids) == (len(keys), sessions)

        lease = await first.lease(len(keys) + 1, 0.5)
        assert lease is not None and sorted(g.group_key for g in lease.groups) == keys
        assert await second.ack(lease.id) == len(keys)
        assert await sql_rows(db) == {}
        assert (await first.counts()).pending_ids == set()
    finally:
        await other.aclose()


async def test_a_stale_group_dropped_stays_dropped(private_redis: PrivateRedis, db: Backend, client: Any) -> None:
    queue = make_queue(client, db)
    await export(queue, db, make_group("g-stale", min_version=0))
    assert await queue.lease(1, 0.0, min_version=5) is None  # too old for the trainer: held back
    done = await queue.maintain(min_version=5, max_held_s=0.0)  # held past its age: dropped (budget given back)
    assert (done.dropped_groups, done.dropped_sessions) == (1, 2)
    assert await sql_rows(db) == {}  # else a rebuild would queue it again and give its budget back twice

    await restart(private_redis, client)
    await queue.sweep()
    assert await queue.lease(1, 0.0) is None
    assert queue.republished == 0


async def test_an_ack_while_the_database_is_down_is_finished_by_the_upkeep(private_redis: PrivateRedis, db: Backend,
                                                                           client: Any) -> None:
    queue = make_queue(client, db)
    await export(queue, db, make_group("g0"))
    lease = await queue.lease(1, 0.0)
    assert lease is not None
    # the database is unreachable for the ack's SQL step (nothing listens on that port): the ack is
    # Redis's, and it stands; the row's delete waits in the ``done`` set
    down = create_async_engine(f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/none")
    try:
        queue.engine = down
        assert await queue.ack(lease.id) == 1
    finally:
        queue.engine = db.write_engine
        await down.dispose()
    assert await sql_rows(db) == {"g0": "published"}
    assert await client.smembers(queue.done) == {b"g0"}

    await queue.sweep()  # the next upkeep deletes it
    assert await sql_rows(db) == {}
    assert await client.smembers(queue.done) == set()
    await restart(private_redis, client)
    await queue.sweep()
    assert await queue.lease(1, 0.0) is None
