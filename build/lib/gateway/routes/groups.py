"""GRPO groups admitted as a whole (runner or admin key): create, inspect, close, abandon. See ``gateway.groups``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway import groups
from gateway.binding import require_runner
from gateway.context import services
from gateway.routes.common import caller, read_json
from gateway.wire import GroupCreate

router = APIRouter()


@router.post("/v1/groups")
async def create_group(request: Request) -> JSONResponse:
    """``{"size", "group_id"?, "task_id"?, "metadata"?}`` -> the group and all its sessions, or 429."""
    svc = services(request)
    require_runner(await caller(request))
    body = await read_json(request, GroupCreate)
    group, sessions = await groups.create_group(svc, size=body.size, group_id=body.group_id,
                                                task_id=body.task_id, metadata=body.metadata or {})
    base = svc.settings.public_url
    return JSONResponse({
        "group_id": group.id, "size": group.size, "task_id": group.task_id,
        "sessions": [{"session_id": s.id, "api_key": s.api_key, "base_url": f"{base}/sessions/{s.id}/v1"}
                     for s in sessions],
    })


@router.get("/v1/groups/{group_id}")
async def get_group(group_id: str, request: Request) -> JSONResponse:
    svc = services(request)
    require_runner(await caller(request))
    return JSONResponse(await groups.describe_group(svc, group_id))


@router.post("/v1/groups/{group_id}/abandon")
async def abandon_group(group_id: str, request: Request) -> JSONResponse:
    """Abandon every session of the group not yet consumed and give its places back."""
    svc = services(request)
    require_runner(await caller(request))
    return JSONResponse(await groups.abandon_group(svc, group_id))


@router.post("/v1/groups/{group_id}/close")
async def close_group(group_id: str, request: Request) -> JSONResponse:
    """No more sessions will join: unused places come back; the group trains once its sessions finish."""
    svc = services(request)
    require_runner(await caller(request))
    return JSONResponse(await groups.close_group(svc, group_id))
