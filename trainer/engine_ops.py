"""The trainer's side of the engine protocol: the control operations of one engine, per engine kind.

The trainer talks to engines directly only to push weights (and, without a gateway, to pause them). Those
calls differ per engine kind; each kind's module in :mod:`engines` holds them (``engines.sglang.SGLangOps``:
SGLang's native API, which the embedded engine speaks too; ``engines.vllm.VLLMOps``: vLLM's RL API) behind
one small interface, :class:`engines.control.EngineOps`; :func:`engine_ops` picks the implementation,
detecting the kind where the gateway does too (:mod:`engines.kinds`).
"""

from __future__ import annotations

from engines import ENGINE_KINDS
from engines.control import EngineOps, EngineOpsError, post
from engines.kinds import control_ops as engine_ops
from engines.kinds import probe_kind
from engines.sglang import SGLangOps
from engines.vllm import VLLMOps

__all__ = ["ENGINE_KINDS", "EngineOps", "EngineOpsError", "SGLangOps", "VLLMOps", "engine_ops", "post", "probe_kind"]
