"""The trainer's control calls, shared by every engine kind: one POST helper, one error, one protocol.

Control calls (pause, weight updates, memory release) are synchronous: the trainer makes them from its own
thread between steps, so a plain ``httpx.Client`` is the transport; tests put an ``httpx.MockTransport``
at that boundary.
"""

from __future__ import annotations

from typing import Any, Protocol

import httpx


class EngineOpsError(RuntimeError):
    """An engine refused or failed a control call (the trainer turns it into its WeightSyncError)."""


def post(client: httpx.Client, url: str, body: dict[str, Any] | None, *, timeout: float | None = None,
         headers: dict[str, str] | None = None, params: Any = None) -> dict[str, Any]:
    """POST JSON; any transport error, non-2xx status or ``success: false`` raises EngineOpsError."""
    try:
        resp = client.post(url, json=body, timeout=timeout or 120.0, headers=headers, params=params)
    except httpx.HTTPError as exc:
        raise EngineOpsError(f"POST {url} failed: {exc!r}") from exc
    try:
        data = resp.json() if resp.content else {}
    except ValueError:
        data = {"message": resp.text[:300]}
    if resp.status_code >= 300 or (isinstance(data, dict) and data.get("success") is False):
        if isinstance(data, dict):
            message = data.get("message") or data.get("error") or data.get("detail") or resp.text[:300]
        else:
            message = resp.text[:300]
        raise EngineOpsError(f"POST {url} answered {resp.status_code}: {message}")
    return data if isinstance(data, dict) else {}


class EngineOps(Protocol):
    """The trainer's calls to one engine; one implementation per kind (``engines.sglang``, ``engines.vllm``)."""

    url: str
    kind: str

    def pause_keep(self) -> None:
        """Stop generating; in-flight requests stay inside the engine (no gateway to re-send them)."""

    def resume_flushed(self) -> bool:
        """Drop the prefix cache (KV computed under the old weights) where the engine can, then generate.
        False when the engine kept its prefix cache (it refused the flush)."""

    def load_from_disk(self, path: str, version: int, *, timeout: float, flush_cache: bool = True) -> None:
        """Load a Hugging Face directory's weights; later tokens carry ``version``."""

    def set_version(self, version: int) -> None:
        """Keep the weights; later tokens carry ``version`` (``POST /update_weight_version``, a skipped step)."""

    def release_memory(self, tags: list[str]) -> None:
        """Give the GPU memory of ``tags`` (kv_cache, weights, cuda_graph) back while the trainer runs."""

    def resume_memory(self, tags: list[str]) -> None:
        """Take the memory of ``tags`` again (before the weight push and the resume of generation)."""
