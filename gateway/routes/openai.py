"""OpenAI-compatible routes: chat completions (the chat wire format, served by ``routes.generation.serve``),
text completions, models."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from gateway.binding import session_for
from gateway.context import services
from gateway.errors import InvalidRequest, NotFound
from gateway.formats import chat
from gateway.routes.common import SSE_HEADERS, caller, direct, json_body, json_response, read_json, unless_disconnected
from gateway.routes.generation import serve
from gateway.service import GenerationService
from gateway.wire import ChatCompletionRequest, CompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
@direct
async def chat_completions(request: Request) -> Response:
    return await serve(request, chat.CHAT)


@router.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
@direct
async def completions(request: Request) -> Response:
    """Text completions: not a conversation, so not a wire format of the generic route (``serve``): a
    ``prompt`` list runs one turn per prompt, and no episode links a completion."""
    svc = services(request)
    who = await caller(request)
    req = await read_json(request, CompletionRequest)
    session = await session_for(who, request.path_params.get("session_id"), svc.store)
    if len(req.prompts) > 1:
        return await _completion_batch(request, req, session, who.owner)
    service = GenerationService(svc, owner=who.owner)
    if req.stream:
        plan, runs, events = await unless_disconnected(request, service.stream_turn(req, session))
        return StreamingResponse(chat.completion_chunks(req, plan, runs, events, svc.model_name, svc.tokenizer),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    plan, runs = await unless_disconnected(request, service.run_turn(req, session))
    return json_response(chat.completion_response(req, plan, runs, svc.model_name, svc.tokenizer))


async def _completion_batch(request: Request, req: CompletionRequest, session: Any, owner: str | None
                            ) -> Response:
    """A ``prompt`` list of several prompts: one turn per prompt, run concurrently, answered as one
    ``text_completion`` whose choice ``i * n + j`` is choice ``j`` of prompt ``i`` (as OpenAI numbers them).
    Each turn is recorded on its own; streaming a batch is refused (400)."""
    svc = services(request)
    if req.stream:
        raise InvalidRequest("streaming a batch of prompts is not supported; send one prompt per request, "
                             "or stream: false", param="prompt")
    if len(req.prompts) * req.n > svc.settings.max_n:
        raise InvalidRequest(f"a batch of {len(req.prompts)} prompts x n={req.n} exceeds --max-n "
                             f"({svc.settings.max_n}) choices per request", param="prompt")
    service = GenerationService(svc, owner=owner)
    for i, prompt in enumerate(req.prompts):  # every prompt checked before any turn runs: all or nothing
        service.prompt_ids(prompt, param=f"prompt[{i}]")
    turns = await unless_disconnected(request, asyncio.gather(
        *(service.run_turn(req.model_copy(update={"prompt": p}), session) for p in req.prompts)))
    bodies = [chat.completion_response(req, plan, runs, svc.model_name, svc.tokenizer) for plan, runs in turns]
    choices = []
    for i, body in enumerate(bodies):
        for choice in body["choices"]:
            choices.append({**choice, "index": i * req.n + choice["index"]})
    usage = {k: sum(b["usage"][k] for b in bodies) for k in bodies[0]["usage"]}
    return json_response({**bodies[0], "choices": choices, "usage": usage})


def _model(request: Request) -> dict[str, Any]:
    svc = services(request)
    return {"id": svc.model_name, "object": "model", "created": int(svc.started_at),
            "owned_by": "agentrl", "max_model_len": svc.context_length}


@router.get("/v1/models")
async def models(request: Request) -> Response:
    await caller(request)
    return json_response({"object": "list", "data": [_model(request)]})


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> Response:
    """``client.models.retrieve``: the served model, or 404 (``model_not_found``) for any other id."""
    await caller(request)
    served = _model(request)
    if model_id != served["id"]:
        raise NotFound(f"the model {model_id!r} does not exist; this gateway serves {served['id']!r}",
                       param="model", code="model_not_found")
    return json_response(served)
