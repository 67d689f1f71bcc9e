"""The wire-format contract (``gateway.formats.contract.WireFormat``): a fourth format is one class and a
route that calls ``gateway.routes.generation.serve`` with it. This test writes one (plain text in, plain
text out, errors in its own shape), mounts it on a gateway in process and checks that the generic route
gives it what the three real formats get: its id prefix, its recorded metadata, its rendering (whole and
streamed, the stream's end sent after the commit) and its error shape. Upstream: the scripted stand-in."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.errors import GatewayError
from gateway.formats.contract import CoreRequest
from gateway.routes.common import direct
from gateway.routes.generation import serve
from gateway.wire import ChatCompletionRequest, WireModel
from tests.inprocess import inprocess_gateway, tokenizer  # noqa: F401 (fixture)
from tests.standin import build_app

ADMIN, AGENT = "admin-key", "agent-key"
REPLY = "Plain words back."


class PlainRequest(WireModel):
    text: str
    max_tokens: int = 32
    stream: bool = False

    @property
    def messages(self) -> list[dict[str, Any]]:  # what the episode linker reads of a request
        return [{"role": "user", "content": self.text}]


class PlainFormat:
    name = "plain"
    request_model = PlainRequest
    id_prefix = "txt_"

    def error_body(self, exc: GatewayError) -> tuple[int, dict[str, Any]]:
        return exc.status, {"problem": exc.message}

    async def to_core(self, svc: Any, who: Any, req: PlainRequest) -> CoreRequest[PlainRequest]:
        core = ChatCompletionRequest.model_validate({"model": svc.model_name, "messages": req.messages,
                                                     "max_tokens": req.max_tokens, "stream": req.stream})
        return CoreRequest(wire=req, core=core, meta={"format": "plain"})

    def render(self, turn: CoreRequest[Any], plan: Any, runs: list[Any], svc: Any) -> dict[str, Any]:
        return {"id": runs[0].id, "text": runs[0].result.message()["content"], "prompt_tokens": len(plan.prompt)}

    async def stream(self, turn: CoreRequest[Any], plan: Any, runs: list[Any], events: AsyncIterator[Any],
                     svc: Any) -> AsyncIterator[bytes]:
        async for event in events:
            if event.kind == "delta" and event.delta is not None and event.delta.content:
                yield event.delta.content.encode()
            elif event.kind == "recorded":
                yield f"\n[recorded {runs[0].id}]".encode()


PLAIN = PlainFormat()
router = APIRouter()


@router.post("/v1/plain")
@direct
async def plain(request: Request) -> Response:
    return await serve(request, PLAIN)


@pytest.fixture
async def gw(tmp_path: Path, tiny_model_dir: Path, tokenizer: Any) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    upstream = httpx.ASGITransport(app=build_app(str(tiny_model_dir), [REPLY], tokenizer=tokenizer))

    def add_plain(app: Any) -> None:
        app.include_router(router)
        app.include_direct_routes(router, "")

    async with inprocess_gateway(upstream, tokenizer=tokenizer, db=f"sqlite+aiosqlite:///{tmp_path}/gw.db",
                                 admin_key=ADMIN, agent_key=[AGENT], setup=add_plain) as (app, http):
        yield app, http


async def test_a_fourth_format_is_one_class_and_a_route(gw: Any) -> None:
    app, http = gw
    store = app.state.services.store
    auth = {"Authorization": f"Bearer {AGENT}"}

    whole = await http.post("/v1/plain", json={"text": "hello"}, headers=auth)
    assert whole.status_code == 200, whole.text
    body = whole.json()
    assert body["text"] == REPLY and body["id"].startswith("txt_") and body["prompt_tokens"] > 0
    turn = await store.get_interaction(interaction_id=body["id"])
    assert turn.request["format"] == "plain"  # the format's recorded metadata
    assert turn.request["messages"] == [{"role": "user", "content": "hello"}]

    streamed = await http.post("/v1/plain", json={"text": "again", "stream": True}, headers=auth)
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    text, _, end = streamed.text.partition("\n[recorded ")
    assert text == REPLY and end.startswith("txt_")
    recorded = await store.get_interaction(interaction_id=end.rstrip("]"))  # committed before the end was sent
    assert recorded.request["format"] == "plain"

    bad = await http.post("/v1/plain", json={"text": 5}, headers=auth)  # the format's own error shape
    assert bad.status_code == 400 and set(bad.json()) == {"problem"}
    nobody = await http.post("/v1/plain", json={"text": "hi"}, headers={"Authorization": "Bearer nope"})
    assert nobody.status_code == 401 and set(nobody.json()) == {"problem"}
    elsewhere = await http.post("/v1/chat/completions", json={"messages": 5}, headers=auth)
    assert elsewhere.status_code == 400 and set(elsewhere.json()) == {"error"}  # other routes keep theirs


async def test_each_route_answers_errors_in_its_formats_shape(gw: Any) -> None:
    """The shape follows the route's format, not a list of URL paths: Anthropic's on every Messages route
    (count_tokens, and under a session's base URL too), OpenAI's on the others."""
    _, http = gw
    anthropic_headers = {"x-api-key": AGENT, "anthropic-version": "2023-06-01"}
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/sessions/sess-unknown/v1/messages"):
        resp = await http.post(path, json={"model": "m", "messages": 5}, headers=anthropic_headers)
        assert resp.status_code in (400, 404), (path, resp.text)
        assert resp.json()["type"] == "error" and set(resp.json()["error"]) >= {"type", "message"}, path
    unknown_key = await http.post("/v1/messages/count_tokens", json={"model": "m", "messages": []},
                                  headers={"x-api-key": "nope"})
    assert unknown_key.status_code == 401 and unknown_key.json()["error"]["type"] == "authentication_error"
    for path in ("/v1/responses", "/v1/chat/completions", "/v1/completions"):
        resp = await http.post(path, json={"model": "m", "input": 5, "messages": 5, "prompt": 5},
                               headers={"Authorization": f"Bearer {AGENT}"})
        assert resp.status_code == 400 and "type" not in resp.json() and "message" in resp.json()["error"], path
