"""The trainer's side of the engine protocol: the control operations of one engine, per engine kind.

The trainer talks to engines directly only to push weights (and, without a gateway, to pause them). Those
calls differ per engine kind; each kind's module in :mod:`engines` holds them (``engines.sglang.SGLangOps``:
SGLang's native API, which the embedded engine speaks too; ``engines.vllm.VLLMOps``: vLLM's RL API) behind
one small interface, :class:`engines.base.EngineOps`. :func:`engine_ops` picks the implementation, detecting
the kind the way the gateway does (:mod:`engines.kinds`).
"""

from __future__ import annotations

import httpx

from engines import ENGINE_KINDS
from engines.base import EngineOps, EngineOpsError, post
from engines.kinds import probe_kind
from engines.sglang import SGLangOps
from engines.vllm import VLLMOps

__all__ = ["ENGINE_KINDS", "EngineOps", "EngineOpsError", "SGLangOps", "VLLMOps", "engine_ops", "post", "probe_kind"]

OPS = {"sglang": SGLangOps, "vllm": VLLMOps}


def engine_ops(client: httpx.Client, url: str, kind: str = "auto") -> SGLangOps | VLLMOps:
    """The ops of the engine at ``url``; ``kind`` ``auto`` probes it."""
    if kind == "auto":
        kind = probe_kind(client, url)
    if kind not in OPS:
        raise ValueError(f"unknown engine kind {kind!r}; valid: {', '.join(ENGINE_KINDS)}")
    return OPS[kind](client, url)
