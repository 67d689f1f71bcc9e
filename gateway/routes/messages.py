"""Anthropic's Messages API: ``POST /v1/messages`` (stream and not; ``?beta=true`` too),
``POST /v1/messages/count_tokens``, and ``HEAD /`` (clients probe it before their first request).

``POST /v1/messages`` is the Messages wire format (``gateway.formats.messages.MessagesFormat``: the key may
come as ``x-api-key``) served by the one generation route (``gateway.routes.generation.serve``). Errors on
these routes are answered in Anthropic's shape: the routes note their format on the request
(``gateway.routes.generation.use_format``) and the app's error path asks it for the body.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.chat.errors import ChatFormatError
from gateway.chat.normalize import validate_messages
from gateway.context import services
from gateway.errors import from_chat_error
from gateway.formats import messages as fmt
from gateway.routes.common import caller, direct, json_body, json_response, read_json
from gateway.routes.generation import serve, use_format

router = APIRouter()


@router.post("/v1/messages", openapi_extra=json_body(fmt.MessagesRequest))
@direct
async def create_message(request: Request) -> Response:
    return await serve(request, fmt.MESSAGES)


@router.post("/v1/messages/count_tokens", openapi_extra=json_body(fmt.CountTokensRequest))
async def count_tokens(request: Request) -> Response:
    """The prompt's tokens as a root turn would render them (a continuation reuses its parent's tokens, so
    a long conversation may count a few tokens differently)."""
    use_format(request, fmt.MESSAGES)  # errors in Anthropic's shape
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
