"""Sessions: create and list (runner or admin key), finish, abandon, and the turn tree as JSON."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway import groups
from gateway.binding import load_session, may_access_session, require_runner
from gateway.context import services
from gateway.errors import InvalidRequest, from_store_error
from gateway.routes.common import caller, json_body, read_json
from gateway.store import SESSION_STATUSES
from gateway.store import errors as store_errors
from gateway.wire import SessionCreate

router = APIRouter()
MAX_LIST = 1000


def session_json(record: object) -> dict[str, object]:
    keys = ("id", "group_id", "task_id", "metadata", "status", "is_eval", "created_at", "finished_at",
            "last_activity_at", "reward")
    return {k: getattr(record, k) for k in keys}


@router.post("/v1/sessions", openapi_extra=json_body(SessionCreate))
async def create_session(request: Request) -> JSONResponse:
    svc = services(request)
    require_runner(await caller(request))
    body = await read_json(request, SessionCreate, allow_empty=True)
    record = await groups.create_session(svc, group_id=body.group_id, task_id=body.task_id,
                                         metadata=body.metadata or {})
    return JSONResponse({
        "session_id": record.id, "api_key": record.api_key, "group_id": record.group_id,
        "base_url": f"{svc.settings.public_url}/sessions/{record.id}/v1",
    })


@router.get("/v1/sessions")
async def list_sessions(request: Request) -> JSONResponse:
    """``?status=a,b&group_id=&limit=&cursor=``: oldest first, keyset-paginated by ``next_cursor``."""
    svc = services(request)
    require_runner(await caller(request))
    q = request.query_params
    statuses = [x for x in q.get("status", "").split(",") if x] or None
    bad = [x for x in statuses or [] if x not in SESSION_STATUSES]
    if bad:
        raise InvalidRequest(f"unknown status {bad[0]!r}; valid: {', '.join(SESSION_STATUSES)}", param="status")
    raw_limit = q.get("limit", "100")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_LIST:
        raise InvalidRequest(f"limit must be an integer between 1 and {MAX_LIST}, got {raw_limit!r}", param="limit")
    limit = int(raw_limit)
    after = groups.decode_cursor(q["cursor"]) if q.get("cursor") else None
    try:
        found = await svc.store.list_sessions(status=statuses, group_id=q.get("group_id") or None,
                                              limit=limit + 1, after=after)
    except store_errors.StoreError as exc:
        raise from_store_error(exc) from exc
    page = found[:limit]
    more = len(found) > limit
    return JSONResponse({"object": "list", "data": [session_json(s) for s in page],
                         "next_cursor": groups.encode_cursor(page[-1]) if more else None})


@router.post("/v1/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request) -> JSONResponse:
    svc = services(request)
    who = await caller(request)
    may_access_session(who, await load_session(svc.store, session_id))
    try:
        record = await svc.store.finish_session(session_id=session_id)
    except store_errors.StoreError as exc:
        raise from_store_error(exc) from exc
    return JSONResponse(session_json(record))


@router.post("/v1/sessions/{session_id}/abandon")
async def abandon_session(session_id: str, request: Request) -> JSONResponse:
    """Never train on this session and give its place in the staleness budget back (409 if consumed)."""
    svc = services(request)
    who = await caller(request)
    found = await load_session(svc.store, session_id)
    may_access_session(who, found)
    record = await groups.abandon_session(svc, found)
    return JSONResponse(session_json(record))


@router.get("/v1/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> JSONResponse:
    svc = services(request)
    who = await caller(request)
    may_access_session(who, await load_session(svc.store, session_id))
    decode = None
    if request.query_params.get("decode", "").lower() in ("1", "true", "yes"):
        def decode(ids: list[int]) -> str:
            return svc.tokenizer.decode(ids, skip_special_tokens=False)
    try:
        tree = await svc.store.session_tree_json(session_id=session_id, decode=decode)
    except store_errors.StoreError as exc:
        raise from_store_error(exc) from exc
    return JSONResponse(tree)
