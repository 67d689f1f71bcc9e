"""The engine protocol: what the gateway needs from an inference engine, one implementation per engine kind.

Everything above this seam (recording, stitching, versions, pause/resume with held requests, health and
routing in :class:`gateway.engine_client.EngineRouter`) speaks :class:`Engine` only. Two kinds implement it:

- ``sglang``: SGLang's native HTTP API (``POST /generate`` token in / token out, ``/pause_generation``,
  ``/update_weights_from_disk``...), which the embedded engine (``agentrl engine``) speaks too:
  :class:`gateway.engine_client.EngineClient`.
- ``vllm``: vLLM's token-in/token-out ``POST /inference/v1/generate`` and its RL API, served with
  ``VLLM_SERVER_DEV_MODE=1`` (``/pause``, ``/resume``, ``/weight_info``, ``/collective_rpc``...):
  :class:`gateway.engines.vllm.VLLMClient`.

The kind is configured (``--engine-kind sglang|vllm``) or detected (``auto``) by probing a route only one
of them has: SGLang answers ``GET /get_model_info``, vLLM answers ``GET /version`` and 404s the former.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import httpx

from gateway.errors import EngineUnavailable

if TYPE_CHECKING:
    from gateway.engine_client import EngineOutput, SamplingParams
    from gateway.fasthttp import FastHTTP

ENGINE_KINDS = ("auto", "sglang", "vllm")


@dataclass(slots=True)
class EngineInfo:
    """What the gateway learns from an engine at start-up."""

    model_path: str | None  # the served model directory (tokenizer and chat template come from here)
    tokenizer_path: str | None
    weight_version: int | None  # None: the engine has no integer version yet ("default", unset)
    context_length: int  # 0 = unknown


@runtime_checkable
class Engine(Protocol):
    """One engine at ``base_url``. Errors are the gateway's own (``gateway.errors``): an unreachable engine
    raises :class:`EngineUnavailable`, a refused request :class:`InvalidRequest` (or
    :class:`ContextLengthExceeded`), anything else :class:`EngineError`."""

    kind: str
    base_url: str

    async def generate(self, input_ids: list[int], params: SamplingParams, max_new_tokens: int) -> EngineOutput:
        """The whole generation (``finish`` set; ``"abort"`` when a pause aborted it)."""
        ...

    def generate_stream(
        self, input_ids: list[int], params: SamplingParams, max_new_tokens: int
    ) -> AsyncIterator[EngineOutput]:
        """Cumulative outputs as tokens arrive; the last one has ``finish`` set."""
        ...

    async def health(self, *, paused: bool = False) -> bool | None:
        """True when the engine serves, False when it refuses or fails, None when it does not answer within
        the probe's timeout (alive but busy: the router waits for such an engine instead of refusing
        requests). ``paused``: the caller paused it, so only liveness is probed (SGLang's ``/health``
        generates a token and would wait behind the pause)."""
        ...

    async def describe(self) -> EngineInfo: ...

    async def weight_version(self) -> int | None: ...

    async def pause(self, mode: str = "abort") -> None:
        """Stop generating. ``abort``: in-flight requests end with finish ``abort`` (the router re-sends
        them after resume); ``in_place``/``retract``: they wait inside the engine."""
        ...

    async def continue_generation(self) -> None: ...

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> object:
        """Load new weights from a Hugging Face directory and tag later tokens with ``weight_version``."""
        ...


def make_engine(kind: str, base_url: str, http: httpx.AsyncClient, *, timeout_s: float = 600.0,
                fast: FastHTTP | None = None) -> Engine:
    """The client of one engine of a known kind (``sglang`` or ``vllm``). ``fast``: the lean HTTP client
    for SGLang-native generation calls (``gateway.fasthttp``)."""
    from gateway.engine_client import EngineClient
    from gateway.engines.vllm import VLLMClient

    if kind == "sglang":
        return EngineClient(base_url, http, timeout_s=timeout_s, fast=fast)
    if kind == "vllm":
        return VLLMClient(base_url, http, timeout_s=timeout_s)
    raise ValueError(f"unknown engine kind {kind!r}; valid: sglang, vllm (or auto to detect)")


async def probe_kind(base_url: str, http: httpx.AsyncClient) -> str | None:
    """``sglang`` or ``vllm`` by the routes the server answers; None while it does not answer yet.

    SGLang (and the embedded engine) answer ``GET /get_model_info``; vLLM does not (404) but answers
    ``GET /version``. A vLLM server without ``VLLM_SERVER_DEV_MODE=1`` lacks the pause and weight routes
    the gateway needs, and one without ``--enable-scale-out`` refuses ``/inference/v1/generate`` (403):
    both are refused here with a message that says how to fix it.
    """
    url = base_url.rstrip("/")
    try:
        resp = await http.get(url + "/get_model_info", timeout=5.0)
        if resp.status_code == 200:
            return "sglang"
        if resp.status_code != 404:
            return None
        version = await http.get(url + "/version", timeout=5.0)
        if version.status_code != 200:
            return None
        dev = await http.get(url + "/is_paused", timeout=5.0)
        generate = await http.post(url + "/inference/v1/generate", json={}, timeout=5.0)  # refused either way
    except httpx.HTTPError:
        return None
    if dev.status_code == 404:
        raise EngineUnavailable(
            f"engine {url} is a vLLM server without its RL API: start it with VLLM_SERVER_DEV_MODE=1")
    if generate.status_code in (403, 404):
        raise EngineUnavailable(
            f"engine {url} is a vLLM server without its token-in/token-out route: start it with "
            f"--enable-scale-out (POST /inference/v1/generate answered {generate.status_code})")
    return "vllm"


async def connect_engines(urls: list[str], kind: str, http: httpx.AsyncClient, *, timeout_s: float,
                          startup_timeout_s: float, fast: FastHTTP | None = None) -> list[Engine]:
    """One client per URL; with ``kind == "auto"`` each engine's kind is probed until it answers.

    An engine that does not answer within ``startup_timeout_s`` while another did is taken to be of the
    other's kind (a fleet is one kind; the router's health checks keep it out of rotation until it is up).
    """
    if kind != "auto":
        return [make_engine(kind, u, http, timeout_s=timeout_s, fast=fast) for u in urls]
    deadline = time.monotonic() + startup_timeout_s

    async def detect(url: str) -> str | None:
        while True:
            found = await probe_kind(url, http)
            if found is not None or time.monotonic() > deadline:
                return found
            await asyncio.sleep(0.5)

    kinds = list(await asyncio.gather(*(detect(u) for u in urls)))
    known = [k for k in kinds if k is not None]
    if not known:
        raise EngineUnavailable(
            f"cannot tell the kind of engine(s) {', '.join(urls)} within {startup_timeout_s:.0f}s (neither "
            "GET /get_model_info nor GET /version answered); start one, or pass --engine-kind sglang|vllm")
    return [make_engine(k or known[0], u, http, timeout_s=timeout_s, fast=fast) for k, u in zip(kinds, urls)]
