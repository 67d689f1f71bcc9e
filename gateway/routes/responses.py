"""The OpenAI Responses API: ``POST /v1/responses`` (stream and not) and ``GET /v1/responses/{id}``.

``POST`` is the Responses wire format (``gateway.formats.responses.ResponsesFormat``) served by the one
generation route (``gateway.routes.generation.serve``); ``GET`` renders a recorded turn, whatever format it
came in, as a ``Response``.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.context import services
from gateway.errors import from_store_error
from gateway.formats import responses as fmt
from gateway.formats.common import load_turn
from gateway.routes.common import caller, direct, json_body, json_response
from gateway.routes.generation import serve
from gateway.store import errors as store_errors

router = APIRouter()


@router.post("/v1/responses", openapi_extra=json_body(fmt.ResponsesRequest))
@direct
async def create_response(request: Request) -> Response:
    return await serve(request, fmt.RESPONSES)


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
