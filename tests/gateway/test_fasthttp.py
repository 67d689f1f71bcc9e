"""The lean engine HTTP client (``gateway.fasthttp``) behind ``EngineClient``, over real HTTP: the same
outputs and error mapping as the httpx path (the fakes of test_engine_client served by uvicorn), kept
connections, timeouts, a kept connection the server drops, early close."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
import uvicorn

from gateway.engine_client import EngineClient, EngineRouter, SamplingParams
from gateway.engines import FastTransport
from gateway.errors import EngineError, EngineUnavailable, InvalidRequest
from gateway.fasthttp import FastHTTP, lines
from tests.gateway.asgi import request_body
from tests.gateway.test_engine_client import EOT, FakeEngine, body, collect, until_held

Handler = Callable[[httpx.Request], Awaitable[httpx.Response] | httpx.Response]


class Served:
    """An httpx handler (the fakes at the protocol boundary) served over real HTTP by uvicorn in this loop;
    counts the TCP connections it accepted."""

    def __init__(self, handler: Handler, *, keep_alive_s: float = 5.0) -> None:
        self.handler = handler
        self.keep_alive_s = keep_alive_s
        self.connections = 0
        self.requests: list[str] = []

    async def app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        data = await request_body(receive)
        self.requests.append(scope["path"])
        request = httpx.Request(scope["method"], f"http://e{scope['path']}", content=data,
                                headers=[(k.decode(), v.decode()) for k, v in scope["headers"]])
        got = self.handler(request)
        response = await got if asyncio.iscoroutine(got) else got
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": [(k.encode(), v.encode()) for k, v in response.headers.items()
                                if k.lower() not in ("content-length", "transfer-encoding")]})
        try:
            whole: bytes | None = response.content  # built with json= / text=
        except httpx.ResponseNotRead:
            whole = None  # an async stream of events
        if whole is not None:
            await send({"type": "http.response.body", "body": whole, "more_body": True})
        else:
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def __aenter__(self) -> Served:
        outer = self
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                interface="asgi3", timeout_keep_alive=self.keep_alive_s)
        self.server = uvicorn.Server(config)
        self.task = asyncio.ensure_future(self.server.serve())
        while not self.server.started:
            await asyncio.sleep(0.01)
        sock = self.server.servers[0].sockets[0]
        self.url = "http://127.0.0.1:%d" % sock.getsockname()[1]
        original = self.server.server_state.connections

        class Seen(set):  # type: ignore[type-arg]
            def add(self, item: Any) -> None:
                outer.connections += 1
                super().add(item)

        self.server.server_state.connections = Seen(original)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        await self.task


async def _until(check: Callable[[], Any]) -> None:
    async with asyncio.timeout(120):  # a hang guard
        while not check():
            await asyncio.sleep(0.005)


async def router_over(engine: FakeEngine, served: Served, fast: FastHTTP) -> tuple[EngineRouter, httpx.AsyncClient]:
    http = httpx.AsyncClient()
    return EngineRouter([EngineClient(served.url, http, fast=fast)]), http


async def test_generate_stream_and_errors_match_the_httpx_path() -> None:
    engine = FakeEngine("a", [5, 6, 7, EOT])
    fast = FastHTTP()
    async with Served(engine.handler) as served:
        router, http = await router_over(engine, served, fast)
        transport = router.engines[0].client.transport  # type: ignore[attr-defined]
        assert isinstance(transport, FastTransport) and transport.fast is fast
        params = SamplingParams(max_new_tokens=10, seed=4, stop=["x"], stop_token_ids=[EOT])
        for _ in range(3):
            gen = await collect(router, [1, 2, 3], params, affinity_key=None, stream=False)
            assert gen.output_ids == [5, 6, 7, EOT] and gen.finish == "stop" and gen.logprobs == [-0.5] * 4
        assert engine.requests[-1]["sampling_params"]["sampling_seed"] == 4
        seen = []
        async for gen in router.generate([1, 2, 3], params, affinity_key=None, stream=True):
            seen.append(list(gen.output_ids))
        assert seen == [[5], [5, 6], [5, 6, 7], [5, 6, 7, EOT]] and gen.finish == "stop"
        assert await router.engines[0].client.health()  # the probe goes through the lean client too
        assert served.connections == 1  # every request on one kept connection
        with pytest.raises(InvalidRequest, match="prompt too long") as err:
            await collect(router, [666], params, affinity_key=None, stream=False)
        assert err.value.code == "context_length_exceeded"
        with pytest.raises(InvalidRequest, match="prompt too long"):
            await collect(router, [666], params, affinity_key=None, stream=True)
        assert router.engines[0].healthy  # a refusal says nothing about the engine's health
    # the server is gone: connection refused is an unavailable engine, out of rotation
    with pytest.raises(EngineUnavailable, match="HTTP connect"):
        await collect(router, [1], params, affinity_key=None, stream=False)
    assert not router.engines[0].healthy
    assert not await router.engines[0].client.health()
    await http.aclose()
    await fast.close()


async def test_stream_error_event_and_pause_resume_over_real_http() -> None:
    engine = FakeEngine("a", [10, 11, 12, 13, 14, 15, EOT])
    engine.hold_at_step = True  # the stream waits after two tokens until the pause: it lands mid-stream
    fast = FastHTTP()
    async with Served(engine.handler) as served:
        router, http = await router_over(engine, served, fast)
        seen: list[list[int]] = []

        async def consume() -> Any:
            last = None
            async for gen in router.generate([1, 2], SamplingParams(max_new_tokens=50), affinity_key="s",
                                             stream=True):
                seen.append(list(gen.output_ids))
                last = gen
            return last

        task = asyncio.create_task(consume())
        await asyncio.wait_for(engine.step.wait(), 120)  # a hang guard
        await router.pause()
        await until_held(router)
        assert router.held == 1 and not task.done()
        await router.resume(5)
        gen = await asyncio.wait_for(task, 120)
        assert gen.output_ids == [10, 11, 12, 13, 14, 15, EOT] and gen.segments == 2
        assert 5 in gen.versions and all(seen[i] == seen[i + 1][: len(seen[i])] for i in range(len(seen) - 1))
        await http.aclose()

    answers = {"other": 'data: {"error": {"message": "top_p must be in (0, 1]"}}\r\n\r\ndata: [DONE]\r\n\r\n',
               "down": 'data: {"error": {"message": "overloaded", "code": 503}}\n\ndata: [DONE]\n\n',
               "junk": "data: {not json\n\n", "500": ""}
    current = {"answer": ""}

    def handler(request: httpx.Request) -> httpx.Response:
        if current["answer"] == "":
            return httpx.Response(500, text="boom")
        return httpx.Response(200, text=current["answer"], headers={"content-type": "text/event-stream"})

    async with Served(handler) as served, httpx.AsyncClient() as http:
        client = EngineClient(served.url, http, fast=fast)

        async def first_error(kind: str) -> Exception:
            current["answer"] = answers[kind]
            with pytest.raises(Exception) as err:
                async for _ in client.generate_stream([1, 2], SamplingParams(max_new_tokens=4), 4):
                    pass
            return err.value

        other = await first_error("other")
        assert type(other) is InvalidRequest and "top_p" in other.message
        assert isinstance(await first_error("down"), EngineUnavailable)
        assert type(await first_error("junk")) is EngineError
        boom = await first_error("500")
        assert type(boom) is EngineError and "500: boom" in boom.message
    await fast.close()


async def test_timeout_cancel_and_a_kept_connection_dropped_by_the_server() -> None:
    release = asyncio.Event()
    aborted: list[str] = []
    waiting: list[str] = []  # the rids of the requests the engine holds

    async def slow(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/abort_request":
            aborted.append(json.loads(request.content)["rid"])
            return httpx.Response(200, json={})
        if json.loads(request.content)["input_ids"] == [9]:
            waiting.append(json.loads(request.content)["rid"])
            await release.wait()
        return httpx.Response(200, json=body([4, EOT], {"type": "stop", "matched": EOT}))

    fast = FastHTTP()
    async with Served(slow) as served, httpx.AsyncClient() as http:
        client = EngineClient(served.url, http, timeout_s=0.3, fast=fast)
        with pytest.raises(EngineUnavailable, match="HTTP timeout"):
            await client.generate([9], SamplingParams(max_new_tokens=4), 4)
        await _until(lambda: aborted)  # the gateway gave up: it tells the engine to stop too
        assert len(aborted) == 1
        client = EngineClient(served.url, http, timeout_s=30, fast=fast)
        task = asyncio.ensure_future(client.generate([9], SamplingParams(max_new_tokens=4), 4))
        await _until(lambda: len(waiting) == 2)  # the engine has the request
        task.cancel()  # the agent went away
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(lambda: len(aborted) == 2)
        assert len(aborted) == 2 and aborted[1] == waiting[1]
        release.set()
        out = await client.generate([1], SamplingParams(max_new_tokens=4), 4)
        assert out.output_ids == [4, EOT]

    # a server that closes each connection right after its response (what its keep-alive timeout firing
    # on an idle kept connection looks like): the next request finds the kept connection dead before using
    # it and goes out on a new one; every request is read exactly once
    accepted = 0
    read: list[str] = []

    async def close_after_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
        read.append(json.loads(await reader.readexactly(length))["rid"])
        payload = json.dumps(body([3, EOT], {"type": "stop", "matched": EOT})).encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(payload), payload))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(close_after_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with httpx.AsyncClient() as http:
        client = EngineClient(f"http://127.0.0.1:{port}", http, fast=fast)
        for _ in range(3):
            assert (await client.generate([1], SamplingParams(max_new_tokens=4), 4)).output_ids == [3, EOT]
    assert accepted == 3 and len(read) == len(set(read)) == 3
    server.close()
    await fast.close()


async def test_a_request_the_engine_read_is_not_sent_again() -> None:
    """Review finding on 15d97e2: a POST /generate on a reused kept connection that closed before any
    response byte was sent again on a new connection, also when the engine had read it and started. The
    retry carries the same ``rid``; SGLang's TokenizerManager refuses a rid it still holds ("Duplicate
    request ID detected", 400), so the agent got a 400 for a valid request, and no abort was sent. Now the
    dropped connection is EngineUnavailable (503, as on the httpx path) and the rid is aborted."""
    generated: list[str] = []
    aborted: list[str] = []
    running: set[str] = set()
    served = 0

    def respond(writer: asyncio.StreamWriter, status: bytes, payload: dict) -> None:
        data = json.dumps(payload).encode()
        writer.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (status, len(data), data))

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            path = head.split(b" ")[1]
            length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
            rid = json.loads(await reader.readexactly(length))["rid"]
            if path == b"/abort_request":
                aborted.append(rid)
                respond(writer, b"200 OK", {})
                await writer.drain()
                continue
            generated.append(rid)
            if rid in running:  # what SGLang answers for a rid it still holds
                respond(writer, b"400 Bad Request", {"error": {"message": f"Duplicate request ID detected: {rid}"}})
                await writer.drain()
                continue
            served += 1
            if served == 1:  # the first request is answered on a connection that stays open
                respond(writer, b"200 OK", body([3, EOT], {"type": "stop", "matched": EOT}))
                await writer.drain()
                continue
            running.add(rid)  # the second one is read and started, then its connection drops unanswered
            await asyncio.sleep(0.2)
            writer.transport.abort()
            await asyncio.sleep(1.0)  # the engine notices the client went away only later
            running.discard(rid)
            return

    server = await asyncio.start_server(engine, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    fast = FastHTTP()
    async with httpx.AsyncClient() as http:
        client = EngineClient(f"http://127.0.0.1:{port}", http, fast=fast)
        assert (await client.generate([1], SamplingParams(max_new_tokens=4), 4)).output_ids == [3, EOT]
        with pytest.raises(EngineUnavailable, match="HTTP closed"):
            await client.generate([2], SamplingParams(max_new_tokens=4), 4)
    server.close()
    await fast.close()
    assert len(generated) == len(set(generated)) == 2, f"the same /generate (rid) was sent twice: {generated}"
    assert aborted == [generated[1]]  # the best-effort abort of the request that may still run


async def test_lines_splits_like_httpx() -> None:
    async def chunks(parts: list[bytes]) -> AsyncIterator[tuple[int, Any]]:
        yield 200, None
        for part in parts:
            yield 200, part

    text = b"data: a\r\n\r\ndata: \xc3\xa9b\n\ndata: c\rdata: d"
    for cut in range(len(text) + 1):
        for cut2 in range(cut, len(text) + 1, 3):
            got = [line async for line in lines(chunks([text[:cut], text[cut:cut2], text[cut2:]]))]
            assert got == ["data: a", "", "data: \u00e9b", "", "data: c", "data: d"], (cut, cut2)
    response = httpx.Response(200, content=text)
    assert [line async for line in response.aiter_lines()] == ["data: a", "", "data: \u00e9b", "", "data: c",
                                                               "data: d"]
