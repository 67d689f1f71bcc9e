"""The gateway's HTTP/1.1 protocol: uvicorn's httptools protocol plus a deadline on request headers.

uvicorn times out idle keep-alive connections but not a request whose headers trickle in: a client that
sends one header byte every few seconds (slowloris) holds a connection, and its file descriptor, for as
long as it likes (seen: 350 such connections stayed open). Here each request's headers must be complete
within ``--header-timeout-s`` of their first byte (of the connection's opening, for the first request);
otherwise the connection gets a 408 and is closed. The deadline ends with the headers: a slow body has its
own limit (``--body-timeout-s``, enforced by the routes), and a long streamed answer is not a request.

A response's head and body are sent in one write (:class:`CoalescedWrites`): uvicorn writes the status line
and headers, then the body, as two ``send`` system calls; on loopback each one also runs the receiver's
side of TCP, and the two were ~10 % of the gateway's CPU per turn (py-spy, 2026-12-01).

uvicorn is given a class as ``http=`` and builds one protocol object per connection from the class alone, so
the deadline is a class attribute: :func:`protocol` makes a subclass of its own for each server (two apps in
one process keep their own deadlines).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_TIMEOUT_BODY = b"request headers not received in time\n"
_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                     b"content-length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\nconnection: close\r\n\r\n"
                     + _TIMEOUT_BODY)


class CoalescedWrites:
    """A connection's transport whose writes are held and sent together: when the response is complete
    (:meth:`HeaderTimeoutProtocol.on_response_complete` flushes), before a close, or at the latest on the
    event loop's next step (a streamed chunk, uvicorn's ``100 Continue``). Everything else is the
    transport's own."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)

    def flush(self) -> None:
        pending = self._pending
        if not pending:
            return
        self._pending = []
        if not self.transport.is_closing():
            self.transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def abort(self) -> None:
        self._pending = []
        self.transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` whose requests must send their headers within :attr:`header_timeout_s`."""

    header_timeout_s: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers took longer than %gs",
                             self.header_timeout_s)
            self.transport.write(_TIMEOUT_RESPONSE)
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # flow control keeps the transport itself
        self.transport = CoalescedWrites(transport, self.loop)  # type: ignore[assignment]
        self._arm()  # a connection that never sends a byte is a request whose headers are late too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self.transport.flush()  # type: ignore[attr-defined]
        super().on_response_complete()

    def on_message_begin(self) -> None:  # the first byte of a request (keep-alive: of the next one)
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()


def protocol(header_timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """A protocol class to hand one server's uvicorn (``http=``), with that server's header deadline."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": header_timeout_s})
