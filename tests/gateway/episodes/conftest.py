"""An in-process gateway over the scripted stand-in engine, for replaying captured CLI runs.

The stand-in (``tests.standin``) speaks SGLang's native API and answers the n-th ``/generate`` with the
n-th scripted reply, tokenized by the real tiny-model tokenizer; requests are replayed one at a time, so
the n-th request gets the n-th reply. Its context is large (the captured prompts, with their tools, are a
few thousand tokens). Recording goes to a real SQLite file (PostgreSQL + Redis in the tests that say so).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.inprocess import inprocess_gateway, tokenizer  # noqa: F401 (fixture)
from tests.standin import build_app

ADMIN, AGENT = "admin-k", "agent-k"
CONTEXT = 32768


class Gw:
    def __init__(self, app: Any, http: httpx.AsyncClient) -> None:
        self.app, self.http = app, http

    @property
    def svc(self) -> Any:
        return self.app.state.services

    @property
    def store(self) -> Any:
        return self.svc.store

    async def admin(self, method: str, path: str, body: Any = None) -> Any:
        resp = await self.http.request(method, path, json=body, headers={"Authorization": f"Bearer {ADMIN}"})
        assert resp.status_code == 200, resp.text
        return resp.json()


@pytest.fixture
def episode_gw(tmp_path: Path, tiny_model_dir: Path, tokenizer: Any) -> Callable[..., Any]:
    @asynccontextmanager
    async def make(replies: list[str], **overrides: Any) -> AsyncIterator[Gw]:
        engine = httpx.ASGITransport(app=build_app(str(tiny_model_dir), replies, tokenizer=tokenizer,
                                                   context_length=CONTEXT))
        async with inprocess_gateway(engine, tokenizer=tokenizer, timeout=60, **{
                "db": f"sqlite+aiosqlite:///{tmp_path}/gw.db", "admin_key": ADMIN, "agent_key": [AGENT],
                "context_length": CONTEXT, **overrides}) as (app, http):
            yield Gw(app, http)
    return make
