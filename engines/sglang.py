"""SGLang's native API (which the embedded engine speaks too): the release dialect and the trainer's calls.

Read in the wheels of 0.5.19 (the release ``docker-compose.yml`` pins) and 0.5.23 (the newest), and run in
the contract tests against each (``tests/deploy/test_sglang_own_code.py``). What differs between them, and
what the engine kind therefore learns from the server at start-up (:class:`SGLangDialect`):

- **Info routes.** ``GET /model_info`` and ``GET /server_info`` exist in both; ``/get_model_info`` and
  ``/get_server_info`` are deprecated aliases that log a warning on every call. The embedded engine has
  only the ``get_`` names. ``/server_info`` carries the release (``version``) and ``tp_size``; the weight
  version is in ``/model_info`` (``/get_weight_version`` is a 404 in 0.5.19 and gone in 0.5.23).
- **Weight-update sessions.** 0.5.23 answers ``/update_weights_from_distributed`` and
  ``/update_weights_from_tensor`` with ``success: false`` unless ``POST /begin_weight_update`` opened a
  session (``managers/scheduler_components/weight_updater.py``); ``POST /end_weight_update`` closes it and
  a second begin is refused while one is open. Disk updates need none. 0.5.19 has neither route.
- **Per-rank tensor payloads.** Each TP rank deserializes only ``serialized_named_tensors[tp_rank]``
  (both releases), so a tensor push carries one entry per rank.
- **Flush rules.** A flush needs an idle scheduler. 0.5.19 counts waiting requests too, and a weight update
  with ``flush_cache`` that finds any asserts (the server dies); 0.5.23 ignores the waiting queue while
  paused and answers such an update 400 instead.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import httpx

from engines.base import EngineOpsError, post

log = logging.getLogger(__name__)

PINNED = "0.5.19"  # docker-compose.yml
NEWEST = "0.5.23"
# the first release read with weight-update sessions; releases after 0.5.19 and before it were not read,
# so for those the session routes are tried and a 404 taken as "none" (SGLangOps.begin_weight_update)
SESSIONS_FROM = (0, 5, 23)
NO_SESSIONS_UP_TO = (0, 5, 19)


def release(version: object) -> tuple[int, int, int] | None:
    """``(0, 5, 23)`` for SGLang's ``version`` strings ("0.5.23", "0.5.23.post1", "0.5.19rc0"); None for
    anything else (the embedded engine reports ``agentrl-embedded-...``)."""
    match = re.match(r"^(\d+)\.(\d+)\.(\d+)", str(version or ""))
    return (int(match[1]), int(match[2]), int(match[3])) if match else None


@dataclass(frozen=True, slots=True)
class SGLangDialect:
    """What one SGLang-native server speaks, learned once from its server info."""

    version: str = ""  # the server's own ``version`` ("" when it did not say)
    tp_size: int = 1  # tensor-parallel ranks: each joins a weight group and reads its own tensor payload
    info_routes: bool = False  # /model_info and /server_info answer (SGLang); else the get_ names (embedded)

    @property
    def release(self) -> tuple[int, int, int] | None:
        return release(self.version)

    @property
    def sessions(self) -> bool | None:
        """Whether tensor and broadcast pushes run inside a weight-update session: True from 0.5.23, False
        up to 0.5.19 and for non-SGLang servers, None for releases in between (not read: try the route)."""
        found = self.release
        if found is None or found <= NO_SESSIONS_UP_TO:
            return False
        return True if found >= SESSIONS_FROM else None

    @property
    def model_info_route(self) -> str:
        return "/model_info" if self.info_routes else "/get_model_info"

    @property
    def server_info_route(self) -> str:
        return "/server_info" if self.info_routes else "/get_server_info"


def dialect_from(server_info: dict[str, Any], *, info_routes: bool) -> SGLangDialect:
    """The dialect of a server from its server-info body (``/server_info`` or ``/get_server_info``)."""
    try:
        tp_size = max(1, int(server_info.get("tp_size") or 1))
    except (TypeError, ValueError):
        tp_size = 1
    return SGLangDialect(version=str(server_info.get("version") or ""), tp_size=tp_size, info_routes=info_routes)


def parse_weight_version(raw: object) -> int | None:
    """SGLang's weight version (a string on the wire; ``"default"`` until a push names one) as an integer."""
    try:
        return int(str(raw))
    except (TypeError, ValueError):
        return None


class SGLangOps:
    """The trainer's calls to one SGLang-native engine (:class:`engines.base.EngineOps`)."""

    kind = "sglang"

    def __init__(self, client: httpx.Client, url: str) -> None:
        self.client, self.url = client, url.rstrip("/")
        self._dialect: SGLangDialect | None = None
        self._session = False
        self._no_sessions = False  # a release between those read answered /begin_weight_update 404

    def dialect(self) -> SGLangDialect:
        """Read once: ``GET /server_info``, or ``/get_server_info`` where that is missing (the embedded
        engine). An engine that answers neither is taken as one TP rank without sessions."""
        if self._dialect is None:
            found = SGLangDialect()
            for route, modern in (("/server_info", True), ("/get_server_info", False)):
                try:
                    resp = self.client.get(self.url + route, timeout=30.0)
                    if resp.status_code == 200:
                        found = dialect_from(resp.json(), info_routes=modern)
                        break
                except (httpx.HTTPError, ValueError, AttributeError) as exc:
                    log.info("%s%s: %r", self.url, route, exc)
                    break
            self._dialect = found
        return self._dialect

    # ------------------------------------------------------------------------------ pause and flush
    def pause_keep(self) -> None:
        # retract, not in_place: SGLang flushes its cache only with an idle scheduler; retract empties the
        # running batch into the waiting queue (0.5.23 then flushes while paused; 0.5.19 only without waiting
        # requests, see resume_flushed)
        post(self.client, f"{self.url}/pause_generation", {"mode": "retract"})

    def resume_flushed(self) -> bool:
        """Flush while still paused, then continue. A refused flush (0.5.19 with retracted requests waiting)
        is not retried: once they run again the scheduler is not idle until they end, and they would already
        have re-used the cached prefixes. It is reported instead (False, and a warning)."""
        try:
            resp = self.client.post(f"{self.url}/flush_cache", timeout=60.0)
        except httpx.HTTPError as exc:
            raise EngineOpsError(f"POST {self.url}/flush_cache failed: {exc!r}") from exc
        flushed = resp.status_code == 200
        if not flushed:
            log.warning("%s kept its prefix cache (flush refused: %s); requests that reuse a cached prefix see "
                        "KV computed under the previous weights", self.url, resp.text.strip()[:200])
        post(self.client, f"{self.url}/continue_generation", {})
        return flushed

    # ------------------------------------------------------------------------------ weight updates
    def load_from_disk(self, path: str, version: int, *, timeout: float, flush_cache: bool = True) -> None:
        post(self.client, f"{self.url}/update_weights_from_disk",
             {"model_path": str(path), "weight_version": str(version), "flush_cache": flush_cache},
             timeout=timeout)

    def begin_weight_update(self) -> None:
        """Open a weight-update session where the release has them (before tensor or broadcast pushes).

        A session left open (a trainer that died mid-push) is closed first: 0.5.23 refuses a second begin."""
        sessions = False if self._no_sessions else self.dialect().sessions
        if sessions is False:
            return
        url = f"{self.url}/begin_weight_update"
        try:
            resp = self.client.post(url, json={}, timeout=120.0)
        except httpx.HTTPError as exc:
            raise EngineOpsError(f"POST {url} failed: {exc!r}") from exc
        if resp.status_code == 404 and sessions is None:  # a release between the two read: it has none
            self._no_sessions = True
            return
        if resp.status_code == 400 and "already open" in resp.text:
            log.warning("%s had a weight-update session open (an earlier push did not end it): closed", self.url)
            post(self.client, f"{self.url}/end_weight_update", {})
            post(self.client, url, {})
        elif resp.status_code >= 300:
            raise EngineOpsError(f"POST {url} answered {resp.status_code}: {resp.text[:300]}")
        self._session = True

    def end_weight_update(self) -> None:
        """Close the session :meth:`begin_weight_update` opened (also after a failed push: a session left
        open refuses the next begin)."""
        if not self._session:
            return
        self._session = False
        post(self.client, f"{self.url}/end_weight_update", {})

    def tensor_payloads(self, serialized: str) -> list[str]:
        """``serialized_named_tensors`` for ``/update_weights_from_tensor``: one entry per TP rank (each rank
        opens its own entry; the handles are valid for every process on the machine)."""
        return [serialized] * self.dialect().tp_size

    def set_version(self, version: int) -> None:
        # SGLang's UpdateWeightVersionReqInput aborts every request unless told not to (0.5.19, 0.5.23)
        post(self.client, f"{self.url}/update_weight_version",
             {"new_version": str(version), "abort_all_requests": False})

    # ------------------------------------------------------------------------------ memory
    def release_memory(self, tags: list[str]) -> None:
        # ReleaseMemoryOccupationReqInput (0.5.19, 0.5.23); the server must be idle (the gateway's abort pause)
        post(self.client, f"{self.url}/release_memory_occupation", {"tags": list(tags)}, timeout=600.0)

    def resume_memory(self, tags: list[str]) -> None:
        post(self.client, f"{self.url}/resume_memory_occupation", {"tags": list(tags)}, timeout=600.0)
