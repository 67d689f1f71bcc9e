"""Middleware added to the app sees every request, the generation routes too: they are served straight from
the app's ASGI entry (``GatewayApp``), and a middleware added with ``add_middleware`` used to wrap only the
other routes, silently. Driven through the real ``openai`` and ``anthropic`` SDKs in process; the upstream
is the scripted stand-in (``tests/standin.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import Response

from gateway.app import GatewayApp
from tests.inprocess import inprocess_gateway, tokenizer  # noqa: F401 (fixture)
from tests.standin import build_app

ADMIN, AGENT = "admin-key", "agent-key"


class Tagging:
    """A pure ASGI middleware: notes each request's path and tags its answer with a header."""

    def __init__(self, app: Any, seen: list[str]) -> None:
        self.app = app
        self.seen = seen

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.seen.append(scope["path"])

        async def tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-tagged", b"yes")]}
            await send(message)

        await self.app(scope, receive, tagged)


class Timing(BaseHTTPMiddleware):
    """Starlette's ``BaseHTTPMiddleware`` (``call_next``): the other way middleware is written."""

    async def dispatch(self, request: Request, call_next: Any) -> Response:
        response = await call_next(request)
        response.headers["x-outer"] = "1"
        return response


@pytest.fixture
async def app_with_middleware(tmp_path: Path, tiny_model_dir: Path, tokenizer: Any) -> AsyncIterator[
        tuple[GatewayApp, httpx.AsyncClient, list[str]]]:
    upstream = httpx.ASGITransport(app=build_app(str(tiny_model_dir), ["Hello there."], tokenizer=tokenizer))
    seen: list[str] = []

    def add_middleware(app: Any) -> None:
        assert isinstance(app, GatewayApp)
        app.add_middleware(Tagging, seen=seen)
        app.add_middleware(Timing)

    async with inprocess_gateway(upstream, tokenizer=tokenizer, db=f"sqlite+aiosqlite:///{tmp_path}/gw.db",
                                 admin_key=ADMIN, agent_key=[AGENT], setup=add_middleware) as (app, http):
        yield app, http, seen


async def test_added_middleware_wraps_the_generation_routes_and_the_others(app_with_middleware: Any) -> None:
    app, http, seen = app_with_middleware
    client = openai.AsyncOpenAI(api_key=AGENT, base_url="http://gw/v1", http_client=http)
    chat = await client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=16)
    assert chat.headers["x-tagged"] == "yes" and chat.headers["x-outer"] == "1"
    assert chat.parse().choices[0].message.content == "Hello there."

    stream = await client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=16, stream=True)
    assert stream.headers["x-tagged"] == "yes" and stream.headers["x-outer"] == "1"
    assert "".join([c.choices[0].delta.content or "" async for c in stream.parse() if c.choices]) == "Hello there."

    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), timeout=30) as http2:  # its httpx
        claude = anthropic.AsyncAnthropic(api_key=AGENT, base_url="http://gw", http_client=http2, max_retries=0)
        answer = await claude.messages.with_raw_response.create(
            model="m", max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    assert answer.headers["x-tagged"] == "yes" and answer.headers["x-outer"] == "1"

    models = await http.get("/v1/models", headers={"Authorization": f"Bearer {AGENT}"})  # a FastAPI route
    assert models.status_code == 200 and models.headers["x-tagged"] == "yes" and models.headers["x-outer"] == "1"
    bad = await http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {AGENT}"}, content=b"{")
    assert bad.status_code == 400 and bad.headers["x-tagged"] == "yes"  # an error answered on the direct path
    assert seen == ["/v1/chat/completions", "/v1/chat/completions", "/v1/messages", "/v1/models",
                    "/v1/chat/completions"]

    # the app's own request metrics count the direct path once (inline), not twice
    text = (await http.get("/metrics")).text
    ok = [line for line in text.splitlines()
          if line.startswith("agentrl_gateway_requests_total{") and 'route="/v1/chat/completions"' in line
          and 'status="200"' in line]
    assert len(ok) == 1 and ok[0].endswith(" 2.0"), ok

    with pytest.raises(RuntimeError, match="after an application has started"):
        app.add_middleware(Timing)
