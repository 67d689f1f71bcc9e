"""``vllm_server`` (session scope): one real vLLM server for the whole test run, and gateways over it.

In CI (``CI=true``) the server must run: the fixture creates ``.venv-vllm`` if it is missing (see
``tests/vllm/server.py``). Elsewhere the live tests are skipped, with the reason, when ``.venv-vllm`` is
absent (``make test-vllm`` creates it). ``AGENTRL_TEST_VLLM_URL=http://...`` runs them against a server
that is already up instead (the test that kills the server is then skipped).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentrl.procs import Child, Processes
from engine.models import agentrl_home
from tests.conftest import free_port
from tests.gateway.conftest import GatewayProc, gateway_starter
from tests.vllm import server


@dataclass
class VLLMServer:
    url: str
    model_dir: Path
    child: Child | None  # None: a server this run did not start (AGENTRL_TEST_VLLM_URL)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_venv() -> None:
    """Skip (with the reason) without ``.venv-vllm``, unless in CI, where it is created."""
    if not server.venv_ready():
        if not in_ci():
            pytest.skip(f"no vLLM environment at {server.VENV}: run `make test-vllm` (creates it, ~2-10 min) "
                        "or set CI=true")
        server.ensure_venv()


@contextmanager
def running_vllm(model_dir: Path, logs: Path, **argv: Any) -> Iterator[VLLMServer]:
    """A vLLM server over ``model_dir`` (``server.server_argv``), healthy, killed on exit."""
    port = free_port()
    with Processes(logs) as procs:
        child = procs.start(f"vllm-{port}", server.server_argv(model_dir, port, **argv), env=server.server_env())
        url = f"http://127.0.0.1:{port}"
        # warm-up on 2 shared cores: 1-2 minutes on a quiet machine, several under load
        procs.wait_healthy(child, url + "/health", timeout_s=900)
        yield VLLMServer(url, model_dir, child)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    external = os.environ.get("AGENTRL_TEST_VLLM_URL")
    if external:  # a server already running (started with tests/vllm/server.py's arguments)
        import httpx

        root = httpx.get(external.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["root"]
        yield VLLMServer(external.rstrip("/"), Path(root), None)
        return
    require_venv()
    model_dir = server.tiny_vllm_model(agentrl_home() / "models" / "tiny-vllm")
    with running_vllm(model_dir, tmp_path_factory.mktemp("vllm-logs")) as running:
        yield running


@pytest.fixture
def vllm_gateway(vllm_server: VLLMServer, tmp_path: Path) -> Iterator[Callable[..., GatewayProc]]:
    """Starts gateway processes over the vLLM server (``--engine-kind auto``: it detects vLLM)."""
    with Processes(tmp_path / "gateway-logs") as procs:
        yield gateway_starter(procs, tmp_path, [vllm_server.url])
