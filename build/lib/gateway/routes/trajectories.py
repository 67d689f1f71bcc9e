"""Trajectory leasing for the trainer (admin key).

``GET /v1/trajectories?max_groups=N&wait_s=S`` waits up to S seconds for N ready groups and answers 200 with
one batch in the binary format of :mod:`agentrl.trajectory` (content type ``MEDIA_TYPE``; the lease id in
the ``X-Agentrl-Lease-Id`` header and in the batch's ``meta["lease_id"]``), or 204 if no group became
ready. ``POST /v1/trajectories/ack`` ``{"lease_id"}`` acknowledges a lease (404 unknown, 409 expired or
already acknowledged). ``GET /v1/trajectories/stats``: counters, queue depth, trainer state.

This module's router carries a lifespan that FastAPI runs inside the app's own: it builds the
:class:`gateway.lifecycle.TrajectoryService` over the app's store, installs the staleness admission hook
(unless the app was given another one) and runs the lifecycle loop until shutdown.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from agentrl.trajectory import LEASE_HEADER, MEDIA_TYPE
from gateway.admission import AlwaysAdmit
from gateway.binding import require_admin
from gateway.errors import InvalidRequest
from gateway.lifecycle import ExportSettings, StalenessAdmission, TrajectoryService
from gateway.routes.common import caller, read_json
from gateway.wire import WireModel


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    svc = app.state.services
    settings = getattr(app.state, "export_settings", None) or ExportSettings.from_settings(svc.settings)
    service = TrajectoryService(svc.store, settings)
    app.state.trajectories = service
    app.state.inflight = service.inflight
    if isinstance(getattr(app.state, "admission", None), AlwaysAdmit):
        app.state.admission = StalenessAdmission(service)
    service.start()
    try:
        yield
    finally:
        await service.stop()


router = APIRouter(lifespan=lifespan)


class AckRequest(WireModel):
    lease_id: str = Field(min_length=1, max_length=128)


def _service(request: Request) -> TrajectoryService:
    return request.app.state.trajectories  # type: ignore[no-any-return]


def _number(request: Request, name: str, kind: type, default: Any) -> Any:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise InvalidRequest(f"{name} must be a{'n integer' if kind is int else ' number'}, got {raw!r}",
                             param=name, code="invalid_type") from None


@router.get("/v1/trajectories")
async def lease(request: Request) -> Response:
    require_admin(await caller(request))
    service = _service(request)
    max_groups = _number(request, "max_groups", int, 1)
    wait_s = _number(request, "wait_s", float, 0.0)
    got = await service.lease_batch(max_groups, wait_s)
    if got is None:
        return Response(status_code=204)
    lease_id, body = got
    return Response(content=body, media_type=MEDIA_TYPE, headers={LEASE_HEADER: lease_id})


@router.post("/v1/trajectories/ack")
async def ack(request: Request) -> JSONResponse:
    require_admin(await caller(request))
    body = await read_json(request, AckRequest)
    n = await _service(request).ack(body.lease_id)
    return JSONResponse({"lease_id": body.lease_id, "acked_groups": n})


@router.get("/v1/trajectories/stats")
async def stats(request: Request) -> JSONResponse:
    require_admin(await caller(request))
    return JSONResponse(await _service(request).describe())
