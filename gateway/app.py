"""The gateway's FastAPI app: ``create_app(settings)`` builds it; its lifespan builds the clients.

At start-up the lifespan connects to the engines (detects their kind, SGLang-native or vLLM, unless
``--engine-kind`` names it; waits for one to be healthy), asks one for its model directory, weight version
and context length (:meth:`gateway.engines.Engine.describe`), loads the tokenizer and chat template
(``--tokenizer`` or the engine's model directory), opens the store (which runs the Alembic migrations)
and starts the engine health checks. Everything is injectable for tests: an ``httpx.AsyncClient`` whose
transport reaches the engines, an open ``Store``, a tokenizer, an admission policy.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.routing import APIRoute, APIRouter
from redis.exceptions import RedisError
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.admission import Admission
from gateway.binding import ImplicitIndex
from gateway.chat.normalize import link_cache_sizes
from gateway.chat.template import ChatTemplate
from gateway.context import Services
from gateway.control import ControlPlane
from gateway.engine_client import EngineRouter
from gateway.engines import EngineInfo, connect_engines
from gateway.episodes.linker import EpisodeLinker
from gateway.fasthttp import FastHTTP
from gateway.lifecycle import ExportSettings, StalenessAdmission, TrajectoryService
from gateway.memory import trim_loop
from gateway.errors import (
    Conflict,
    GatewayError,
    InvalidRequest,
    NotFound,
    StoreUnavailable,
    error_body,
    from_chat_error,
    from_store_error,
)
from gateway.chat.errors import ChatFormatError
from gateway.metrics import Metrics, MetricsMiddleware
from gateway.routes import routers
from gateway.routes.generation import format_of
from gateway.settings import GatewaySettings
from gateway.store import Store
from gateway.store import errors as store_errors
from gateway.store.dberrors import translate
from gateway.trainer_log import TrainerLog

log = logging.getLogger("agentrl.gateway")

KEEPALIVE_EXPIRY_S = 2.0  # kept engine connections (httpx): well below uvicorn's 5 s keep-alive timeout
def _render(exc: GatewayError, request: Request | None = None) -> JSONResponse:
    """The error response, in the shape of the wire format the route answers in (Anthropic's on the Messages
    routes: ``gateway.routes.generation.use_format``) and OpenAI's everywhere else."""
    fmt = format_of(request)
    status, body = fmt.error_body(exc) if fmt is not None else error_body(exc)
    if status >= 500:  # an outage or an overload (a 4xx is the caller's to read): the operator's to see
        where = f"{request.method} {request.url.path}" if request is not None else "request"
        log.warning("%s: %d %s", where, status, exc.message)
    retry = exc.retry_after_s
    headers = {"Retry-After": str(max(1, round(retry)))} if retry is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


def dependency_outage(exc: BaseException) -> StoreUnavailable | None:
    """The 503 for an outage of Redis or the database that escaped translation where it entered, or None
    for anything else (a bug: 500). Nothing was recorded for a request that fails this way: every write
    that completes a response commits before the response is built, and post-commit steps never raise."""
    if isinstance(exc, RedisError):
        return StoreUnavailable(f"Redis is unavailable: {exc}")
    translated = translate(exc)
    if isinstance(translated, store_errors.StoreUnavailable):
        return StoreUnavailable(f"the conversation store is unavailable: {translated}")
    return None


def _install_error_handlers(app: FastAPI) -> None:
    async def gateway_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, GatewayError)
        return _render(exc, request)

    async def store_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, store_errors.StoreError)
        return _render(from_store_error(exc), request)

    async def chat_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ChatFormatError)
        return _render(from_chat_error(exc), request)

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            return _render(NotFound("no such route", code="unknown_url"))
        if exc.status_code == 405:
            err = InvalidRequest("method not allowed on this route", code="method_not_allowed")
            status, body = error_body(err)
            return JSONResponse(body, status_code=405)
        err = Conflict(str(exc.detail)) if exc.status_code == 409 else InvalidRequest(str(exc.detail))
        status, body = error_body(err)
        return JSONResponse(body, status_code=exc.status_code)

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        return _render(InvalidRequest(f"invalid request: {exc}"), request)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        outage = dependency_outage(exc)
        if outage is not None:
            log.warning("%s %s: %s", request.method, request.url.path, outage.message)
            return _render(outage, request)
        log.exception("unhandled error", exc_info=exc)
        exc.agentrl_answered = True  # type: ignore[attr-defined]  # logged and answered: see GatewayApp
        return _render(GatewayError("internal error; see the gateway's log"), request)

    app.add_exception_handler(GatewayError, gateway_error)
    app.add_exception_handler(store_errors.StoreError, store_error)
    app.add_exception_handler(ChatFormatError, chat_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)


class GatewayApp(FastAPI):
    """The FastAPI app, with the generation routes (marked ``gateway.routes.common.direct``) served straight
    from the ASGI entry: an agent turn skips Starlette's own middleware (its error and exception layers),
    the router's path matching and FastAPI's dependency solving. What they did for these routes is done
    here: ``scope["app"]``, the exception handlers (the same ones, by exception class), the request metrics.
    Everything else goes through FastAPI as usual.

    Middleware added with :meth:`add_middleware` wraps both paths, so it sees every request, generation
    included (it used to skip them silently). The one exception is the app's own ``MetricsMiddleware``:
    the direct path counts the same series inline (:meth:`_direct`), which spares each turn a wrapper of
    ``send`` per message. With no middleware added the direct path is one call deeper than before."""

    metrics: Metrics
    INLINE_MIDDLEWARE = (MetricsMiddleware,)  # what the direct path does itself (see the class docstring)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.direct_routes: dict[tuple[str, str], Any] = {}
        self._direct_stack: Any = None  # the middleware around the direct path, built at its first request

    def add_middleware(self, middleware_class: Any, *args: Any, **kwargs: Any) -> None:
        """Starlette's ``add_middleware``; the middleware also wraps the generation routes' direct path.
        Like Starlette's, it raises once the app has served a request."""
        if self._direct_stack is not None:
            raise RuntimeError("Cannot add middleware after an application has started")
        super().add_middleware(middleware_class, *args, **kwargs)

    def _direct_entry(self) -> Any:
        """The direct path wrapped in the added middleware, outermost first as Starlette orders them."""
        if self._direct_stack is None:
            app: Any = self._direct_dispatch
            for cls, args, kwargs in reversed(self.user_middleware):
                if cls not in self.INLINE_MIDDLEWARE:
                    app = cls(app, *args, **kwargs)
            self._direct_stack = app
        return self._direct_stack

    def include_direct_routes(self, router: APIRouter, prefix: str) -> None:
        """Note the marked routes of ``router`` (included under ``prefix``) whose path has no parameters."""
        for route in router.routes:
            path = prefix + router.prefix + getattr(route, "path", "{")
            if isinstance(route, APIRoute) and getattr(route.endpoint, "__agentrl_direct__", False) \
                    and "{" not in path:
                for method in route.methods:
                    self.direct_routes[(method, path)] = route.endpoint

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        endpoint = self.direct_routes.get((scope["method"], scope["path"]))
        if endpoint is not None:
            scope[_DIRECT_ENDPOINT] = endpoint
            await self._direct_entry()(scope, receive, send)
            return
        # Starlette's ServerErrorMiddleware answers an unexpected exception (our 500 handler) and then raises
        # it on to the server, and uvicorn closes the connection of a request that raised after its response
        # started, so the client's next request on that kept connection fails with no answer. An exception
        # after the whole response went out is logged (by the handler, or here) and goes no further.
        complete = False

        async def send_noting_the_end(message: Any) -> None:
            nonlocal complete
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True

        try:
            await super().__call__(scope, receive, send_noting_the_end)
        except Exception as exc:
            if not complete:
                raise  # a response cut short: the server must close the connection
            if not getattr(exc, "agentrl_answered", False):
                log.exception("%s %s: error after the response was sent", scope["method"], scope["path"])

    async def _direct_dispatch(self, scope: Any, receive: Any, send: Any) -> None:
        await self._direct(scope[_DIRECT_ENDPOINT], scope, receive, send)

    async def _direct(self, endpoint: Any, scope: Any, receive: Any, send: Any) -> None:
        scope["app"] = self
        start = time.perf_counter()
        status = 500
        try:
            request = Request(scope, receive, send)
            try:
                response = await endpoint(request)
            except Exception as exc:
                _, handler = _exception_handler(self.exception_handlers, exc)
                if handler is None:
                    raise
                # the 500 handler logs the traceback; the exception is not raised on to the server (which
                # would close the client's kept connection, see __call__)
                response = await handler(request, exc)
            status = response.status_code
            await response(scope, receive, send)
        finally:
            path = scope["path"]
            self.metrics.requests.labels(path, str(status)).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - start)


_DIRECT_ENDPOINT = "agentrl.direct_endpoint"  # the scope key of the endpoint the direct path serves


def _exception_handler(handlers: dict[Any, Any], exc: Exception) -> tuple[Any, Any]:
    """The exception handler for ``exc`` (the nearest class of its MRO that has one) and that class."""
    for cls in type(exc).__mro__:
        if cls in handlers:
            return cls, handlers[cls]
    return None, None


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def model_name(info: EngineInfo) -> str:
    """The model's name from what the engine reports. SGLang reports the directory weights were last loaded
    from as ``model_path`` (and ``served_model_name``), vLLM's ``reload_weights`` points its model config at
    it too, so after a disk push a restarted gateway would name the model after the push directory;
    ``tokenizer_path`` keeps naming the model."""
    return Path(str(info.tokenizer_path or info.model_path or "model")).name


async def _discover(router: EngineRouter, settings: GatewaySettings) -> EngineInfo:
    info = await router.healthy_engine().describe()
    if settings.context_length:
        info.context_length = settings.context_length
    return info


SERVING_GC_THRESHOLDS = (1000, 20, 1000)  # gc.set_threshold of a process that only serves the app


def create_app(
    settings: GatewaySettings,
    *,
    http: httpx.AsyncClient | None = None,
    store: Store | None = None,
    tokenizer: Any | None = None,
    admission: Admission | None = None,
    freeze_gc: bool = False,
    trim_memory_s: float | None = None,
) -> FastAPI:
    """The gateway app. Injected parts are used as given and not closed at shutdown. ``freeze_gc``: the
    process serves only this app (``agentrl gateway``); what its start-up loaded is frozen out of the
    garbage collector's generations (``gc.freeze``). ``trim_memory_s``: give free heap pages back to the
    system this often (``gateway.memory.trim_loop``)."""
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own_http = http is None
        # kept connections expire before the engines' own keep-alive timeout (uvicorn: 5 s): one reused just
        # as the engine closed it failed the request (a health probe every 5 s hit that race now and then,
        # and the failed probe took the engine out of rotation: 503s until the next probe)
        client = http or httpx.AsyncClient(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=200,
                                                               keepalive_expiry=KEEPALIVE_EXPIRY_S))
        # generation calls go through the lean client unless the caller injected its own httpx client
        fast = FastHTTP() if own_http else None
        own_store = store is None
        opened: Store | None = store
        control: ControlPlane | None = None
        router: EngineRouter | None = None
        trajectories: TrajectoryService | None = None
        trimmer: asyncio.Task[None] | None = None
        try:
            engines = await connect_engines(settings.engine_url, settings.engine_kind, client,
                                            timeout_s=settings.engine_timeout_s,
                                            startup_timeout_s=settings.startup_timeout_s, fast=fast)
            router = EngineRouter(engines, health_interval_s=settings.health_interval_s)
            await router.wait_healthy(settings.startup_timeout_s)
            info = await _discover(router, settings)
            context = info.context_length
            tok = tokenizer
            if tok is None:
                path = settings.tokenizer or info.tokenizer_path or info.model_path
                if not path or not Path(str(path)).exists():
                    raise RuntimeError(
                        f"cannot find the tokenizer (engine says {path!r}); pass --tokenizer DIR")
                tok = await asyncio.to_thread(load_tokenizer, path)
            if not context:
                context = int(getattr(tok, "model_max_length", 0) or 0)
                if not 0 < context < 10_000_000:
                    raise RuntimeError("unknown context length: pass --context-length N")
            router.weight_version = info.weight_version if info.weight_version is not None else 0
            metrics.weight_version.set(router.weight_version)
            template = ChatTemplate(tok)
            if opened is None:
                from gateway.store import Store as StoreImpl

                opened = await StoreImpl.open(settings.db, redis_url=settings.redis,
                                              redis_prefix=settings.redis_prefix)
            name = settings.model_name or model_name(info)
            control = ControlPlane(router, metrics, redis=opened.redis, prefix=opened.redis_prefix,
                                   pause_timeout_s=settings.pause_timeout_s)
            # the lifecycle, built here and handed to the services typed: the export loop (with the
            # in-flight registry it reads) and, unless another was given, the staleness admission hook
            trajectories = TrajectoryService(opened, ExportSettings.from_settings(settings))
            chosen: Admission = admission or StalenessAdmission(trajectories)
            app.state.services = Services(
                settings=settings, store=opened, router=router, tokenizer=tok, template=template,
                metrics=metrics, model_name=name, context_length=context, implicit=ImplicitIndex(opened),
                admission=chosen, inflight=trajectories.inflight, trajectories=trajectories,
                trainer_log=TrainerLog(opened.redis, prefix=opened.redis_prefix),
                episodes=EpisodeLinker(opened, metrics.registry), started_at=time.time(), control=control)
            services = app.state.services
            metrics.watch_caches(lambda: [*services.store.cache_sizes(), *services.implicit.cache_sizes(),
                                          *services.router.cache_sizes(), *services.template.cache_sizes(),
                                          *link_cache_sizes()])
            await router.start()
            await control.start()
            trajectories.start()
            log.info("gateway ready: model %s, context %d, engines %s, db %s", name, context,
                     settings.engine_url, settings.db.split("@")[-1])
            if freeze_gc:
                # Everything loaded so far (modules, the tokenizer, the template, the clients) lives as long
                # as the process: out of the collector's reach, a full collection walks only what requests
                # made (one took ~140 ms over the start-up's objects under load: p99 spikes)
                gc.collect()
                gc.freeze()
                # Full collections only every 20,000 young ones: with the defaults (700, 10, 10) one ran
                # every ~1.5 s under load and paused the loop 40-240 ms each time, walking the caches' objects
                # (the p99). A turn leaves no reference cycles (the decoder's was the last one found), so
                # reference counting frees its objects and rarer full collections cost no memory.
                gc.set_threshold(*SERVING_GC_THRESHOLDS)
            if trim_memory_s:
                trimmer = asyncio.get_running_loop().create_task(trim_loop(trim_memory_s), name="agentrl-malloc-trim")
            yield
        finally:
            if trimmer is not None:
                trimmer.cancel()
            if trajectories is not None:
                await trajectories.stop()
            if control is not None:
                await control.close()
            if router is not None:
                await router.close()
            if own_store and opened is not None:
                await opened.close()
            if own_http:
                await client.aclose()
            if fast is not None:
                await fast.close()

    app = GatewayApp(title="agentrl gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                     openapi_url=None)
    app.state.metrics = metrics
    app.metrics = metrics
    _install_error_handlers(app)
    for router_, prefix in routers():
        app.include_router(router_, prefix=prefix)
        app.include_direct_routes(router_, prefix)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
