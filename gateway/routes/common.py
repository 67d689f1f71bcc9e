"""Request helpers shared by the routes: bounded JSON bodies validated into wire models, auth."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from gateway import jsonio
from gateway.binding import Caller, authenticate
from gateway.context import services
from gateway.errors import ClientDisconnected, InvalidRequest, PayloadTooLarge, RequestTimeout, from_validation_error

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def direct(endpoint: T) -> T:
    """Mark a route served straight from the app's ASGI entry (``gateway.app.GatewayApp``) when its path has
    no parameters: the generation routes, which every agent turn calls. Such an endpoint takes only the
    ``Request`` and returns a ``Response``; its errors go to the app's exception handlers as before."""
    endpoint.__agentrl_direct__ = True  # type: ignore[attr-defined]
    return endpoint


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of streams


def json_response(body: object) -> Response:
    """A compact UTF-8 JSON answer (the generation routes' bodies carry long token lists and text)."""
    return Response(jsonio.dumps(body), media_type="application/json")


BODY_SCHEMAS: dict[str, Any] = {}  # JSON Schemas that request bodies refer to (``components.schemas``)


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting a route's JSON body as ``model`` (routes parse bodies themselves with
    :func:`read_json`, so FastAPI cannot see them); served in ``GET /openapi.json``."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    BODY_SCHEMAS.update(schema.pop("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


async def read_body(request: Request) -> bytes:
    limit = services(request).settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    timeout_s = services(request).settings.body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeout(f"the request body was not received within {timeout_s:g} s") from None
    return b"".join(chunks)


# A body larger than this is parsed and validated on a worker thread: parsing holds the interpreter lock in
# C, but in steps of a few ms per MB between which the event loop runs, instead of one stretch of the whole
# body on the loop (a 7.9 MB prompt's parse was most of a ~32 ms stall before the turn was planned).
OFF_LOOP_BODY_BYTES = 1_000_000


def _parse(raw: bytes, model: type[M], allow_empty: bool) -> M:
    if not raw.strip() and allow_empty:
        data: Any = {}
    else:
        try:
            data = jsonio.loads(raw)
        except UnicodeDecodeError as exc:
            raise InvalidRequest("request body is not UTF-8 JSON", code="invalid_json") from exc
        except ValueError as exc:
            raise InvalidRequest(f"malformed JSON body: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_type")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


async def read_json(request: Request, model: type[M], *, allow_empty: bool = False) -> M:
    """The body parsed strictly (no NaN/Infinity literals) and validated into ``model``."""
    raw = await read_body(request)
    if len(raw) > OFF_LOOP_BODY_BYTES:
        parsed = await asyncio.to_thread(_parse, raw, model, allow_empty)
    else:
        parsed = _parse(raw, model, allow_empty)
    extra = parsed.model_extra or {}
    if extra:
        metrics = services(request).metrics
        for name in extra:
            metrics.count_unknown_field(name)
    return parsed


async def _disconnect(request: Request) -> None:
    """Return when the client closes its connection (the ASGI ``http.disconnect`` message). Called once
    the body has been read: the server has nothing else to deliver before the answer is sent."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` (a whole non-streamed turn, or a streamed turn up to its first event) while watching
    the client's connection: if the client goes away first, ``work`` is cancelled, which aborts its engine
    requests (or drops its generation held by a pause) and records nothing, and :class:`ClientDisconnected`
    is raised. Once a stream has begun, Starlette stops it when its client disconnects, to the same effect.
    Without this the turn would generate to ``max_tokens`` for a reader that is gone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected("the client closed the connection before the answer was ready")
    return task.result()


async def caller(request: Request, *, defer: bool = False) -> Caller:
    """The caller of ``request`` (401 for a missing or unknown key). ``defer``: the generation routes, which
    may take a session key as a ``KeyedSession`` whose record comes with the turn (``authenticate``)."""
    svc = services(request)
    return await authenticate(request, svc.settings, svc.store, defer=defer)
