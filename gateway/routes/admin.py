"""Admin API (admin key): engines, pause/resume generation around weight pushes, version, trainer status."""

from __future__ import annotations

import asyncio
import inspect

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.admission import admission_status
from gateway.binding import require_admin
from gateway.context import services
from gateway.control import ControlPlane
from gateway.routes.common import caller, json_body, read_json
from gateway.wire import PauseRequest, ResumeRequest, TrainerStatus

router = APIRouter(prefix="/admin")


async def _admin(request: Request) -> None:
    require_admin(await caller(request))


def _control(request: Request) -> ControlPlane:
    control = services(request).control
    assert control is not None  # built in the app's lifespan
    return control


@router.get("/engines")
async def engines(request: Request) -> JSONResponse:
    await _admin(request)
    r = services(request).router
    return JSONResponse({"engines": [e.as_json() for e in r.engines], "paused": r.paused,
                         "held": r.held, "weight_version": r.weight_version})


@router.post("/pause", openapi_extra=json_body(PauseRequest))
async def pause(request: Request) -> JSONResponse:
    await _admin(request)
    body = await read_json(request, PauseRequest, allow_empty=True)
    svc = services(request)
    await _control(request).pause(body.mode)
    await asyncio.sleep(0)  # let aborted generations reach their hold point
    return JSONResponse({"paused": True, "held": svc.router.held, "weight_version": svc.router.weight_version})


@router.post("/resume", openapi_extra=json_body(ResumeRequest))
async def resume(request: Request) -> JSONResponse:
    await _admin(request)
    body = await read_json(request, ResumeRequest)
    svc = services(request)
    held = svc.router.held
    await _control(request).resume(body.weight_version)
    return JSONResponse({"paused": False, "resumed": held, "weight_version": body.weight_version})


@router.get("/weight_version")
async def weight_version(request: Request) -> JSONResponse:
    await _admin(request)
    return JSONResponse({"weight_version": services(request).router.weight_version})


@router.post("/trainer", openapi_extra=json_body(TrainerStatus))
async def trainer(request: Request) -> JSONResponse:
    await _admin(request)
    body = await read_json(request, TrainerStatus)
    admission = services(request).admission
    applied = admission.update_trainer(body.model_dump(include={"version", "batch_size", "staleness_bound", "group_size"}))
    if inspect.isawaitable(applied):  # the staleness hook writes the state to the shared store
        await applied
    if body.metrics:
        await services(request).trainer_log.add(version=body.version, metrics=body.metrics)
    return JSONResponse(await admission_status(admission))


@router.get("/trainer")
async def trainer_status(request: Request) -> JSONResponse:
    await _admin(request)
    return JSONResponse(await admission_status(services(request).admission))
