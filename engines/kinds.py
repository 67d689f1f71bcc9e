"""The one place that tells an engine's kind from what it answers.

SGLang (0.5.19 and 0.5.23) and the embedded engine answer ``GET /get_model_info`` (SGLang marks it
deprecated but keeps it: the one info route all three share; it is asked once, at start-up); vLLM 404s it
and answers ``GET /version``. :func:`kind_from` is the decision, without I/O, so that the gateway's async
probe (``gateway.engines.probe_kind``, which also checks that a vLLM server has the routes the gateway
needs) and the trainer's sync one (:func:`probe_kind`) decide alike.
"""

from __future__ import annotations

import httpx

from engines.base import EngineOpsError

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
    """The kind of the engine at ``url`` (synchronous, for the trainer); EngineOpsError when it cannot be
    reached or its answers fit no kind."""
    url = url.rstrip("/")
    try:
        first = client.get(url + SGLANG_PROBE, timeout=10.0).status_code
        second = client.get(url + VLLM_PROBE, timeout=10.0).status_code if first == 404 else None
    except httpx.HTTPError as exc:
        raise EngineOpsError(f"cannot reach engine {url}: {exc!r}") from exc
    kind = kind_from(first, second)
    if kind is None:
        raise EngineOpsError(f"cannot tell the kind of engine {url}: GET {SGLANG_PROBE} answered {first}"
                             + (f", GET {VLLM_PROBE} {second}" if second is not None else "")
                             + "; pass --engine-kind sglang|vllm")
    return kind
