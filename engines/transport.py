"""The transport seam: what carries an engine client's bytes, apart from what the client makes of them.

As httpx separates its ``Client`` from its transports, each engine kind's client has one code path for
every call (build the body, send it, read the status and the body or the stream's lines, map errors), and a
:class:`Transport` carries the bytes. Two exist: :class:`HTTPXTransport` over an ``httpx.AsyncClient`` (so
that tests put an ``httpx.MockTransport`` at the protocol boundary) and the gateway's lean HTTP/1.1 client
(``gateway.engines.FastTransport`` over ``gateway.fasthttp``, which this package does not import).

A transport raises :class:`TransportError` when no complete response came: ``kind`` ``connect`` (nothing
listens, or the connection was refused), ``timeout`` (no answer in time: the engine is alive but busy),
``closed`` or ``protocol``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Protocol

import httpx

_JSON = {"content-type": "application/json"}


class TransportError(Exception):
    """A request that got no complete response (see the module docstring for ``kind``)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Stream(Protocol):
    """A streamed response: its status, then its body as text lines (or whole, for an error answer)."""

    status: int

    def lines(self) -> AsyncGenerator[str, None]:
        """The body's text lines (``\n``, ``\r\n`` or ``\r`` ends one); the caller closes it."""
        ...

    async def read(self) -> bytes:
        """The rest of the body (an error answer's)."""
        ...

    async def finish(self) -> None:
        """Read what is left after the last event (its end), so that the connection can be kept."""
        ...


class Transport(Protocol):
    async def request(self, method: str, url: str, body: bytes | None = None, *,
                      timeout_s: float) -> tuple[int, bytes]:
        """One request (``body``: JSON bytes); the status and the whole body."""
        ...

    def stream(self, url: str, body: bytes, *, timeout_s: float) -> AbstractAsyncContextManager[Stream]:
        """``POST`` and its response as it comes; leaving the context before its end closes the connection
        (the engine sees the client go)."""
        ...


def _failure(exc: httpx.HTTPError) -> TransportError:
    if isinstance(exc, (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout)):
        kind = "timeout"
    elif isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        kind = "connect"
    elif isinstance(exc, httpx.RemoteProtocolError):
        kind = "closed"
    else:
        kind = "protocol"
    return TransportError(kind, f"{type(exc).__name__}: {exc}")


class _HTTPXStream:
    def __init__(self, resp: httpx.Response) -> None:
        self.resp, self.status = resp, resp.status_code

    async def lines(self) -> AsyncGenerator[str, None]:
        try:
            async for line in self.resp.aiter_lines():
                yield line
        except httpx.HTTPError as exc:
            raise _failure(exc) from exc

    async def read(self) -> bytes:
        try:
            return await self.resp.aread()
        except httpx.HTTPError as exc:
            raise _failure(exc) from exc

    async def finish(self) -> None:
        pass  # httpx reads or closes the rest when the context ends


class HTTPXTransport:
    """Bytes carried by an ``httpx.AsyncClient`` (connect timeout 5 s, as the lean client)."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    async def request(self, method: str, url: str, body: bytes | None = None, *,
                      timeout_s: float) -> tuple[int, bytes]:
        try:
            resp = await self.http.request(method, url, content=body, headers=_JSON if body is not None else None,
                                           timeout=httpx.Timeout(timeout_s, connect=min(5.0, timeout_s)))
        except httpx.HTTPError as exc:
            raise _failure(exc) from exc
        return resp.status_code, resp.content

    @asynccontextmanager
    async def stream(self, url: str, body: bytes, *, timeout_s: float) -> AsyncIterator[Stream]:
        try:
            async with self.http.stream("POST", url, content=body, headers=_JSON,
                                        timeout=httpx.Timeout(timeout_s, connect=5.0)) as resp:
                yield _HTTPXStream(resp)
        except httpx.HTTPError as exc:
            raise _failure(exc) from exc
