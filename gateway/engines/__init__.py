"""The gateway's binding of the engine kinds (:mod:`engines`): its errors, its transports, its start-up.

Each kind's client lives in the top-level :mod:`engines` package (``engines.sglang.SGLangClient``,
``engines.vllm.VLLMClient``, behind the :class:`~engines.base.Engine` protocol), which imports nothing of the
gateway. What the gateway adds is here:

- :data:`GATEWAY_ERRORS`: the clients raise the gateway's OpenAI-shaped errors (``gateway.errors``): an
  unreachable engine :class:`EngineUnavailable` (503), a refused request :class:`InvalidRequest` or
  :class:`ContextLengthExceeded` (400), anything else :class:`EngineError` (502);
- :class:`FastTransport`: the lean HTTP/1.1 client (``gateway.fasthttp``) as an :class:`engines.transport.
  Transport`; the SGLang-native client's bytes go through it wherever it can reach the engine (plain http,
  no proxy), everything else through the injected ``httpx.AsyncClient`` (tests put a ``MockTransport``
  there);
- :func:`make_engine`, :func:`probe_kind`, :func:`connect_engines`: the kind configured (``--engine-kind
  sglang|vllm``) or detected (``auto``) by :mod:`engines.kinds`, the one place that tells kinds apart.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from engines import ENGINE_KINDS
from engines.base import Engine, EngineInfo
from engines.kinds import connect, detect
from engines.kinds import make_engine as make_kind
from engines.sglang import SGLangClient
from engines.transport import HTTPXTransport, Stream, Transport, TransportError
from gateway.errors import ContextLengthExceeded, EngineError, EngineUnavailable, InvalidRequest
from gateway.fasthttp import FastHTTP, HTTPFailure, lines, supported

__all__ = ["ENGINE_KINDS", "GATEWAY_ERRORS", "Engine", "EngineClient", "EngineInfo", "FastTransport",
           "connect_engines", "make_engine", "probe_kind", "transport_for"]


class _GatewayErrors:
    def unavailable(self, message: str) -> Exception:
        return EngineUnavailable(message)

    def rejected(self, message: str) -> Exception:
        return InvalidRequest(message)

    def too_long(self, message: str) -> Exception:
        return ContextLengthExceeded(message, param="messages")

    def failed(self, message: str) -> Exception:
        return EngineError(message)


GATEWAY_ERRORS = _GatewayErrors()


async def _drain(chunks: AsyncIterator[Any], within_s: float = 1.0) -> None:
    """Read what is left of a response (normally only its end), so that its connection can be reused; one
    that does not end within ``within_s`` is closed instead (by the caller's ``aclose``)."""
    try:
        async with asyncio.timeout(within_s):
            async for _ in chunks:
                pass
    except (TimeoutError, HTTPFailure):  # the generation is complete either way
        pass


class _FastStream:
    def __init__(self, status: int, chunks: AsyncIterator[tuple[int, Any]]) -> None:
        self.status, self.chunks = status, chunks

    async def lines(self) -> AsyncGenerator[str, None]:
        text = lines(self.chunks)
        try:
            async for line in text:
                yield line
        except HTTPFailure as exc:
            raise TransportError(exc.kind, str(exc)) from exc
        finally:
            await text.aclose()

    async def read(self) -> bytes:
        try:
            return b"".join([chunk async for _, chunk in self.chunks if chunk])
        except HTTPFailure as exc:
            raise TransportError(exc.kind, str(exc)) from exc

    async def finish(self) -> None:
        await _drain(self.chunks)


class FastTransport:
    """:class:`engines.transport.Transport` over the gateway's lean HTTP/1.1 client: its kept connections
    expire before the engine's, and one the engine drops is retried."""

    def __init__(self, fast: FastHTTP) -> None:
        self.fast = fast

    async def request(self, method: str, url: str, body: bytes | None = None, *,
                      timeout_s: float) -> tuple[int, bytes]:
        try:
            return await self.fast.request(url, method, body, timeout_s=timeout_s)
        except HTTPFailure as exc:
            raise TransportError(exc.kind, str(exc)) from exc

    @asynccontextmanager
    async def stream(self, url: str, body: bytes, *, timeout_s: float) -> AsyncIterator[Stream]:
        chunks = self.fast.stream(url, body, timeout_s=timeout_s)
        try:
            try:
                status, _ = await chunks.__anext__()
            except HTTPFailure as exc:
                raise TransportError(exc.kind, str(exc)) from exc
            yield _FastStream(status, chunks)
        finally:
            await chunks.aclose()  # before its end: closes the connection, so the engine sees us go


def transport_for(base_url: str, http: httpx.AsyncClient, fast: FastHTTP | None = None) -> Transport:
    """The lean client where it can reach ``base_url`` (the app's own; never an injected httpx client's
    engine), else ``http``."""
    return FastTransport(fast) if fast is not None and supported(base_url) else HTTPXTransport(http)


class EngineClient(SGLangClient):
    """An SGLang-native engine as the gateway speaks to it: the gateway's errors, its bytes through the lean
    client where given one (``fast``) and it can reach the URL, else through ``http``. It binds the
    constructor's arguments only; what is said on the wire is :class:`engines.sglang.SGLangClient`'s."""

    def __init__(self, base_url: str, http: httpx.AsyncClient, *, timeout_s: float = 600.0,
                 fast: FastHTTP | None = None) -> None:
        super().__init__(base_url, transport_for(base_url, http, fast), timeout_s=timeout_s, errors=GATEWAY_ERRORS)


def make_engine(kind: str, base_url: str, http: httpx.AsyncClient, *, timeout_s: float = 600.0,
                fast: FastHTTP | None = None) -> Engine:
    """The client of one engine of a known kind (``sglang`` or ``vllm``). ``fast``: the lean HTTP client,
    for SGLang-native engines (vLLM's client goes through ``http``, as it always has)."""
    if kind == "sglang":
        return EngineClient(base_url, http, timeout_s=timeout_s, fast=fast)
    return make_kind(kind, base_url, HTTPXTransport(http), timeout_s=timeout_s, errors=GATEWAY_ERRORS)


async def probe_kind(base_url: str, http: httpx.AsyncClient) -> str | None:
    """``sglang`` or ``vllm`` by the routes the server answers (:func:`engines.kinds.detect`); None while it
    does not answer yet; a vLLM server without the routes the gateway needs is refused with the fix."""
    return await detect(base_url, HTTPXTransport(http), GATEWAY_ERRORS)


async def connect_engines(urls: list[str], kind: str, http: httpx.AsyncClient, *, timeout_s: float,
                          startup_timeout_s: float, fast: FastHTTP | None = None) -> list[Engine]:
    """One client per URL; with ``kind == "auto"`` each engine's kind is probed until it answers
    (:func:`engines.kinds.connect`), then each gets the gateway's client of its kind."""
    found = await connect(urls, kind, [HTTPXTransport(http)] * len(urls), timeout_s=timeout_s,
                          startup_timeout_s=startup_timeout_s, errors=GATEWAY_ERRORS)
    return [make_engine(engine.kind, engine.base_url, http, timeout_s=timeout_s, fast=fast) for engine in found]
