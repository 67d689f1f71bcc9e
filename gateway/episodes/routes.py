"""``GET /v1/sessions/{id}/threads``: an episode's threads, segments and edges, for people and the UI; and
the answer to a Responses WebSocket.

Also the Responses API's WebSocket (``GET /v1/responses`` with ``Upgrade: websocket``, plain or bound to a
session by URL), which the gateway does not serve: the handshake is answered ``426 Upgrade Required``
with an OpenAI-shaped error. Codex 0.171.0's built-in ``openai`` provider tries the WebSocket first; on a
426 it goes over to HTTP at once, where a refused handshake (uvicorn's 403 for a WebSocket no route takes)
had it retry for some 6 s first (``tests/gateway/episodes/test_codex_websocket.py``).

``GET /v1/sessions/{id}/threads`` answers ``{"session_id", "threads": [...], "turns": {turn id: {"thread",
"segment", "role"}}, "unlinked": n}``: one entry per segment (``gateway.episodes.table.ThreadRow``:
``thread``, ``segment``, ``kind``, ``first_turn``, ``edge`` ``spawned_by`` | ``compacted_from`` | null,
``from_thread``, ``from_segment``, ``from_turn``, ``from_call``, ``status`` ``root`` | ``linked`` |
``confirmed`` | ``unlinked``, ``detail`` with the reason of an unlinked one) and the label of every turn.
Who may read the session (``GET /v1/sessions/{id}``) may read this.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import JSONResponse

from gateway.binding import load_session, may_access_session
from gateway.context import services
from gateway.episodes import table
from gateway.errors import InvalidRequest, error_body, from_store_error
from gateway.routes.common import caller
from gateway.store import errors as store_errors

router = APIRouter()


@router.get("/v1/sessions/{session_id}/threads")
async def session_threads(session_id: str, request: Request) -> JSONResponse:
    svc = services(request)
    who = await caller(request)
    may_access_session(who, await load_session(svc.store, session_id))
    try:
        rows = await table.session_threads(svc.store, session_id)
        turns = await svc.store.session_interactions(session_id=session_id)
    except store_errors.StoreError as exc:
        raise from_store_error(exc) from exc
    labels = {t.id: {k: v for k, v in (t.request.get("episode") or {}).items() if k in ("thread", "segment", "role")}
              for t in turns}
    out = [{k: v for k, v in r.as_dict().items() if k not in ("session_id", "owner", "episode_key")} for r in rows]
    return JSONResponse({"session_id": session_id, "threads": out, "turns": labels,
                         "unlinked": sum(r.status == table.UNLINKED for r in rows)})


@router.websocket("/v1/responses")
@router.websocket("/sessions/{session_id}/v1/responses")
async def responses_websocket(websocket: WebSocket) -> None:
    _, body = error_body(InvalidRequest("this gateway serves the Responses API over HTTP only: POST /v1/responses",
                                        code="websocket_not_supported"))
    await websocket.send_denial_response(JSONResponse(body, status_code=426))
