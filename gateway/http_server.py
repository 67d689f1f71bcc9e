"""The gateway's HTTP/1.1 protocol: uvicorn's httptools protocol plus a deadline on request headers.

uvicorn times out idle keep-alive connections but not a request whose headers trickle in: a client that
sends one header byte every few seconds (slowloris) holds a connection, and its file descriptor, for as
long as it likes (seen: 350 such connections stayed open). Here each request's headers must be complete
within ``--header-timeout-s`` of their first byte (of the connection's opening, for the first request);
otherwise the connection gets a 408 and is closed. The deadline ends with the headers: a slow body has its
own limit (``--body-timeout-s``, enforced by the routes), and a long streamed answer is not a request.

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
        super().connection_made(transport)
        self._arm()  # a connection that never sends a byte is a request whose headers are late too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:  # the first byte of a request (keep-alive: of the next one)
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()


def protocol(header_timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """A protocol class to hand one server's uvicorn (``http=``), with that server's header deadline."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": header_timeout_s})
