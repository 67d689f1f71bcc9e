"""The one generation route: every wire format (``gateway.formats.contract.WireFormat``) is served by
:func:`serve`, the same steps in the same order whatever the API.

1. note the format on the request (the app's error handlers answer in its shape: ``format_of``);
2. authenticate (a session key's record comes with the turn's first Redis call: ``defer``), parse the
   body into the format's request model, bind the session (key, ``/sessions/{id}`` URL, implicit);
3. the format converts the request into the core's (``to_core``; Responses reads a previous response's
   conversation there);
4. the episode linker places the turn (``gateway.episodes``: sub-agent threads, compaction segments);
5. the conversation core runs the turn, while the client is watched (a client that leaves cancels it and
   nothing is recorded), and the format renders its result as JSON or its events as SSE.

A route module only names its path and its format (``routes/openai.py``, ``responses.py``,
``messages.py``).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from gateway.binding import session_for
from gateway.context import services
from gateway.episodes import link_request
from gateway.formats.contract import WireFormat
from gateway.routes.common import SSE_HEADERS, caller, json_response, read_json, unless_disconnected
from gateway.service import GenerationService

FORMAT_SCOPE_KEY = "agentrl.wire_format"  # the ASGI scope's note of the format a request is answered in


def use_format(request: Request, fmt: WireFormat[Any]) -> None:
    """Answer ``request``'s errors in ``fmt``'s shape (also for routes that do not generate, such as
    Messages' ``count_tokens``)."""
    request.scope[FORMAT_SCOPE_KEY] = fmt


def format_of(request: Request | None) -> WireFormat[Any] | None:
    """The format noted on ``request`` by :func:`use_format`, if any (the app's error path asks)."""
    return request.scope.get(FORMAT_SCOPE_KEY) if request is not None else None


async def serve(request: Request, fmt: WireFormat[Any]) -> Response:
    """One generation request in ``fmt``: see the module docstring."""
    use_format(request, fmt)
    svc = services(request)
    who = await caller(request, defer=True)
    req = await read_json(request, fmt.request_model)
    session = await session_for(who, request.path_params.get("session_id"), svc.store)
    turn = await fmt.to_core(svc, who, req)
    link = await link_request(request, svc, who, session, req, fmt.name)
    meta = link.meta(turn.meta or {})
    service = GenerationService(svc, owner=who.owner)
    if req.stream:
        plan, runs, events = await unless_disconnected(
            request, service.stream_turn(turn.core, link.session, id_prefix=fmt.id_prefix, meta=meta,
                                          wire_names=turn.wire_names))
        return StreamingResponse(fmt.stream(turn, plan, runs, link.watch(events, runs), svc),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    plan, runs = await unless_disconnected(
        request, service.run_turn(turn.core, link.session, id_prefix=fmt.id_prefix, meta=meta,
                                  wire_names=turn.wire_names))
    await link.recorded(runs)
    return json_response(fmt.render(turn, plan, runs, svc))
