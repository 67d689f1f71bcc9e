"""OpenAI-compatible routes: chat completions, completions, models."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from gateway.binding import session_for
from gateway.context import services
from gateway.formats import chat
from gateway.routes.common import caller, read_json
from gateway.service import GenerationService
from gateway.wire import ChatCompletionRequest, CompletionRequest

router = APIRouter()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _json(body: object) -> Response:
    return Response(json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode(),
                    media_type="application/json")


async def _generate(request: Request, model: type[ChatCompletionRequest] | type[CompletionRequest],
                    plain: Callable[..., dict[str, Any]], stream: Callable[..., AsyncIterator[bytes]]) -> Response:
    """Parse, bind the caller's session, run the conversation core and render its result (``plain``) or
    its events (``stream``) in the chat / text completion format."""
    svc = services(request)
    who = await caller(request)
    req = await read_json(request, model)
    session = await session_for(who, request.path_params.get("session_id"), svc.store)
    service = GenerationService(svc)
    if req.stream:
        plan, runs, events = await service.stream_turn(req, session)
        return StreamingResponse(stream(req, plan, runs, events, svc.model_name, svc.tokenizer),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    plan, runs = await service.run_turn(req, session)
    return _json(plain(req, plan, runs, svc.model_name, svc.tokenizer))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _generate(request, ChatCompletionRequest, chat.chat_response, chat.chat_chunks)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _generate(request, CompletionRequest, chat.completion_response, chat.completion_chunks)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    svc = services(request)
    await caller(request)
    return _json({"object": "list", "data": [{
        "id": svc.model_name, "object": "model", "created": int(svc.app_state.started_at or time.time()),
        "owned_by": "agentrl", "max_model_len": svc.context_length}]})
