"""Fixtures for the agents' integration tests: the gateway team's real engine + gateway processes, and a
scripted stand-in engine (``scripted_engine.py``) for deterministic tool calls."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentrl.procs import Processes
from tests.conftest import free_port
from tests.gateway.conftest import ADMIN_KEY, AGENT_KEY, GatewayProc
from tests.gateway.conftest import engine_url, gateway_factory  # noqa: F401  (fixtures used here)


@pytest.fixture(scope="module")
def gateway(engine_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:  # noqa: F811
    """One real gateway process (fresh SQLite) over the shared tiny engine, for a whole test module.

    Same command line as ``tests/gateway/conftest.py``'s ``gateway_factory``, but module-scoped: a gateway
    takes tens of seconds to start on a loaded machine, and these tests only add sessions of their own.
    """
    root = tmp_path_factory.mktemp("agents-gateway")
    port = free_port()
    db = f"sqlite+aiosqlite:///{root}/gateway.db"
    with Processes(root / "logs") as procs:
        child = procs.start(f"gateway-{port}", [
            sys.executable, "-m", "agentrl", "gateway", "--engine-url", engine_url, "--db", db, "--port", str(port),
            "--admin-key", ADMIN_KEY, "--agent-key", AGENT_KEY, "--log-level", "warning", "--health-interval-s", "1"])
        base = f"http://127.0.0.1:{port}"
        procs.wait_healthy(child, base + "/health", timeout_s=180)
        yield GatewayProc(base, ADMIN_KEY, AGENT_KEY, db, [engine_url], child.log_path)


@pytest.fixture
def scripted_engine(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Callable[[list[str]], str]]:
    """``start(texts) -> url`` of a stand-in engine whose k-th /generate returns ``texts[k]``."""
    with Processes(tmp_path / "scripted-logs") as procs:

        def start(texts: list[str]) -> str:
            port = free_port()
            child = procs.start(f"scripted-{port}", [sys.executable, "-m", "tests.agents.scripted_engine",
                                                     "--port", str(port), "--model-dir", str(tiny_model_dir),
                                                     "--script", json.dumps(texts)])
            url = f"http://127.0.0.1:{port}"
            procs.wait_healthy(child, url + "/health", timeout_s=60)
            return url

        yield start
