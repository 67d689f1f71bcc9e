"""The OpenAI Responses API: ``POST /v1/responses`` (stream and not) and ``GET /v1/responses/{id}``.

Thin: parse (``gateway.formats.responses``), bind the session as chat completions do, run the conversation
core (``GenerationService.run_turn`` / ``stream_turn``) and render a ``Response`` or its event stream.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from gateway.binding import session_for
from gateway.context import services
from gateway.episodes import compaction, link_request
from gateway.errors import from_store_error
from gateway.formats import responses as fmt
from gateway.formats.common import conversation_of, load_turn
from gateway.routes.common import SSE_HEADERS, caller, direct, json_body, json_response, read_json, unless_disconnected
from gateway.service import GenerationService
from gateway.store import errors as store_errors

router = APIRouter()

@router.post("/v1/responses", openapi_extra=json_body(fmt.ResponsesRequest))
@direct
async def create_response(request: Request) -> Response:
    svc = services(request)
    who = await caller(request, defer=True)
    req = await read_json(request, fmt.ResponsesRequest)
    session = await session_for(who, request.path_params.get("session_id"), svc.store)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = await load_turn(svc.store, who, req.previous_response_id, "previous_response_id")
        history = await conversation_of(svc.store, previous, "previous_response_id")
    link = await link_request(request, svc, who, session, req, "responses")  # sub-agents, compaction: issue 33
    req, compacting = compaction.prepare(req)  # remote compaction v2 items (gateway.episodes.compaction)
    conv = fmt.to_conversation(req, history, svc.settings.unsupported_tools == "reject")
    if compacting:
        conv.tool_choice = "none"
    chat = fmt.to_chat_request(req, conv)
    service = GenerationService(svc, owner=who.owner)
    meta = link.meta(fmt.recorded_meta(conv))
    if req.stream:
        plan, runs, events = await unless_disconnected(
            request, service.stream_turn(chat, link.session, id_prefix="resp_", meta=meta))
        events = link.watch(events, runs)
        if compacting:
            body = compaction.stream(fmt, req, runs[0], len(plan.prompt), svc.model_name, events)
            return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
        stream = fmt.ResponseStream(req, conv, runs[0], len(plan.prompt), svc.model_name, svc.tokenizer)
        return StreamingResponse(stream.render(events), media_type="text/event-stream", headers=SSE_HEADERS)
    created = time.time()
    plan, runs = await unless_disconnected(
        request, service.run_turn(chat, link.session, id_prefix="resp_", meta=meta))
    await link.recorded(runs)
    if compacting:
        return json_response(compaction.render(fmt, req, runs[0], len(plan.prompt), svc.model_name, created))
    return json_response(fmt.render_response(req, conv, runs[0], len(plan.prompt), svc.model_name, svc.tokenizer,
                                     created))


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> Response:
    svc = services(request)
    who = await caller(request)
    turn = await load_turn(svc.store, who, response_id, "response_id")
    try:
        full = await svc.store.full_sequence(interaction_id=turn.id)
    except store_errors.StoreError as exc:
        raise from_store_error(exc) from exc
    namespaces = turn.request.get("namespaces") or {}
    items = fmt.output_items(turn.id, turn.response_message, turn.finish_reason, None, namespaces)
    out = len(turn.output_ids)
    return json_response(fmt.response_object(None, turn.id, svc.model_name, turn.created_at,
                                     fmt.finished_status(turn.finish_reason), items,
                                     fmt.usage(len(full) - out, out), turn.finish_reason))
