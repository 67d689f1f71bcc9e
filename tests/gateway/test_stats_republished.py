"""``GET /v1/trajectories/stats`` counts the groups the Redis queue published again after Redis lost them
(issue 36's leftovers: the ``republished`` counter of ``gateway.queue.RedisQueue`` was not served).

A real gateway process on a private ``redis-server`` (no persistence) and SQLite; the test exports a group
the way the exporter does (staged in SQL, published to the stream), kills Redis with SIGKILL and starts it
again empty: the gateway's upkeep publishes the group again from SQL and its stats say so."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx

from gateway.queue import RedisQueue
from gateway.store.backend import open_backend
from tests.gateway.conftest import GatewayProc
from tests.gateway.test_outages import PrivateRedis, private_redis  # noqa: F401 (fixture)
from tests.gateway.test_trajectories_queue import make_group

PREFIX = "republished:"
HANG_GUARD_S = 180.0


async def export(db_url: str, redis_url: str, key: str) -> None:
    """What the exporter does: stage the group in SQL inside a transaction, publish it after the commit."""
    import redis.asyncio as aioredis

    backend = await open_backend(db_url)
    client = aioredis.Redis.from_url(redis_url, decode_responses=False)
    try:
        queue = RedisQueue(client, prefix=PREFIX, lease_timeout_s=300.0, engine=backend.write_engine)
        group = make_group(key)
        async with backend.write_engine.begin() as conn:
            await queue.stage(conn, group)
        await queue.publish(group)
    finally:
        await client.aclose()
        await backend.close()


def stats(admin: httpx.Client) -> dict | None:
    """The stats, or None while the gateway answers 503 (Redis restarting)."""
    resp = admin.get("/v1/trajectories/stats")
    if resp.status_code == 503:
        return None
    assert resp.status_code == 200, resp.text
    return resp.json()["stats"]


def test_stats_count_groups_published_again_after_a_redis_restart(
        gateway_factory: Callable[..., GatewayProc], private_redis: PrivateRedis) -> None:  # noqa: F811
    gw = gateway_factory(redis=private_redis.url, redis_prefix=PREFIX, extra_args=["--tick-s", "0.1"])
    asyncio.run(export(gw.db, private_redis.url, "g-republished"))
    with gw.admin() as admin:
        first = stats(admin)
        assert first is not None and first["groups_republished"] == 0  # nothing lost yet

        private_redis.stop()  # kill -9; the new one is empty
        private_redis.start()
        deadline = time.monotonic() + HANG_GUARD_S  # a hang guard: the upkeep runs every 10 ticks
        while True:
            now = stats(admin)
            if now is not None and now["groups_republished"] >= 1:
                break
            assert time.monotonic() < deadline, f"no republished group in the stats: {now}"
            time.sleep(0.2)
        assert now["groups_republished"] == 1

        # the group is back in the queue, once: lease it, ack it
        resp = admin.get("/v1/trajectories", params={"max_groups": 2, "wait_s": 30}, timeout=90)
        assert resp.status_code == 200, resp.text
        lease_id = resp.headers["x-agentrl-lease-id"]
        acked = admin.post("/v1/trajectories/ack", json={"lease_id": lease_id})
        assert acked.status_code == 200 and acked.json()["acked_groups"] == 1
        assert stats(admin)["groups_republished"] == 1  # the ack changes nothing
