"""The one-round-trip lookup of an implicit-mode turn (``RedisState.find_continued``) against the machine's
Redis, through the lean client the gateway uses and through ``redis-py``: which session the episode index
gives, what it brings along (cached record, parent index entry) and when it sets the in-flight marker."""

from __future__ import annotations

import dataclasses
import time

import pytest
import redis.asyncio as aioredis

from gateway.store.records import SessionRecord
from gateway.store.redis_state import Marker, RedisState
from gateway.store.resp import LeanRedis
from tests.conftest import REDIS_URL

pytestmark = pytest.mark.services

CLIENTS = {"redis-py": aioredis.Redis.from_url, "lean": LeanRedis.from_url}


def record(sid: str, status: str = "active") -> SessionRecord:
    return SessionRecord(id=sid, api_key=None, group_id="g", task_id=None, metadata={"implicit": True, "owner": "o"},
                         status=status, is_eval=False, created_at=1.0, finished_at=None, last_activity_at=2.0,
                         version=3)  # type: ignore[arg-type]


@pytest.fixture(params=list(CLIENTS))
async def state(request: pytest.FixtureRequest, redis_prefix: str):
    client = aioredis.Redis.from_url(REDIS_URL)
    await client.ping()
    hot = CLIENTS[request.param](REDIS_URL)
    yield RedisState(client, redis_prefix, hot)
    await client.aclose()
    await hot.aclose()


def index(state: RedisState, chain_hash: str) -> str:
    return f"{state.prefix}gw:implicit:{chain_hash}"


async def test_the_first_indexed_candidate_brings_its_record_parent_and_marker(state: RedisState) -> None:
    await state.client.set(index(state, "h-short"), "sess-a")
    await state.put_session("key-a", record("sess-a"))
    await state.chain_add([("sess-a", "h-long", "turn-7")])
    marker = Marker(f"{state.prefix}inflight:", "member-1", time.time() + 30, 121)
    keys = [index(state, "h-long"), index(state, "h-short")]  # longest first: only the shorter is indexed

    hit = await state.find_continued(keys, "h-long", marker)

    assert hit is not None and hit.session_id == "sess-a" and hit.parent_id == "turn-7" and hit.marked
    assert hit.record == record("sess-a")
    assert await state.client.zscore(f"{state.prefix}inflight:sess-a", "member-1") == pytest.approx(marker.expiry)
    assert 0 < await state.client.ttl(f"{state.prefix}inflight:sess-a") <= 121


async def test_nothing_indexed_is_none_and_sets_no_marker(state: RedisState) -> None:
    marker = Marker(f"{state.prefix}inflight:", "m", time.time() + 30, 121)
    assert await state.find_continued([index(state, "nope")], "nope", marker) is None
    assert await state.find_continued([], "nope", marker) is None
    assert await state.client.keys(f"{state.prefix}inflight:*") == []


async def test_an_uncached_session_gets_no_marker_and_no_parent_guess(state: RedisState) -> None:
    """Without the cached record the caller reads SQL first; the marker is then set the usual way."""
    await state.client.set(index(state, "h"), "sess-b")
    hit = await state.find_continued([index(state, "h")], "h", Marker(f"{state.prefix}inflight:", "m", 1e10, 121))
    assert hit is not None and (hit.session_id, hit.record, hit.parent_id, hit.marked) == ("sess-b", None, None, False)
    assert await state.client.exists(f"{state.prefix}inflight:sess-b") == 0


async def test_without_a_marker_only_reads(state: RedisState) -> None:
    await state.client.set(index(state, "h"), "sess-c")
    await state.put_session("key-c", record("sess-c", status="finished"))
    hit = await state.find_continued([index(state, "h")], "h")
    assert hit is not None and hit.record is not None and hit.record.status == "finished" and not hit.marked
    assert await state.client.keys(f"{state.prefix}inflight:*") == []


async def test_a_script_unknown_to_redis_is_sent_whole(state: RedisState) -> None:
    """NOSCRIPT (Redis restarted, its script cache empty): the call sends the script itself (EVAL)."""
    await state.client.set(index(state, "h"), "sess-d")
    state._find_continued_sha = "0" * 40  # a sha Redis has never seen
    hit = await state.find_continued([index(state, "h")], "h")
    assert hit is not None and hit.session_id == "sess-d"


async def test_a_record_in_the_cache_is_what_get_session_by_id_reads(state: RedisState) -> None:
    rec = dataclasses.replace(record("sess-e"), reward=0.5, metadata={"owner": "o", "implicit": True, "k": [1]})
    await state.put_session("key-e", rec)
    await state.client.set(index(state, "h"), "sess-e")
    hit = await state.find_continued([index(state, "h")], "h")
    assert hit is not None and hit.record == await state.get_session_by_id("sess-e") == rec
