"""Slow request headers (slowloris) over a raw socket against a real gateway process: a request whose headers
trickle in is cut off with 408 after ``--header-timeout-s``; a slow body, a keep-alive connection idle between
requests and a streamed answer longer than the deadline are not affected."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from gateway.http_server import protocol
from tests.gateway.asgi import request_body
from tests.gateway.conftest import GatewayProc

HEADER_TIMEOUT_S = 1.0


def _connect(gw: GatewayProc) -> socket.socket:
    host, port = gw.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    return sock


def _request(gw: GatewayProc, body: bytes, path: str = "/v1/chat/completions") -> tuple[bytes, bytes]:
    head = (f"POST {path} HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {gw.agent_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    return head, body


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    """Status and body of one response with a Content-Length (or up to EOF)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head else 0
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                   if line.lower().startswith(b"content-length:")), None)
    while length is not None and len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return status, rest


def test_slow_headers_are_cut_off_and_slow_bodies_keep_alive_and_streams_are_not(
        gateway_factory: Callable[..., GatewayProc]) -> None:
    gw = gateway_factory(extra_args=("--header-timeout-s", str(HEADER_TIMEOUT_S)))
    chat = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()

    # slowloris: one header byte every 0.2 s; the gateway answers 408 and closes long before the headers end
    head, body = _request(gw, chat)
    head = head.replace(b"\r\n\r\n", b"\r\n" + b"X-Pad: " + b"a" * 100 + b"\r\n\r\n")  # ~50 s at this pace
    with _connect(gw) as sock:
        cut_off = False
        for i in range(len(head)):
            try:
                sock.sendall(head[i:i + 1])
            except OSError:  # reset: the gateway closed the connection
                cut_off = True
                break
            sock.settimeout(0.2)
            try:
                if sock.recv(65536, socket.MSG_PEEK):
                    cut_off = True
                    break
            except TimeoutError:
                continue
            finally:
                sock.settimeout(60)
        assert cut_off, "the gateway kept waiting for headers sent byte by byte"
        status, text = _read_response(sock)
        assert status == 408 and b"headers" in text
        assert sock.recv(65536) == b""  # and closed

    # a silent connection is closed too
    with _connect(gw) as sock:
        status, _ = _read_response(sock)
        assert status == 408

    # headers in time, the body slowly (well within --body-timeout-s): served; then the same connection idles
    # longer than the header deadline (but within keep-alive) and serves a second request
    with _connect(gw) as sock:
        head, body = _request(gw, chat)
        sock.sendall(head)
        for i in range(0, len(body), 8):
            time.sleep(3 * HEADER_TIMEOUT_S / (len(body) / 8))
            sock.sendall(body[i:i + 8])
        status, text = _read_response(sock)
        assert status == 200, text
        assert json.loads(text)["choices"][0]["message"]["role"] == "assistant"
        time.sleep(2 * HEADER_TIMEOUT_S)
        sock.sendall(head + body)
        status, text = _read_response(sock)
        assert status == 200, text

    # a streamed answer read more slowly than the header deadline is not cut
    stream = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
                         "stream": True}).encode()
    with _connect(gw) as sock:
        head, body = _request(gw, stream)
        sock.sendall(head + body)
        received = sock.recv(64)
        time.sleep(2 * HEADER_TIMEOUT_S)  # a slow reader
        while b"data: [DONE]" not in received:
            chunk = sock.recv(65536)
            assert chunk, f"stream cut: {received[-300:]!r}"
            received += chunk
        assert received.startswith(b"HTTP/1.1 200")


async def test_two_servers_in_one_process_keep_their_own_header_deadlines() -> None:
    """The deadline belongs to the server it was given to, not to the process: a server started later with a
    longer deadline does not lengthen the first one's."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:  # never reached: no request is sent
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})

    servers, tasks = [], []
    for timeout_s in (0.3, 30.0):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=protocol(timeout_s)))
        tasks.append(asyncio.create_task(server.serve(sockets=[sock])))
        servers.append((server, sock.getsockname()[1]))
    try:
        while not all(server.started for server, _ in servers):
            await asyncio.sleep(0.01)
        (_, short_port), (_, long_port) = servers
        short = await asyncio.open_connection("127.0.0.1", short_port)
        long = await asyncio.open_connection("127.0.0.1", long_port)
        # two silent connections: the short deadline's server answers 408 and closes ...
        answer = await asyncio.wait_for(short[0].read(), timeout=10)
        assert answer.startswith(b"HTTP/1.1 408") and short[0].at_eof()
        # ... while the long one's keeps waiting for the headers, well past the short deadline
        try:
            early = await asyncio.wait_for(long[0].read(1), timeout=1.0)
        except TimeoutError:
            early = None
        assert early is None, f"the 30 s deadline answered early: {early!r}"
        for _, writer in (short, long):
            writer.close()
    finally:
        for server, _ in servers:
            server.should_exit = True
        await asyncio.gather(*tasks)


class _CountingTransport:
    """The connection's real transport, counting the writes that reach it."""

    def __init__(self, transport: asyncio.Transport, writes: list[bytes]) -> None:
        self._transport, self._writes = transport, writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


async def test_a_response_head_and_body_go_out_in_one_write_and_streams_are_not_held() -> None:
    """uvicorn writes a response's head and body separately (two system calls); the gateway's protocol sends
    them as one. A streamed chunk still goes out in the event loop step that produced it, and uvicorn's
    ``100 Continue`` reaches a client that waits for it before sending its body."""
    writes: list[bytes] = []
    release = asyncio.Event()

    class Counting(protocol(30.0)):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(_CountingTransport(transport, writes))  # type: ignore[arg-type]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = await request_body(receive)
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            await release.wait()  # the client has the first chunk before the second exists
            await send({"type": "http.response.body", "body": b"second", "more_body": False})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body) + 4).encode())]})
        await send({"type": "http.response.body", "body": b"got " + body})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=Counting))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        for payload in (b"one", b"two"):  # keep-alive: two requests on one connection
            before = len(writes)
            writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\n" + payload)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
            assert head.startswith(b"HTTP/1.1 200")
            assert await asyncio.wait_for(reader.readexactly(7), timeout=10) == b"got " + payload
            assert len(writes) == before + 1 and writes[-1].startswith(b"HTTP/1.1 200")
            assert writes[-1].endswith(b"got " + payload)

        writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"later")
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        assert await asyncio.wait_for(reader.readexactly(9), timeout=10) == b"got later"

        writer.write(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        assert await asyncio.wait_for(reader.readuntil(b"first\r\n"), timeout=10) == b"5\r\nfirst\r\n"
        release.set()
        assert await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), timeout=10) == b"6\r\nsecond\r\n0\r\n\r\n"
        writer.close()
    finally:
        server.should_exit = True
        await task
