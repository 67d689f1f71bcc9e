"""A lean keep-alive HTTP/1.1 client for the engine calls on the hot path (``POST /generate``).

httpx costs a lot of Python per request (its request and response models, httpcore's pool and h11's
pure-Python parser): on a turn that takes a few milliseconds of CPU, the engine call through httpx was a
quarter of it. This client does only what the gateway's generation calls need: plain ``http://`` URLs, a
JSON body with ``Content-Length``, a response parsed by ``httptools`` (C, llhttp; what uvicorn uses), kept
connections reused (LIFO, dropped after ``idle_s``), the whole body (:meth:`FastHTTP.request`) or its
chunks as they come (:meth:`FastHTTP.stream`).

Failures are :class:`HTTPFailure` with ``kind`` ``connect`` (cannot connect within ``connect_s``),
``timeout`` (no byte for ``timeout_s``), ``closed`` (the server closed the connection before the response
ended) or ``protocol`` (a response that is not HTTP); :mod:`gateway.engine_client` maps them to the same
gateway errors as httpx's. A request whose reader stops early (cancelled, or a stream closed before its
end) closes its connection, so the server sees the client go. A request is sent again on a new
connection only when it provably never reached the server: a kept connection found closed (or with an end
of file or stray bytes waiting) before the request is written is dropped unused, and one whose first send
fails at once (nothing of the request left) is replaced. Once the request's bytes were handed to a live
connection it is never sent again (``/generate`` is not idempotent: the server may have read it and begun,
and SGLang refuses a second request with the same ``rid``); a connection that then closes without a
response is the ``closed`` failure.
"""

from __future__ import annotations

import asyncio
import select
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit
from urllib.request import getproxies, proxy_bypass

import httptools


class HTTPFailure(Exception):
    """A request that got no complete response; ``kind``: connect, timeout, closed, protocol."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def supported(url: str) -> bool:
    """Whether :class:`FastHTTP` can reach ``url``: plain http, no proxy configured for its host (httpx
    would use one from the environment; this client does not)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        return False
    proxies = getproxies()
    return not (proxies.get("http") or proxies.get("all")) or bool(proxy_bypass(parts.hostname))


class _Response:
    """One response being received: status once the headers are in, body chunks, completion."""

    __slots__ = ("status", "chunks", "done", "error", "keep_alive", "_waiter")

    def __init__(self) -> None:
        self.status = 0
        self.chunks: deque[bytes] = deque()
        self.done = False
        self.error: HTTPFailure | None = None
        self.keep_alive = False
        self._waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout_s: float) -> None:
        """Until something happens (headers, a chunk, the end, an error), at most ``timeout_s``."""
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout_s):
                await waiter
        except TimeoutError:
            raise HTTPFailure("timeout", f"no response data within {timeout_s:g} s") from None
        finally:
            self._waiter = None


class _Connection(asyncio.Protocol):
    """One TCP connection; at most one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: _Response | None = None
        self.closed = False
        self.idle_since = 0.0

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # bytes nobody asked for: the connection cannot be trusted any more
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(HTTPFailure("protocol", f"malformed HTTP response: {exc}"))
            self.close()

    def eof_received(self) -> bool | None:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self.response
        if response is not None and not response.done:
            self._fail(HTTPFailure("closed", "the server closed the connection before the response ended"
                                   + (f" ({exc})" if exc else "")))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        response = self.response
        if response is not None:
            response.status = self.parser.get_status_code()
            response.wake()

    def on_body(self, body: bytes) -> None:
        response = self.response
        if response is not None:
            response.chunks.append(body)
            response.wake()

    def on_message_complete(self) -> None:
        response = self.response
        if response is not None:
            response.keep_alive = self.parser.should_keep_alive()
            response.done = True
            response.wake()

    def _fail(self, error: HTTPFailure) -> None:
        response = self.response
        if response is not None and not response.done and response.error is None:
            response.error = error
            response.wake()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def usable(self) -> bool:
        """Whether this idle kept connection can take a request: open, and nothing readable on its socket
        (an end of file or a reset the event loop has not processed yet, or bytes nobody asked for)."""
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            return False
        sock = transport.get_extra_info("socket")
        if sock is None:
            return True
        try:
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN | select.POLLPRI)
            return not poller.poll(0)
        except (OSError, ValueError):
            return False


class FastHTTP:
    """Kept connections per ``host:port`` and the two calls the engine clients make."""

    def __init__(self, *, connect_s: float = 5.0, idle_s: float = 4.0, max_idle: int = 200) -> None:
        self.connect_s = connect_s
        self.idle_s = idle_s  # below uvicorn's 5 s keep-alive (SGLang, vLLM, the embedded engine)
        self.max_idle = max_idle
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._closed = False

    async def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    async def _connect(self, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_s):
                _, conn = await loop.create_connection(_Connection, host, port)
        except TimeoutError:
            raise HTTPFailure("connect", f"cannot connect to {host}:{port} within {self.connect_s:g} s") from None
        except OSError as exc:
            raise HTTPFailure("connect", f"cannot connect to {host}:{port}: {exc}") from exc
        return conn

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        conns = self._idle.get(key)
        now = time.monotonic()
        while conns:
            conn = conns.pop()
            if now - conn.idle_since < self.idle_s and conn.usable():
                return conn
            conn.close()
        return None

    def _give_back(self, key: tuple[str, int], conn: _Connection) -> None:
        conn.response = None
        if self._closed or conn.closed:
            conn.close()
            return
        conns = self._idle.setdefault(key, [])
        if len(conns) >= self.max_idle:
            conns.pop(0).close()
        conn.idle_since = time.monotonic()
        conns.append(conn)

    async def _send(self, url: str, method: str, body: bytes | None, timeout_s: float
                    ) -> tuple[tuple[str, int], _Connection, _Response]:
        """Send the request and wait for the response's headers."""
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or 80
        key = (host, port)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = (f"{method} {target} HTTP/1.1\r\nHost: {parts.netloc}\r\nAccept: */*\r\n"
                + (f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n" if body is not None else "")
                + "\r\n").encode("latin-1")
        data = head + body if body is not None else head
        conn = self._take(key)  # a kept connection found dead is dropped there, before any use
        if conn is not None:
            transport = conn.transport
            assert transport is not None
            transport.write(data)
            if transport.is_closing():
                # the first send failed at once (reset, broken pipe): not a byte of this request went
                # out, so a new connection gets it
                conn.close()
                conn = None
        if conn is None:
            conn = await self._connect(host, port)
            assert conn.transport is not None
            conn.transport.write(data)
        # from here on the server may have read the request: it is never sent again
        response = conn.response = _Response()
        try:
            while not response.status and not response.done and response.error is None:
                await response.wait(timeout_s)
            if response.error is not None:
                raise response.error
        except BaseException:
            conn.close()
            raise
        return key, conn, response

    async def request(self, url: str, method: str = "POST", body: bytes | None = None, *,
                      timeout_s: float) -> tuple[int, bytes]:
        """The status and whole body of one request (``body``: JSON bytes)."""
        key, conn, response = await self._send(url, method, body, timeout_s)
        try:
            while not response.done:
                if response.error is not None:
                    raise response.error
                await response.wait(timeout_s)
            if response.error is not None:
                raise response.error
        except BaseException:
            conn.close()
            raise
        content = b"".join(response.chunks)
        if response.keep_alive:
            self._give_back(key, conn)
        else:
            conn.close()
        return response.status, content

    async def stream(self, url: str, body: bytes, *, timeout_s: float) -> AsyncIterator[tuple[int, Any]]:
        """``POST`` and its response as it comes: first ``(status, None)``, then ``(status, chunk)`` per
        body chunk. Closing the iterator before the end closes the connection."""
        key, conn, response = await self._send(url, "POST", body, timeout_s)
        complete = False
        try:
            yield response.status, None
            while True:
                while response.chunks:
                    yield response.status, response.chunks.popleft()
                if response.done:
                    complete = True
                    break
                if response.error is not None:
                    raise response.error
                await response.wait(timeout_s)
        finally:
            if complete and response.keep_alive:
                self._give_back(key, conn)
            else:
                conn.close()


async def lines(chunks: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[str]:
    """The text lines of a streamed body (``\\n``, ``\\r\\n`` or ``\\r`` ends a line, as httpx's
    ``aiter_lines``); the first item of :meth:`FastHTTP.stream` (the status) is skipped."""
    parts: list[bytes] = []
    async for _, chunk in chunks:
        if not chunk:
            continue
        parts.append(chunk)
        if b"\n" not in chunk and b"\r" not in chunk:
            continue  # a line still arriving: joined once it ends
        data = b"".join(parts)
        held = data.endswith(b"\r")  # maybe the first half of \r\n: decided with the next chunk
        if held:
            data = data[:-1]
        *complete, rest = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        parts = [rest + b"\r"] if held else [rest] if rest else []
        for line in complete:
            yield line.decode("utf-8", "replace")
    rest = b"".join(parts).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    if rest:
        for line in (rest[:-1] if rest.endswith(b"\n") else rest).split(b"\n"):
            yield line.decode("utf-8", "replace")
