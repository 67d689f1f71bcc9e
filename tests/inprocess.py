"""The gateway in-process for tests: ``create_app`` over an upstream reached through an httpx transport
(usually the scripted stand-in engine of ``tests/standin.py``), its lifespan run, and an httpx client on
``http://gw`` that reaches it through ``httpx.ASGITransport``. No sockets, no processes: the fixtures of
the in-process test modules (``make_gw``, the UI's, the middleware's and the wire-format contract's) are
thin wrappers around :func:`inprocess_gateway`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from gateway.app import create_app, load_tokenizer
from gateway.settings import GatewaySettings


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    """The tiny model's real tokenizer, loaded once per module (import it into a test module to use it)."""
    return load_tokenizer(tiny_model_dir)


@asynccontextmanager
async def inprocess_gateway(engine: httpx.AsyncBaseTransport, *, tokenizer: Any, timeout: float = 30,
                            setup: Callable[[Any], None] | None = None,
                            **fields: Any) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """Yield ``(app, http)``: the gateway app, started, and a client on ``http://gw`` that reaches it.

    ``engine`` is the transport the gateway's engine client uses for ``http://engine``; ``fields`` are the
    :class:`GatewaySettings` (``db``, the keys, a test's overrides; the health checker is parked unless
    they say otherwise: ``health_interval_s`` 3600); ``setup`` runs on the app before its lifespan starts
    (routes or middleware a test adds)."""
    settings = GatewaySettings(**{"engine_url": ["http://engine"], "health_interval_s": 3600, **fields})
    settings.validate()
    async with httpx.AsyncClient(transport=engine) as engine_http:
        app = create_app(settings, http=engine_http, tokenizer=tokenizer)
        if setup is not None:
            setup(app)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                         timeout=timeout) as http:
                yield app, http


@asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    """``app`` on a real socket (its lifespan already run by the caller), for clients in other processes;
    yields its base URL. Waits for uvicorn's ``started`` flag (a server that fails to start raises here)."""
    from tests.conftest import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise AssertionError("the server ended before it started")
        await asyncio.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
