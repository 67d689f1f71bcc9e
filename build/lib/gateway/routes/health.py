"""``GET /health`` (200 while at least one engine is healthy, else 503), ``GET /metrics`` (Prometheus) and
``GET /openapi.json`` (admin key: the OpenAPI document, for clients and fuzzers)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.binding import require_admin
from gateway.context import services
from gateway.routes.common import BODY_SCHEMAS, caller

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    svc = services(request)
    healthy = [e.client.base_url for e in svc.router.engines if e.healthy]
    body = {"status": "ok" if healthy else "no_healthy_engine", "engines_healthy": len(healthy),
            "engines": len(svc.router.engines), "weight_version": svc.router.weight_version,
            "paused": svc.router.paused}
    return JSONResponse(body, status_code=200 if healthy else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    svc = services(request)
    svc.metrics.held.set(svc.router.held)
    svc.metrics.weight_version.set(svc.router.weight_version)
    return Response(svc.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request) -> JSONResponse:
    require_admin(await caller(request))
    doc = request.app.openapi()
    doc.setdefault("components", {}).setdefault("schemas", {}).update(BODY_SCHEMAS)
    return JSONResponse(doc)
