"""Trajectory leasing for the trainer (admin key).

``GET /v1/trajectories?max_groups=N&wait_s=S`` waits up to S seconds for N ready groups and answers 200 with
one batch in the binary format of :mod:`agentrl.trajectory` (content type ``MEDIA_TYPE``; the lease id in
the ``X-Agentrl-Lease-Id`` header and in the batch's ``meta["lease_id"]``), or 204 if no group became
ready. ``POST /v1/trajectories/ack`` ``{"lease_id"}`` acknowledges a lease (404 unknown, 409 expired or
already acknowledged). ``GET /v1/trajectories/stats``: counters, queue depth, trainer state.

The :class:`gateway.lifecycle.TrajectoryService` these routes call is built, started and stopped by the
app's lifespan with the rest of the lifecycle (``Services.trajectories``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from agentrl.trajectory import LEASE_HEADER, MEDIA_TYPE
from gateway.binding import require_admin
from gateway.context import services
from gateway.errors import InvalidRequest
from gateway.lifecycle import TrajectoryService
from gateway.routes.common import caller, read_json
from gateway.wire import WireModel


router = APIRouter()


class AckRequest(WireModel):
    lease_id: str = Field(min_length=1, max_length=128)


def _service(request: Request) -> TrajectoryService:
    return services(request).trajectories


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
