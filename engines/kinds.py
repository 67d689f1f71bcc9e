"""The one place that knows the engine kinds: which client and which control calls each has, and how an
engine's kind is told from what it answers.

SGLang (0.5.19 and 0.5.23) and the embedded engine answer ``GET /get_model_info`` (SGLang marks it
deprecated but keeps it: the one info route all three share; it is asked once, at start-up); vLLM 404s it
and answers ``GET /version``. :func:`kind_from` is the decision, without I/O, so that the gateway's async
probe (:func:`detect`, which also checks that a vLLM server has the routes the gateway needs) and the
trainer's sync one (:func:`probe_kind`) decide alike.

A new kind is one module (see ``engines.sglang`` and ``engines.vllm``) and one row in :data:`CLIENTS` and
:data:`OPS`, plus a rule in :func:`kind_from` (``docs/engines.md``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from engines.base import PLAIN_ERRORS, Engine, EngineErrors
from engines.control import EngineOpsError
from engines.sglang import SGLangClient, SGLangOps
from engines.transport import Transport, TransportError
from engines.vllm import VLLMClient, VLLMOps

CLIENTS: dict[str, Any] = {"sglang": SGLangClient, "vllm": VLLMClient}  # the gateway's client of each kind
OPS: dict[str, Any] = {"sglang": SGLangOps, "vllm": VLLMOps}  # the trainer's control calls of each kind

log = logging.getLogger(__name__)

SGLANG_PROBE = "/get_model_info"
VLLM_PROBE = "/version"


def kind_from(sglang_status: int, vllm_status: int | None) -> str | None:
    """``sglang`` or ``vllm`` from the statuses of :data:`SGLANG_PROBE` and :data:`VLLM_PROBE` (None: not
    asked); None while the answers say nothing yet (a server starting up answers 5xx, or nothing)."""
    if sglang_status == 200:
        return "sglang"
    if sglang_status == 404 and vllm_status == 200:
        return "vllm"
    return None


def probe_kind(client: httpx.Client, url: str) -> str:
    """The kind of the engine at ``url`` (synchronous, for the trainer, which asks once and cannot wait for a
    server to come up as the gateway does): :func:`kind_from`, and ``sglang`` where the answers fit no kind
    (the protocol every engine spoke before vLLM, whose own routes then report what is wrong); EngineOpsError
    when it cannot be reached."""
    url = url.rstrip("/")
    try:
        first = client.get(url + SGLANG_PROBE, timeout=10.0).status_code
        second = client.get(url + VLLM_PROBE, timeout=10.0).status_code if first == 404 else None
    except httpx.HTTPError as exc:
        raise EngineOpsError(f"cannot reach engine {url}: {exc!r}") from exc
    kind = kind_from(first, second)
    if kind is None:
        log.warning("engine %s: GET %s answered %d%s; taken as SGLang-native (pass --engine-kind to say)", url,
                    SGLANG_PROBE, first, f", GET {VLLM_PROBE} {second}" if second is not None else "")
        return "sglang"
    return kind


def make_engine(kind: str, base_url: str, transport: Transport, *, timeout_s: float = 600.0,
                errors: EngineErrors = PLAIN_ERRORS) -> Engine:
    """The client of one engine of a known kind."""
    if kind not in CLIENTS:
        raise ValueError(f"unknown engine kind {kind!r}; valid: {', '.join(CLIENTS)} (or auto to detect)")
    client: Engine = CLIENTS[kind](base_url, transport, timeout_s=timeout_s, errors=errors)
    return client


async def detect(base_url: str, transport: Transport, errors: EngineErrors = PLAIN_ERRORS) -> str | None:
    """``sglang`` or ``vllm`` by the routes the server answers; None while it does not answer yet.

    A vLLM server without ``VLLM_SERVER_DEV_MODE=1`` lacks the pause and weight routes the gateway needs,
    and one without ``--enable-scale-out`` refuses ``/inference/v1/generate`` (403): both are refused here
    (``errors.unavailable``) with a message that says how to fix it."""
    url = base_url.rstrip("/")
    try:
        first, _ = await transport.request("GET", url + SGLANG_PROBE, timeout_s=5.0)
        second = None
        if first == 404:
            second, _ = await transport.request("GET", url + VLLM_PROBE, timeout_s=5.0)
        kind = kind_from(first, second)
        if kind != "vllm":
            return kind
        dev, _ = await transport.request("GET", url + "/is_paused", timeout_s=5.0)
        generate, _ = await transport.request("POST", url + "/inference/v1/generate", b"{}",
                                              timeout_s=5.0)  # refused either way
    except TransportError:
        return None
    if dev == 404:
        raise errors.unavailable(
            f"engine {url} is a vLLM server without its RL API: start it with VLLM_SERVER_DEV_MODE=1")
    if generate in (403, 404):
        raise errors.unavailable(
            f"engine {url} is a vLLM server without its token-in/token-out route: start it with "
            f"--enable-scale-out (POST /inference/v1/generate answered {generate})")
    return "vllm"


async def connect(urls: list[str], kind: str, transports: list[Transport], *, timeout_s: float,
                  startup_timeout_s: float, errors: EngineErrors = PLAIN_ERRORS) -> list[Engine]:
    """One client per URL (``transports[i]`` carries engine ``i``'s bytes); with ``kind == "auto"`` each
    engine's kind is probed until it answers.

    An engine that does not answer within ``startup_timeout_s`` while another did is taken to be of the
    other's kind (a fleet is one kind; the router's health checks keep it out of rotation until it is up).
    """
    if kind != "auto":
        return [make_engine(kind, u, t, timeout_s=timeout_s, errors=errors) for u, t in zip(urls, transports)]
    deadline = time.monotonic() + startup_timeout_s

    async def probe(url: str, transport: Transport) -> str | None:
        while True:
            found = await detect(url, transport, errors)
            if found is not None or time.monotonic() > deadline:
                return found
            await asyncio.sleep(0.5)

    kinds = list(await asyncio.gather(*(probe(u, t) for u, t in zip(urls, transports))))
    known = [k for k in kinds if k is not None]
    if not known:
        raise errors.unavailable(
            f"cannot tell the kind of engine(s) {', '.join(urls)} within {startup_timeout_s:.0f}s (neither "
            f"GET {SGLANG_PROBE} nor GET {VLLM_PROBE} answered); start one, or pass --engine-kind sglang|vllm")
    return [make_engine(k or known[0], u, t, timeout_s=timeout_s, errors=errors)
            for k, u, t in zip(kinds, urls, transports)]


def control_ops(client: httpx.Client, url: str, kind: str = "auto") -> SGLangOps | VLLMOps:
    """The trainer's control calls to the engine at ``url``; ``kind`` ``auto`` probes it."""
    if kind == "auto":
        kind = probe_kind(client, url)
    if kind not in OPS:
        raise ValueError(f"unknown engine kind {kind!r}; valid: auto, {', '.join(OPS)}")
    ops: SGLangOps | VLLMOps = OPS[kind](client, url)
    return ops
