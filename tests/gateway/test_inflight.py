"""In-flight markers are tied to the liveness of the replica that set them (real Redis, isolated prefix),
through redis-py and through the lean client the gateway gives them (``Store.redis_hot``)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from gateway.errors import StoreUnavailable
from gateway.lifecycle import InFlight
from gateway.lifecycle import inflight as inflight_module
from gateway.store.resp import LeanRedis
from tests.conftest import REDIS_URL, free_port

CLIENTS = {"redis-py": aioredis.Redis.from_url, "lean": LeanRedis.from_url}


class Clock:
    """The markers' clock (their scores are unix times), moved by the test: a marker lapses when the test
    moves the clock past it, not when a slow machine lets its refresher fall behind a real 0.6 s TTL."""

    def __init__(self) -> None:
        self.now = time.time()

    def time(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(inflight_module, "time", c)
    return c


@pytest.mark.parametrize("kind", CLIENTS)
async def test_markers_live_while_their_replica_does_and_lapse_after_it_dies(
        redis_prefix: str, kind: str, clock: Clock) -> None:
    client, other_client = CLIENTS[kind](REDIS_URL), CLIENTS[kind](REDIS_URL)  # one connection per replica
    try:
        # ttl 3 s of the test's clock; the refresher runs every 1 s of real time, and Redis drops a key
        # 4 x ttl + 1 = 13 real seconds after its last refresh
        replica = InFlight(client, prefix=redis_prefix, ttl_s=3)
        other = InFlight(other_client, prefix=redis_prefix, ttl_s=3)  # another replica's lifecycle asks
        turn = replica.track("s-live")
        await turn.__aenter__()
        clock.now += 4.5  # > ttl: the live replica keeps its marker fresh (its next refresh shows it busy)
        async with asyncio.timeout(120):  # a hang guard
            while await other.busy(["s-live"]) != {"s-live"}:
                await asyncio.sleep(0.05)
        await turn.__aexit__(None, None, None)  # the marker's removal is sent off the turn's path...
        assert await replica.busy(["s-live"]) == set()  # ...and the replica's own view waits for it
        assert await other.busy(["s-live"]) == set()

        crashed = replica.track("s-crashed")
        await crashed.__aenter__()  # kill -9: the turn never ends and nobody refreshes its marker
        await replica.close()
        assert await other.busy(["s-crashed"]) == {"s-crashed"}
        clock.now += 3.5  # > ttl since its last refresh
        assert await other.busy(["s-crashed"]) == set()
    finally:
        await client.aclose()
        await other_client.aclose()


@pytest.mark.parametrize("kind", CLIENTS)
async def test_redis_down_refuses_a_new_turn_with_503_and_never_fails_an_ending_one(redis_prefix: str,
                                                                                    kind: str) -> None:
    client = CLIENTS[kind](REDIS_URL)
    dead = CLIENTS[kind](f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    try:
        inflight = InFlight(client, prefix=redis_prefix, ttl_s=5)
        async with inflight.track("s"):
            inflight.redis = dead  # Redis goes away while the turn runs: ending it must not raise
        assert await InFlight(client, prefix=redis_prefix).busy(["s"]) == {"s"}  # lapses within ttl
        with pytest.raises(StoreUnavailable):
            async with inflight.track("s2"):
                pass
        await inflight.close()
    finally:
        await client.aclose()
        await dead.aclose()


@pytest.mark.parametrize("kind", CLIENTS)
async def test_a_released_marker_goes_with_the_commit_and_only_that_turns(redis_prefix: str, kind: str) -> None:
    """Two turns of one session in flight: the first's marker is removed by the commit's publish
    (``releases`` names only that turn's member), so the session is still busy through the second turn, and
    the first turn's end sends no removal of its own."""
    client = CLIENTS[kind](REDIS_URL)
    try:
        inflight = InFlight(client, prefix=redis_prefix, ttl_s=5)
        other = InFlight(client, prefix=redis_prefix, ttl_s=5)  # another replica's view
        first, second = inflight.track("s"), inflight.track("s")
        one, two = await first.__aenter__(), await second.__aenter__()
        assert one is not None and two is not None and one != two
        release = inflight.releases([one])
        assert release == [(f"{redis_prefix}inflight:s", one)]
        pipe = client.pipeline(transaction=False)  # what Store.record_interactions(release=...) sends
        for key, member in release:
            pipe.zrem(key, member)
        assert await pipe.execute() == [1]
        inflight.released([one])
        assert inflight.releases([one]) == []  # no longer held: nothing to release twice
        await first.__aexit__(None, None, None)
        assert not inflight._removals  # no removal of its own after the turn
        assert await other.busy(["s"]) == {"s"}  # the second turn's marker is untouched
        await second.__aexit__(None, None, None)  # not recorded: its marker is removed after it, as before
        assert await inflight.busy(["s"]) == set()  # (waits for that removal)
        assert await other.busy(["s"]) == set()
        await inflight.close()
    finally:
        await client.aclose()
