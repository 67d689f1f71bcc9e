"""A lean Redis client for the commands on a turn's path (``LeanRedis``).

A turn in implicit mode on PostgreSQL + Redis sends Redis three things: one script call (episode lookup,
session record, parent index, in-flight marker), the after-commit publish and the marker's removal. Through
``redis-py``'s asyncio client a command costs ~140 us of the gateway's CPU (a pooled connection checked out and back in under
a lock, a retry wrapper, a parser per command) for a ~25 us exchange; measured on this 2-core machine, a GET
took 141 us of CPU and a two-command pipeline 222 us, against 59 us and 68 us here (``bench`` numbers in
docs/gateway.md). This client keeps one connection per process and pipelines every caller's commands on it:
each command is one ``write`` of its RESP encoding, and the replies, parsed by ``hiredis``, resolve the
callers' futures in the order the commands were sent (Redis answers a connection's commands in order).

It speaks RESP2 and knows only what the turn's path sends (strings, hashes, sorted sets, expiry, scripts).
It fails as ``redis-py`` does, with ``redis.exceptions`` errors (``ConnectionError``, ``TimeoutError``,
``ResponseError``), so the callers' ``except RedisError`` handling is the same for both clients; the
methods below have ``redis-py``'s names and arguments, so the same code (``InFlight``, ``ImplicitIndex``)
runs on either. Everything else (streams, pub/sub, the leader lock, blocking commands, transactions) stays
on ``redis-py``: a blocking command would hold up every caller of this one connection.

A lost connection fails the commands waiting on it and is opened again by the next command. A connection
that answers nothing for ``timeout_s`` while commands wait is closed (its waiters get ``TimeoutError``):
a reply arriving after that would be given to the wrong caller, so the connection cannot be kept.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import hiredis
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection, parse_url
from redis.exceptions import ConnectionError, ResponseError, TimeoutError

Arg = str | bytes | int | float


def encode(args: Sequence[Arg]) -> bytes:
    """One command as a RESP array of bulk strings (numbers as ``redis-py`` writes them)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, (int, float)) and not isinstance(arg, bool):
            data = repr(arg).encode()
        else:
            raise TypeError(f"a Redis argument must be str, bytes, int or float, not {type(arg).__name__}")
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class _Protocol(asyncio.Protocol):
    """One connection: commands written as they come, replies matched to their futures in order."""

    def __init__(self, timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._reader = hiredis.Reader(replyError=ResponseError)
        self._waiting: deque[asyncio.Future[Any]] = deque()
        self._transport: asyncio.Transport | None = None
        self._timeout_s = timeout_s
        self._progress = 0.0  # loop time of the last reply (or of the first command after a quiet spell)
        self._watchdog: asyncio.TimerHandle | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while True:
            try:
                reply = self._reader.gets()
            except hiredis.ProtocolError as exc:
                self._fail(ConnectionError(f"Redis protocol error: {exc}"))
                return
            if reply is False:
                break
            self._progress = self._loop.time()
            future = self._waiting.popleft()
            if not future.done():  # its caller may have gone away: the reply is still its own
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"Redis connection lost: {exc}" if exc else "Redis closed the connection"))

    def send(self, commands: Iterable[Sequence[Arg]]) -> list[asyncio.Future[Any]]:
        if self.closed or self._transport is None:
            raise ConnectionError("Redis connection closed")
        data, futures = [], []
        for args in commands:
            data.append(encode(args))
            futures.append(self._loop.create_future())
        if not self._waiting:
            self._progress = self._loop.time()
        self._waiting.extend(futures)
        self._transport.write(b"".join(data))
        if self._watchdog is None:
            self._watchdog = self._loop.call_later(self._timeout_s / 4, self._watch)
        return futures

    def _watch(self) -> None:
        self._watchdog = None
        if self.closed or not self._waiting:
            return
        if self._loop.time() - self._progress > self._timeout_s:
            self._fail(TimeoutError(f"Redis answered nothing for {self._timeout_s:g} s"))
            return
        self._watchdog = self._loop.call_later(self._timeout_s / 4, self._watch)

    def _fail(self, error: Exception) -> None:
        self.closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: a caller that went away must not leave a warning
        if self._transport is not None:
            self._transport.abort()

    def close(self) -> None:
        self._fail(ConnectionError("Redis client closed"))


class _Commands:
    """The commands of the turn's path, with ``redis-py``'s names and arguments; ``_command`` runs one
    (the client) or queues it (a pipeline)."""

    def _command(self, *args: Arg) -> Any:
        raise NotImplementedError

    def get(self, key: str) -> Any:
        return self._command("GET", key)

    def mget(self, keys: Sequence[str]) -> Any:
        return self._command("MGET", *keys)

    def set(self, key: str, value: Arg, ex: int | None = None) -> Any:
        return self._command("SET", key, value, *(("EX", int(ex)) if ex is not None else ()))

    def expire(self, key: str, seconds: int) -> Any:
        return self._command("EXPIRE", key, int(seconds))

    def hget(self, key: str, field: str) -> Any:
        return self._command("HGET", key, field)

    def hmget(self, key: str, fields: Sequence[str]) -> Any:
        return self._command("HMGET", key, *fields)

    def hset(self, key: str, mapping: Mapping[str, Arg]) -> Any:
        return self._command("HSET", key, *(item for pair in mapping.items() for item in pair))

    def hsetnx(self, key: str, field: str, value: Arg) -> Any:
        return self._command("HSETNX", key, field, value)

    def zadd(self, key: str, mapping: Mapping[str, float], xx: bool = False) -> Any:
        pairs = (item for member, score in mapping.items() for item in (score, member))
        return self._command("ZADD", key, *(("XX",) if xx else ()), *pairs)

    def zrem(self, key: str, *members: str) -> Any:
        return self._command("ZREM", key, *members)

    def zcount(self, key: str, low: float | str, high: float | str) -> Any:
        return self._command("ZCOUNT", key, low, high)

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Arg) -> Any:
        return self._command("EVALSHA", sha, numkeys, *keys_and_args)

    def eval(self, script: str, numkeys: int, *keys_and_args: Arg) -> Any:
        return self._command("EVAL", script, numkeys, *keys_and_args)

    def delete(self, *keys: str) -> Any:
        return self._command("DEL", *keys)

    def ping(self) -> Any:
        return self._command("PING")


class LeanRedis(_Commands):
    """One pipelined connection to Redis (see the module docstring). ``from_url`` takes the URLs
    ``redis-py`` takes (``redis://``, ``rediss://``, ``unix://``; user, password and database number)."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 6379, path: str | None = None, db: int = 0,
                 username: str | None = None, password: str | None = None, ssl: bool = False,
                 timeout_s: float = 10.0, connect_timeout_s: float = 5.0) -> None:
        self._host, self._port, self._path, self._db = host, port, path, int(db)
        self._username, self._password, self._ssl = username, password, ssl
        self._timeout_s, self._connect_timeout_s = timeout_s, connect_timeout_s
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Lock | None = None
        self.connections = 0  # opened so far (a new one after each loss)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> LeanRedis:
        parsed = parse_url(url)
        kind = parsed.pop("connection_class", None)
        options = {key: parsed[key] for key in ("host", "port", "path", "db", "username", "password") if key in parsed}
        if kind is not None and kind is not UnixDomainSocketConnection and not issubclass(kind, SSLConnection):
            raise ValueError(f"unsupported Redis URL for the lean client: {url}")
        return cls(**options, ssl=kind is not None and issubclass(kind, SSLConnection), **kwargs)

    async def _open(self) -> _Protocol:
        protocol = self._protocol
        if protocol is not None and not protocol.closed:
            return protocol
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:  # callers arriving together share one attempt
            if self._protocol is not None and not self._protocol.closed:
                return self._protocol
            loop = asyncio.get_running_loop()
            try:
                async with asyncio.timeout(self._connect_timeout_s):
                    if self._path:
                        _, protocol = await loop.create_unix_connection(lambda: _Protocol(self._timeout_s), self._path)
                    else:
                        context = ssl_module.create_default_context() if self._ssl else None
                        _, protocol = await loop.create_connection(lambda: _Protocol(self._timeout_s), self._host,
                                                                   self._port, ssl=context)
                    hello: list[tuple[Arg, ...]] = []
                    if self._password is not None:
                        hello.append(("AUTH", self._username, self._password) if self._username
                                     else ("AUTH", self._password))
                    if self._db:
                        hello.append(("SELECT", self._db))
                    for reply in await asyncio.gather(*protocol.send(hello)):
                        if isinstance(reply, Exception):
                            protocol.close()
                            raise ConnectionError(f"Redis refused the connection's setup: {reply}")
            except (OSError, asyncio.TimeoutError) as exc:
                raise ConnectionError(f"cannot connect to Redis: {type(exc).__name__}: {exc}") from exc
            self._protocol = protocol
            self.connections += 1
            return protocol

    async def execute_command(self, *args: Arg) -> Any:
        """One command's reply; an error reply is raised (``ResponseError``)."""
        protocol = await self._open()
        reply = await protocol.send((args,))[0]
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    def _command(self, *args: Arg) -> Any:
        return self.execute_command(*args)

    async def execute_many(self, commands: Sequence[Sequence[Arg]], raise_on_error: bool = True) -> list[Any]:
        """Several commands in one write; their replies in order, error replies as ``ResponseError``
        values (raised, the first of them, with ``raise_on_error``)."""
        if not commands:
            return []
        protocol = await self._open()
        replies = [await future for future in protocol.send(commands)]
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, ResponseError):
                    raise reply
        return replies

    def pipeline(self, transaction: bool = False) -> LeanPipeline:
        if transaction:
            raise ValueError("the lean Redis client has no transactions (MULTI/EXEC): use redis-py")
        return LeanPipeline(self)

    async def aclose(self) -> None:
        if self._protocol is not None:
            self._protocol.close()
            self._protocol = None


class LeanPipeline(_Commands):
    """Commands queued with ``redis-py``'s pipeline methods and sent together by ``execute``."""

    def __init__(self, client: LeanRedis) -> None:
        self._client = client
        self._commands: list[tuple[Arg, ...]] = []

    def _command(self, *args: Arg) -> LeanPipeline:
        self._commands.append(args)
        return self

    def __len__(self) -> int:
        return len(self._commands)

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        commands, self._commands = self._commands, []
        return await self._client.execute_many(commands, raise_on_error=raise_on_error)

    async def __aenter__(self) -> LeanPipeline:
        return self

    async def __aexit__(self, *_: object) -> None:
        self._commands = []
