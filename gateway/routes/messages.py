"""Anthropic's Messages API: ``POST /v1/messages`` (stream and not; ``?beta=true`` too),
``POST /v1/messages/count_tokens``, and ``HEAD /`` (clients probe it before their first request).

Thin: parse (``gateway.formats.messages``), bind the session as chat completions do (the key may come as
``x-api-key``), run the conversation core and render a ``Message`` or its event stream. Errors on these
routes are rendered in Anthropic's shape by the app's error handlers (``gateway.app.ANTHROPIC_PATHS``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from gateway.binding import session_for
from gateway.chat.errors import ChatFormatError
from gateway.chat.normalize import validate_messages
from gateway.context import services
from gateway.episodes import link_request
from gateway.errors import from_chat_error
from gateway.formats import messages as fmt
from gateway.routes.common import SSE_HEADERS, caller, direct, json_body, json_response, read_json, unless_disconnected
from gateway.service import GenerationService

router = APIRouter()

@router.post("/v1/messages", openapi_extra=json_body(fmt.MessagesRequest))
@direct
async def create_message(request: Request) -> Response:
    svc = services(request)
    who = await caller(request, defer=True)
    req = await read_json(request, fmt.MessagesRequest)
    session = await session_for(who, request.path_params.get("session_id"), svc.store)
    conv = fmt.to_conversation(req, svc.settings.unsupported_tools == "reject")
    chat = fmt.to_chat_request(req, conv)
    link = await link_request(request, svc, who, session, req, "messages")  # sub-agents, compaction: issue 33
    service = GenerationService(svc, owner=who.owner)
    if req.stream:
        plan, runs, events = await unless_disconnected(
            request, service.stream_turn(chat, link.session, id_prefix="msg_", meta=link.meta(fmt.recorded_meta(conv))))
        stream = fmt.MessageStream(req, runs[0], len(plan.prompt), svc.model_name, svc.tokenizer)
        return StreamingResponse(stream.render(link.watch(events, runs)), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    plan, runs = await unless_disconnected(
        request, service.run_turn(chat, link.session, id_prefix="msg_", meta=link.meta(fmt.recorded_meta(conv))))
    await link.recorded(runs)
    return json_response(fmt.render_message(req, runs[0], len(plan.prompt), svc.model_name, svc.tokenizer))


@router.post("/v1/messages/count_tokens", openapi_extra=json_body(fmt.CountTokensRequest))
async def count_tokens(request: Request) -> Response:
    """The prompt's tokens as a root turn would render them (a continuation reuses its parent's tokens, so
    a long conversation may count a few tokens differently)."""
    svc = services(request)
    await caller(request)
    req = await read_json(request, fmt.CountTokensRequest)
    conv = fmt.to_conversation(req, svc.settings.unsupported_tools == "reject")
    try:
        validate_messages(conv.messages, conv.tools)
    except ChatFormatError as exc:
        raise from_chat_error(exc) from exc
    return json_response({"input_tokens": len(svc.template.render(conv.messages, conv.tools))})


@router.head("/")
async def probe() -> Response:
    return Response(status_code=200)
