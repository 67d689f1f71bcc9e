"""Sessions: create (admin), finish, and the turn tree as JSON."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.binding import load_session, may_access_session, require_admin
from gateway.context import services
from gateway.errors import from_store_error
from gateway.routes.common import caller, read_json
from gateway.store import errors as store_errors
from gateway.wire import SessionCreate

router = APIRouter()


def session_json(record: object) -> dict[str, object]:
    keys = ("id", "group_id", "task_id", "metadata", "status", "is_eval", "created_at", "finished_at",
            "last_activity_at", "reward")
    return {k: getattr(record, k) for k in keys}


@router.post("/v1/sessions")
async def create_session(request: Request) -> JSONResponse:
    svc = services(request)
    require_admin(await caller(request))
    body = await read_json(request, SessionCreate, allow_empty=True)
    await svc.admission.check(kind="session", metadata=body.metadata or {})
    try:
        record = await svc.store.create_session(group_id=body.group_id, task_id=body.task_id,
                                                metadata=body.metadata or {})
    except store_errors.StoreError as exc:
        raise from_store_error(exc) from exc
    return JSONResponse({
        "session_id": record.id, "api_key": record.api_key, "group_id": record.group_id,
        "base_url": f"{svc.settings.public_url}/sessions/{record.id}/v1",
    })


@router.post("/v1/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request) -> JSONResponse:
    svc = services(request)
    who = await caller(request)
    may_access_session(who, session_id)
    await load_session(svc.store, session_id)
    try:
        record = await svc.store.finish_session(session_id=session_id)
    except store_errors.StoreError as exc:
        raise from_store_error(exc) from exc
    return JSONResponse(session_json(record))


@router.get("/v1/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> JSONResponse:
    svc = services(request)
    who = await caller(request)
    may_access_session(who, session_id)
    await load_session(svc.store, session_id)
    decode = None
    if request.query_params.get("decode", "").lower() in ("1", "true", "yes"):
        def decode(ids: list[int]) -> str:
            return svc.tokenizer.decode(ids, skip_special_tokens=False)
    try:
        tree = await svc.store.session_tree_json(session_id=session_id, decode=decode)
    except store_errors.StoreError as exc:
        raise from_store_error(exc) from exc
    return JSONResponse(tree)
