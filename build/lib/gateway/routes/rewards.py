"""``POST /reward``: a reward for one turn (``response_id``) or a whole session (``session_id``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.binding import load_session, may_access_session
from gateway.context import services
from gateway.errors import NotFound, from_store_error
from gateway.routes.common import caller, json_body, read_json
from gateway.store import errors as store_errors
from gateway.wire import RewardRequest

router = APIRouter()


@router.post("/reward", openapi_extra=json_body(RewardRequest))
@router.post("/v1/reward", openapi_extra=json_body(RewardRequest))
async def post_reward(request: Request) -> JSONResponse:
    svc = services(request)
    who = await caller(request)
    body = await read_json(request, RewardRequest)
    try:
        if body.response_id is not None:
            try:
                turn = await svc.store.get_interaction(interaction_id=body.response_id)
            except store_errors.NotFound:
                raise NotFound(f"no response {body.response_id!r}", param="response_id") from None
            may_access_session(who, await load_session(svc.store, turn.session_id))
        else:
            assert body.session_id is not None
            may_access_session(who, await load_session(svc.store, body.session_id))
        record = await svc.store.set_reward(
            reward=body.reward, source=body.source or who.role,
            interaction_id=body.response_id, session_id=None if body.response_id else body.session_id)
    except store_errors.NotFound as exc:
        raise NotFound(str(exc), param="session_id" if body.session_id else "response_id") from exc
    except store_errors.StoreError as exc:
        raise from_store_error(exc) from exc
    return JSONResponse({"ok": True, "session_id": record.session_id, "response_id": record.interaction_id,
                         "reward": record.reward, "created_at": record.created_at})
