"""Shared fixtures for tests that need a running engine and gateway (also used by export/agents/trainer).

- ``engine_url`` (session scope): a real tiny engine process (``python -m agentrl engine --model tiny``).
- ``gateway_factory``: starts real gateway processes (``python -m agentrl gateway ...``) on a database
  and Redis of your choice and returns a :class:`GatewayProc` (``base_url``, ``admin_key``,
  ``agent_key``, ``db``); every process is stopped at teardown.
- ``gateway``: one gateway process on a fresh SQLite file over ``engine_url``.

Example::

    def test_x(gateway_factory, engine_url, pg_url, redis_prefix):
        gw = gateway_factory(db=pg_url, redis=REDIS_URL, redis_prefix=redis_prefix)
        client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=gw.agent_key)
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentrl.procs import Processes
from tests.conftest import free_port

ADMIN_KEY = "test-admin-key"
AGENT_KEY = "test-agent-key"


def _each_stored(db: str, ids: list[str], read: Callable[[Any, str], Any]) -> list[Any]:
    """``await read(store, id)`` for each of ``ids``, with a store of this process on the database ``db``."""
    from gateway.store import Store

    async def go() -> list[Any]:
        store = await Store.open(db, migrate=False)
        try:
            return [await read(store, i) for i in ids]
        finally:
            await store.close()
    return asyncio.run(go())


def read_turns(db: str, ids: list[str]) -> list[Any]:
    """The stored turns ``ids`` of the database ``db`` (a gateway process's)."""
    return _each_stored(db, ids, lambda store, i: store.get_interaction(interaction_id=i))


def full_sequences(db: str, ids: list[str]) -> list[list[int]]:
    """The full token sequences of the stored turns ``ids`` of the database ``db``."""
    return _each_stored(db, ids, lambda store, i: store.full_sequence(interaction_id=i))


@dataclass
class GatewayProc:
    base_url: str  # http://127.0.0.1:PORT (append /v1 for the OpenAI SDK)
    admin_key: str
    agent_key: str
    db: str
    engine_urls: list[str]
    log_path: Path
    pid: int = 0  # the gateway process (for crash tests)

    def admin(self) -> httpx.Client:
        """An httpx client with the admin key (close it, or use it in a ``with`` block)."""
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {self.admin_key}"},
                            timeout=60.0)

    def create_session(self, **body: object) -> dict[str, str]:
        with self.admin() as client:
            resp = client.post("/v1/sessions", json=body)
            resp.raise_for_status()
            return resp.json()  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A running tiny engine (SGLang-native API) for the whole test session."""
    port = free_port()
    with Processes(tmp_path_factory.mktemp("engine-logs")) as procs:
        child = procs.start(f"engine-{port}", [sys.executable, "-m", "agentrl", "engine", "--model", "tiny",
                                               "--port", str(port), "--max-running-requests", "32", "--test-hooks"])
        url = f"http://127.0.0.1:{port}"
        procs.wait_healthy(child, url + "/health", timeout_s=120)
        yield url


def gateway_starter(procs: Processes, tmp_path: Path, default_urls: list[str]) -> Callable[..., GatewayProc]:
    """A gateway-process factory over ``procs`` (see ``gateway_factory``); also used over a vLLM server."""

    def start(db: str | None = None, redis: str | None = None, redis_prefix: str | None = None,
              engine_urls: list[str] | None = None, extra_args: tuple[str, ...] | list[str] = (),
              agent_key: str = AGENT_KEY, admin_key: str = ADMIN_KEY) -> GatewayProc:
        port = free_port()
        db = db or f"sqlite+aiosqlite:///{tmp_path}/gateway-{port}.db"
        urls = engine_urls or default_urls
        argv = [sys.executable, "-m", "agentrl", "gateway", "--engine-url", ",".join(urls), "--db", db,
                "--port", str(port), "--admin-key", admin_key, "--agent-key", agent_key,
                "--log-level", "warning", "--health-interval-s", "1", *extra_args]
        if redis:
            argv += ["--redis", redis]
        if redis_prefix:
            argv += ["--redis-prefix", redis_prefix]
        child = procs.start(f"gateway-{port}", argv)
        base = f"http://127.0.0.1:{port}"
        procs.wait_healthy(child, base + "/health", timeout_s=120)
        return GatewayProc(base, admin_key, agent_key, db, urls, child.log_path, child.proc.pid)

    return start


@pytest.fixture
def gateway_factory(tmp_path: Path, engine_url: str) -> Iterator[Callable[..., GatewayProc]]:
    """``factory(db=None, redis=None, redis_prefix=None, engine_urls=None, extra_args=()) -> GatewayProc``.

    ``db`` defaults to a fresh SQLite file under ``tmp_path``; ``engine_urls`` to ``[engine_url]``.
    """
    with Processes(tmp_path / "gateway-logs") as procs:
        yield gateway_starter(procs, tmp_path, [engine_url])


@pytest.fixture
def gateway(gateway_factory: Callable[..., GatewayProc]) -> GatewayProc:
    """One gateway process on a fresh SQLite database over the shared tiny engine."""
    return gateway_factory()
