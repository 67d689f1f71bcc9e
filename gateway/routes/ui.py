"""The trace viewer (``/ui``, admin only, read-only): HTML pages and the JSON APIs behind them.

Each page has a JSON twin under ``/ui/api``; both call the same function of :mod:`gateway.ui.views` and
the page only renders its result (Jinja2 templates in ``gateway/ui/templates``), so the API is the
contract and the page a thin view. Nothing here writes data: the only POSTs are the login (which checks
the key and sets the viewer's cookie) and the logout (which clears it). See ``gateway.ui.auth`` for how
the key is kept, and docs/gateway.md ("Trace viewer") for the APIs.

Errors: unknown ids 404, bad query parameters 400 (OpenAI-shaped JSON on the APIs, an error page on the
pages); no credentials 401 on the APIs and a redirect to the login form on the pages; an agent or
session key 403 on both.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from gateway.context import services
from gateway.episodes.ui import with_threads
from gateway.errors import (
    AuthenticationFailed,
    GatewayError,
    InvalidRequest,
    NotFound,
    error_body,
    from_store_error,
)
from gateway.lifecycle import ExportSettings
from gateway.routes.common import read_body
from gateway.store import errors as store_errors
from gateway.store.browse import MAX_PAGE, SessionFilter
from gateway.ui import STATIC_FILES, render
from gateway.ui import views
from gateway.ui.auth import COOKIE, TTL_S, check_login_key, mint, require_viewer

router = APIRouter(prefix="/ui")

SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                                "img-src 'self' data:; connect-src 'self'; form-action 'self'; "
                                "frame-ancestors 'none'; base-uri 'none'"),
}


# --------------------------------------------------------------------------------------------- helpers


def _export_settings(request: Request) -> ExportSettings:
    service = getattr(request.app.state, "trajectories", None)
    if service is not None:
        return service.settings  # type: ignore[no-any-return]
    return ExportSettings.from_settings(services(request).settings)


def _float(request: Request, name: str) -> float | None:
    raw = request.query_params.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise InvalidRequest(f"{name} must be a number, got {raw!r}", param=name, code="invalid_type") from None
    if not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number", param=name, code="invalid_value")
    return value


def _time(request: Request, name: str) -> float | None:
    """Unix seconds, or an ISO 8601 date/time (UTC unless it says otherwise; what a datetime-local
    input sends)."""
    raw = request.query_params.get(name, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        pass
    try:
        parsed = datetime.fromisoformat(raw)
    except ValueError:
        raise InvalidRequest(f"{name} must be unix seconds or an ISO 8601 time, got {raw!r}", param=name,
                             code="invalid_type") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()


def _filters(request: Request) -> tuple[SessionFilter, int, str | None]:
    q = request.query_params
    statuses = tuple(s for raw in q.getlist("status") for s in raw.split(",") if s.strip())
    limit_raw = q.get("limit", "50").strip() or "50"
    if not limit_raw.isdigit() or not 1 <= int(limit_raw) <= MAX_PAGE:
        raise InvalidRequest(f"limit must be an integer between 1 and {MAX_PAGE}, got {limit_raw!r}",
                             param="limit", code="invalid_value")
    try:
        filters = SessionFilter(status=tuple(s.strip() for s in statuses), group_id=q.get("group") or None,
                                created_from=_time(request, "from"), created_to=_time(request, "to"),
                                min_reward=_float(request, "min_reward"), max_reward=_float(request, "max_reward"))
    except store_errors.InvalidValue as exc:
        raise InvalidRequest(str(exc), param="status", code="invalid_value") from None
    return filters, int(limit_raw), q.get("cursor") or None


def _estimator(request: Request) -> str:
    return request.query_params.get("estimator", "grpo")


async def _sessions(request: Request) -> dict[str, Any]:
    filters, limit, cursor = _filters(request)
    try:
        return await views.sessions_list(services(request).store, filters=filters, limit=limit, cursor=cursor)
    except store_errors.InvalidValue as exc:
        raise InvalidRequest(str(exc), param="cursor", code="invalid_value") from None


async def _trainer(request: Request) -> dict[str, Any]:
    svc = services(request)
    return await views.trainer_detail(svc, await svc.trainer_log.entries())


def _json(data: Any) -> JSONResponse:
    return JSONResponse(data, headers={"Cache-Control": "no-store"})


async def _api(request: Request, build: Any) -> JSONResponse:
    await require_viewer(request)
    try:
        return _json(await build())
    except store_errors.StoreError as exc:
        raise from_store_error(exc) from exc


def _failed_page(exc: GatewayError | store_errors.StoreError) -> Response:
    """A page's answer to an error: the login form for missing credentials, else an error page."""
    if isinstance(exc, AuthenticationFailed):
        return RedirectResponse("/ui/login", status_code=303, headers=SECURITY_HEADERS)
    err = from_store_error(exc) if isinstance(exc, store_errors.StoreError) else exc
    status, body = error_body(err)
    return render("error.html", status=status, headers=SECURITY_HEADERS, error=body["error"], code=status)


async def _page(request: Request, template: str, build: Any, **extra: Any) -> Response:
    """Render ``template`` over ``await build()``; a login redirect or an error page instead on failure."""
    try:
        await require_viewer(request)
        data = await build()
    except (GatewayError, store_errors.StoreError) as exc:
        return _failed_page(exc)
    return render(template, headers=SECURITY_HEADERS, data=data, query=dict(request.query_params), **extra)


# ---------------------------------------------------------------------------------------------- login


@router.get("")
@router.get("/")
async def index(request: Request) -> Response:
    try:
        await require_viewer(request)
    except (GatewayError, store_errors.StoreError) as exc:
        return _failed_page(exc)  # the login form, or 403 for an agent or session key
    return RedirectResponse("/ui/sessions", status_code=303, headers=SECURITY_HEADERS)


@router.get("/login")
async def login_form() -> Response:
    return render("login.html", headers=SECURITY_HEADERS, error=None)


@router.post("/login")
async def login(request: Request) -> Response:
    form = parse_qs((await read_body(request)).decode("utf-8", "replace"))
    key = (form.get("key") or [""])[0].strip()
    try:
        if not key:
            raise AuthenticationFailed("enter the gateway's admin key")
        await check_login_key(request, key)
    except GatewayError as exc:
        status, body = error_body(exc)
        return render("login.html", status=status, headers=SECURITY_HEADERS, error=body["error"]["message"])
    except store_errors.StoreError as exc:
        status, body = error_body(from_store_error(exc))
        return render("login.html", status=status, headers=SECURITY_HEADERS, error=body["error"]["message"])
    response = RedirectResponse("/ui/sessions", status_code=303, headers=SECURITY_HEADERS)
    response.set_cookie(COOKIE, mint(services(request).settings.admin_key), max_age=TTL_S, path="/ui",
                        httponly=True, samesite="strict", secure=request.url.scheme == "https")
    return response


@router.post("/logout")
async def logout() -> Response:
    response = RedirectResponse("/ui/login", status_code=303, headers=SECURITY_HEADERS)
    response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")
    return response


@router.get("/static/{name}")
async def static(name: str) -> Response:
    found = STATIC_FILES.get(name)
    if found is None:
        raise NotFound(f"no static file {name!r}", code="unknown_url")
    path, media = found
    return Response(path.read_bytes(), media_type=media,
                    headers={"Cache-Control": "max-age=300", "X-Content-Type-Options": "nosniff"})


# ---------------------------------------------------------------------------------------------- pages


@router.get("/sessions")
async def sessions_page(request: Request) -> Response:
    return await _page(request, "sessions.html", lambda: _sessions(request))


@router.get("/sessions/{session_id}")
async def session_page(session_id: str, request: Request) -> Response:
    store = services(request).store
    return await _page(request, "session.html", lambda: with_threads(store, session_id, views.session_detail(
        store, session_id, _export_settings(request))))  # with the episode's threads (issue 33)


@router.get("/sessions/{session_id}/turns/{turn_id}/tokens")
async def turn_tokens_page(session_id: str, turn_id: str, request: Request) -> Response:
    svc = services(request)
    return await _page(request, "tokens.html", lambda: views.turn_tokens(svc.store, svc.tokenizer, session_id, turn_id))


@router.get("/sessions/{session_id}/rows/{leaf_id}/tokens")
async def row_tokens_page(session_id: str, leaf_id: str, request: Request) -> Response:
    svc = services(request)
    return await _page(request, "tokens.html", lambda: views.row_tokens(
        svc.store, svc.tokenizer, session_id, leaf_id, _export_settings(request)))


@router.get("/groups/{group_id}")
async def group_page(group_id: str, request: Request) -> Response:
    return await _page(request, "group.html", lambda: views.group_detail(
        services(request).store, group_id, _export_settings(request), _estimator(request)))


@router.get("/trainer")
async def trainer_page(request: Request) -> Response:
    return await _page(request, "trainer.html", lambda: _trainer(request))


@router.get("/find")
async def find_page(request: Request) -> Response:
    """The header's search box: redirect to the page of a session, a turn (response id) or a group."""
    try:
        await require_viewer(request)
        found = await views.find(services(request).store, request.query_params.get("id", ""))
    except (GatewayError, store_errors.StoreError) as exc:
        return _failed_page(exc)
    return RedirectResponse(found["url"], status_code=303, headers=SECURITY_HEADERS)


# ------------------------------------------------------------------------------------------------ APIs


@router.get("/api/find")
async def find_api(request: Request) -> JSONResponse:
    return await _api(request, lambda: views.find(services(request).store, request.query_params.get("id", "")))



@router.get("/api/sessions")
async def sessions_api(request: Request) -> JSONResponse:
    return await _api(request, lambda: _sessions(request))


@router.get("/api/sessions/{session_id}")
async def session_api(session_id: str, request: Request) -> JSONResponse:
    return await _api(request, lambda: views.session_detail(services(request).store, session_id,
                                                            _export_settings(request)))


@router.get("/api/sessions/{session_id}/turns/{turn_id}/tokens")
async def turn_tokens_api(session_id: str, turn_id: str, request: Request) -> JSONResponse:
    svc = services(request)
    return await _api(request, lambda: views.turn_tokens(svc.store, svc.tokenizer, session_id, turn_id))


@router.get("/api/sessions/{session_id}/rows/{leaf_id}/tokens")
async def row_tokens_api(session_id: str, leaf_id: str, request: Request) -> JSONResponse:
    svc = services(request)
    return await _api(request, lambda: views.row_tokens(svc.store, svc.tokenizer, session_id, leaf_id,
                                                        _export_settings(request)))


@router.get("/api/groups/{group_id}")
async def group_api(group_id: str, request: Request) -> JSONResponse:
    return await _api(request, lambda: views.group_detail(services(request).store, group_id,
                                                          _export_settings(request), _estimator(request)))


@router.get("/api/trainer")
async def trainer_api(request: Request) -> JSONResponse:
    return await _api(request, lambda: _trainer(request))
