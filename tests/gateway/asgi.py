"""Small pieces of the ASGI protocol for the tests' own servers."""

from __future__ import annotations

from typing import Any


async def request_body(receive: Any) -> bytes:
    """The whole body of an ASGI HTTP request (every ``http.request`` message until ``more_body`` is false)."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body
