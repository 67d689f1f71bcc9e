"""OpenAI-compatible routes: chat completions, completions, models."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from gateway.binding import session_for
from gateway.context import services
from gateway.routes.common import caller, read_json
from gateway.service import GenerationService
from gateway.wire import ChatCompletionRequest, CompletionRequest

router = APIRouter()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _json(body: object) -> Response:
    return Response(json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode(),
                    media_type="application/json")


async def _generate(request: Request, model: type[Any], plain: Callable[..., Awaitable[Any]],
                    stream: Callable[..., Awaitable[Any]]) -> Response:
    """Parse, bind the caller's session, and run the service's plain or streaming method."""
    svc = services(request)
    who = await caller(request)
    req = await read_json(request, model)
    session = await session_for(who, request.path_params.get("session_id"), svc.store)
    service = GenerationService(svc)
    if req.stream:
        return StreamingResponse(await stream(service, req, session), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    return _json(await plain(service, req, session))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _generate(request, ChatCompletionRequest, GenerationService.chat, GenerationService.chat_stream)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _generate(request, CompletionRequest, GenerationService.completion,
                           GenerationService.completion_stream)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    svc = services(request)
    await caller(request)
    return _json({"object": "list", "data": [{
        "id": svc.model_name, "object": "model", "created": int(svc.app_state.started_at or time.time()),
        "owned_by": "agentrl", "max_model_len": svc.context_length}]})
