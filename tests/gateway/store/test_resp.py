"""The lean Redis client of the turn's path (``gateway.store.resp.LeanRedis``) against the machine's Redis:
the same replies as ``redis-py`` for the same commands, concurrent callers each getting their own reply on
the one pipelined connection, and ``redis-py``'s errors for error replies, a lost connection, a server that
stops answering, a refused setup and an unreachable server."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError, RedisError, ResponseError, TimeoutError

from gateway.store.resp import LeanRedis, encode
from tests.conftest import REDIS_URL, free_port

pytestmark = pytest.mark.services


async def blocked_in_blpop(ref: aioredis.Redis, client_id: int) -> None:
    """Wait until the connection ``client_id`` is blocked in its BLPOP at the server (a hang guard bounds it)."""
    async with asyncio.timeout(120):
        while b"cmd=blpop" not in await ref.execute_command("CLIENT", "LIST", "ID", client_id):
            await asyncio.sleep(0.005)


@pytest.fixture
async def clients(redis_prefix: str):
    lean, ref = LeanRedis.from_url(REDIS_URL), aioredis.Redis.from_url(REDIS_URL)
    yield lean, ref, redis_prefix
    await lean.aclose()
    await ref.aclose()


async def test_replies_equal_redis_py(clients) -> None:
    """Each command the turn's path sends, run by both clients on twin keys: the same replies."""
    lean, ref, p = clients
    results = {}
    for name, client in (("lean", lean), ("ref", ref)):
        k = f"{p}{name}:"
        results[name] = [
            await client.set(k + "s", b"\x00\xffbinary", ex=60),
            await client.get(k + "s"),
            await client.mget([k + "s", k + "missing"]),
            await client.hset(k + "h", mapping={"a": "1", "b": b"\x01"}),
            await client.hget(k + "h", "b"),
            await client.hmget(k + "h", ["a", "nope", "b"]),
            await client.hsetnx(k + "h", "a", "2"),
            await client.zadd(k + "z", {"m1": 1.5, "m2": 3}),
            await client.zadd(k + "z", {"m1": 5, "m3": 1}, xx=True),
            await client.zcount(k + "z", 2, "+inf"),
            await client.zrem(k + "z", "m1"),
            await client.expire(k + "z", 30),
            await client.delete(k + "s", k + "missing"),
        ]
    assert results["lean"][0] in (b"OK", True) and results["ref"][0] is True
    assert results["lean"][1:] == results["ref"][1:]
    assert results["lean"][1] == b"\x00\xffbinary" and results["lean"][9] == 2
    sha = await ref.script_load("return {KEYS[1], ARGV[1]}")
    assert await lean.evalsha(sha, 1, p + "k", 7) == [p.encode() + b"k", b"7"]


async def test_concurrent_callers_get_their_own_replies(clients) -> None:
    """500 callers at once on the one connection, singly and in pipelines, each with its own key."""
    lean, ref, p = clients
    await ref.mset({f"{p}{k}": f"v{k}" for k in range(500)})

    async def one(k: int) -> bytes:
        return await lean.get(f"{p}{k}")

    async def piped(k: int) -> list[bytes]:
        async with lean.pipeline(transaction=False) as pipe:
            pipe.get(f"{p}{k}")
            pipe.get(f"{p}{(k + 1) % 500}")
            return await pipe.execute()

    singles, pipes = await asyncio.gather(asyncio.gather(*(one(k) for k in range(500))),
                                          asyncio.gather(*(piped(k) for k in range(500))))
    assert singles == [f"v{k}".encode() for k in range(500)]
    assert pipes == [[f"v{k}".encode(), f"v{(k + 1) % 500}".encode()] for k in range(500)]
    assert lean.connections == 1


async def test_error_replies_are_raised_or_returned_in_place(clients) -> None:
    lean, ref, p = clients
    await ref.set(p + "str", "x")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await lean.hget(p + "str", "f")
    with pytest.raises(ResponseError, match="NOSCRIPT"):
        await lean.evalsha("0" * 40, 0)
    pipe = lean.pipeline()
    pipe.get(p + "str").hget(p + "str", "f").set(p + "after", "y")
    assert len(pipe) == 3
    first, error, last = await pipe.execute(raise_on_error=False)
    assert first == b"x" and isinstance(error, ResponseError) and last == b"OK"
    assert await ref.get(p + "after") == b"y"  # the commands after an error reply still ran
    pipe.get(p + "str").hget(p + "str", "f")
    with pytest.raises(ResponseError):
        await pipe.execute()
    with pytest.raises(TypeError):
        encode(["SET", "k", None])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        encode(["SET", "k", True])
    with pytest.raises(ValueError):
        lean.pipeline(transaction=True)


async def test_a_cancelled_caller_does_not_shift_the_replies(clients) -> None:
    """A caller that goes away while its command is in flight: its reply is dropped, the next caller
    gets its own (replies are matched by order, so a lost reply would shift them all)."""
    lean, ref, p = clients
    await ref.set(p + "a", "A")
    await ref.set(p + "b", "B")
    await ref.rpush(p + "list", "x")
    my_id = await lean.execute_command("CLIENT", "ID")
    slow = asyncio.ensure_future(lean.execute_command("BLPOP", p + "empty", 0))  # answers once "empty" gets one
    await blocked_in_blpop(ref, my_id)  # in flight at the server
    slow.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await slow
    a = asyncio.ensure_future(lean.get(p + "a"))  # queued behind the BLPOP on the connection
    await asyncio.sleep(0)
    await ref.rpush(p + "empty", "late")  # the BLPOP answers now: a reply nobody waits for any more
    assert await a == b"A"
    assert await lean.get(p + "b") == b"B"
    assert lean.connections == 1


async def test_a_lost_connection_fails_its_waiters_and_the_next_command_reconnects(clients) -> None:
    lean, ref, p = clients
    await ref.set(p + "k", "v")
    assert await lean.get(p + "k") == b"v"
    my_id = await lean.execute_command("CLIENT", "ID")
    waiting = asyncio.ensure_future(lean.execute_command("BLPOP", p + "empty", 0))
    await blocked_in_blpop(ref, my_id)  # waiting at the server when its connection goes
    assert await ref.client_kill_filter(_id=my_id) == 1
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(waiting, 120)  # a hang guard
    assert await lean.get(p + "k") == b"v"
    assert lean.connections == 2


async def test_a_server_that_stops_answering_times_out_and_is_left() -> None:
    """A listener that takes commands and never answers: the waiting callers get TimeoutError once
    nothing came back for ``timeout_s``; the connection is closed (a late reply would go to the wrong
    caller) and the next command opens another."""
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        while await reader.read(4096):
            pass

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    lean = LeanRedis(port=port, timeout_s=0.4)
    try:
        started = asyncio.get_running_loop().time()
        results = await asyncio.gather(lean.get("a"), lean.get("b"), return_exceptions=True)
        assert all(isinstance(r, TimeoutError) for r in results), results
        assert 0.4 <= asyncio.get_running_loop().time() - started < 3
        with pytest.raises(TimeoutError):
            await lean.get("c")
        assert lean.connections == 2 and len(accepted) == 2
    finally:
        await lean.aclose()
        server.close()
        for writer in accepted:
            writer.close()


async def test_unreachable_server_and_refused_setup_are_connection_errors() -> None:
    lean = LeanRedis(port=free_port(), connect_timeout_s=2)
    with pytest.raises(ConnectionError, match="cannot connect"):
        await lean.ping()
    assert isinstance(ConnectionError(), RedisError)
    # this Redis has no password: AUTH is refused, and so is the connection
    refused = LeanRedis.from_url(REDIS_URL.replace("redis://", "redis://:wrong@"))
    with pytest.raises(ConnectionError, match="setup"):
        await refused.ping()
    await refused.aclose()


async def test_url_selects_the_database(clients) -> None:
    _, _, p = clients
    base = REDIS_URL.rsplit("/", 1)[0] if REDIS_URL.count("/") > 2 else REDIS_URL
    lean, other = LeanRedis.from_url(f"{base}/3"), aioredis.Redis.from_url(f"{base}/3")
    try:
        await lean.set(p + "db3", "here", ex=30)
        assert await other.get(p + "db3") == b"here"
        await other.delete(p + "db3")
    finally:
        await lean.aclose()
        await other.aclose()
    with pytest.raises(ValueError):
        LeanRedis.from_url("http://h/0")
