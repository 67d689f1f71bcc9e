"""Fixtures for trainer tests: an engine process of the trainer's own (weight pushes change it)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import httpx
import pytest
import torch

from agentrl.procs import Processes
from tests.conftest import free_port


def start_engine(procs: Processes, *extra: str) -> str:
    port = free_port()
    child = procs.start(f"engine-{port}", [sys.executable, "-m", "agentrl", "engine", "--model", "tiny",
                                           "--port", str(port), "--test-hooks", *extra])
    url = f"http://127.0.0.1:{port}"
    procs.wait_healthy(child, url + "/health", timeout_s=180)
    return url


@pytest.fixture(scope="session")
def trainer_engine_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One tiny engine for all trainer tests (not the shared ``engine_url`` one: weight pushes change it)."""
    with Processes(tmp_path_factory.mktemp("trainer-engine")) as procs:
        yield start_engine(procs)


@pytest.fixture
def trainer_engine(trainer_engine_process: str, tiny_model_dir) -> str:
    """The trainer tests' engine, reset to the tiny model's weights at version 0 (through its own API)."""
    resp = httpx.post(f"{trainer_engine_process}/update_weights_from_disk",
                      json={"model_path": str(tiny_model_dir), "weight_version": "0"}, timeout=120)
    assert resp.status_code == 200, resp.text
    return trainer_engine_process


@pytest.fixture(scope="session")
def dist_info():
    from trainer.model import init_distributed

    return init_distributed("cpu")


def engine_generate(url: str, prompt: list[int], n: int, *, temperature: float = 1.0, seed: int = 0) -> dict:
    resp = httpx.post(f"{url}/generate", json={
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": temperature, "sampling_seed": seed, "ignore_eos": True},
    }, timeout=120)
    resp.raise_for_status()
    body = resp.json()
    return {"output_ids": body["output_ids"], "logprobs": [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]],
            "version": int(body["meta_info"]["weight_version"])}


def engine_version(url: str) -> int:
    return int(httpx.get(f"{url}/get_model_info", timeout=30).json()["weight_version"])


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    from trainer.model import token_logprobs

    ids = torch.tensor([prompt + output])
    logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    return logp[0, len(prompt) - 1:]


# The gateway fixtures (real gateway processes). Importing them here makes ``gateway_factory`` use this
# directory's ``engine_url``: an engine of the trainer tests' own, because weight pushes change it.
from tests.gateway.conftest import GatewayProc, gateway_factory  # noqa: E402,F401


@pytest.fixture
def engine_url(trainer_engine: str) -> str:
    """Gateways started by ``gateway_factory`` in trainer tests serve the trainer tests' engine."""
    return trainer_engine
