"""SGLang's native API (which the embedded engine speaks too): its dialects, the gateway's client, the
trainer's calls.

- :class:`SGLangClient`: the :class:`~engines.base.Engine` protocol (``POST /generate`` token in / token out
  with logprobs, cumulative SSE chunks; pause/continue; disk weight updates; health), for the gateway;
- :class:`SGLangOps`: the trainer's control calls (pause and flush, weight updates and their sessions,
  memory release);
- :class:`SGLangDialect`: what the server's release speaks, which both learn from it.

The wire shapes are those of ``docs/sglang-protocol.md``.

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
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from engines.base import (PLAIN_ERRORS, SSE_DONE, EngineErrors, EngineInfo, EngineOutput, SamplingParams, abort_unless,
                          dumps, engine_error, error_text, parse_version, span_versions, sse_json, stream_error)
from engines.caller import EngineCaller
from engines.control import EngineOpsError, post
from engines.transport import Transport, TransportError

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


def parse_output(body: dict[str, Any], known: int = 0, errors: EngineErrors = PLAIN_ERRORS) -> EngineOutput:
    """One SGLang ``/generate`` response (or cumulative stream chunk) as an :class:`EngineOutput`.

    ``known``: output tokens the stream's earlier chunks held; a chunk that still holds them (SGLang's
    cumulative streams) is read from there on (``start`` = ``known``), else whole (``start`` = 0)."""
    if "error" in body:
        err = body["error"]
        raise errors.failed(f"engine error: {err.get('message', err) if isinstance(err, dict) else err}")
    meta = body.get("meta_info") or {}
    raw_ids = body.get("output_ids") or []
    raw_entries = meta.get("output_token_logprobs") or []
    spans = meta.get("weight_versions")
    start = known if 0 < known <= len(raw_ids) == len(raw_entries) and not spans else 0
    ids = [int(t) for t in raw_ids[start:]]
    entries = raw_entries[start:]
    logprobs = [float(e[0]) if e[0] is not None else 0.0 for e in entries]
    if len(logprobs) != len(ids):
        # SGLang 0.5.19 answers a streamed request aborted while in its waiting queue (e.g. retracted by a
        # `retract` pause, then aborted) with output_ids=[last token] but the cumulative logprobs and
        # completion_tokens (TokenizerManager._handle_abort_req); each logprob entry names its token, so the
        # ids are recovered from the entries when the ids sent are their tail.
        entry_ids = [int(e[1]) for e in entries if len(e) > 1 and e[1] is not None]
        if len(entry_ids) == len(entries) and len(ids) < len(entry_ids) and entry_ids[len(entry_ids) - len(ids):] == ids:
            ids = entry_ids
        else:
            raise errors.failed(
                f"engine returned {len(ids)} output ids but {len(logprobs)} logprobs; is return_logprob honoured?")
    top = meta.get("output_top_logprobs")
    top_parsed = None
    if top is not None:
        top_parsed = [[(int(t[1]), float(t[0])) for t in (row or [])] for row in top[start:]]
    reason = meta.get("finish_reason")
    finish, matched, status, message = None, None, None, None
    if isinstance(reason, dict):
        finish, matched = reason.get("type"), reason.get("matched")
        if finish == "abort":  # FINISH_ABORT: a refusal carries status_code (400, 500, 503), a pause none
            code = reason.get("status_code")
            status = code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600 else None
            message = str(reason.get("message") or "aborted")
    elif isinstance(reason, str):
        finish = reason
    return EngineOutput(ids, logprobs, top_parsed, finish, matched,
                        parse_version(meta.get("weight_version")), int(meta.get("prompt_tokens") or 0),
                        status, message, span_versions(spans, len(ids)), start)


class SGLangClient(EngineCaller):
    """One SGLang-native engine at ``base_url`` (the gateway's side), its bytes carried by ``transport``."""

    kind = "sglang"

    def __init__(self, base_url: str, transport: Transport, *, timeout_s: float = 600.0,
                 errors: EngineErrors = PLAIN_ERRORS) -> None:
        super().__init__(base_url, transport, timeout_s=timeout_s, errors=errors)
        # what this server's release speaks (info routes), learned by describe(); until then the routes every
        # SGLang-native server answers (the embedded engine has only these)
        self.dialect = SGLangDialect()

    @staticmethod
    def _body(input_ids: list[int], params: SamplingParams, max_new_tokens: int, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "rid": uuid.uuid4().hex,  # our own request id, so that the request can be aborted by it
            "input_ids": input_ids,
            "sampling_params": params.to_wire(max_new_tokens),
            "return_logprob": True,
            "stream": stream,
        }
        if params.top_logprobs:
            body["top_logprobs_num"] = params.top_logprobs
        return body

    async def _abort(self, request_id: str) -> None:
        """Abort one request (SGLang 0.5.19 and 0.5.23 ``AbortReq``: ``rid``; the embedded engine too)."""
        await self._call("POST", "/abort_request", {"rid": request_id}, timeout_s=30.0)

    # ---- generation
    async def generate(self, input_ids: list[int], params: SamplingParams, max_new_tokens: int) -> EngineOutput:
        body = self._body(input_ids, params, max_new_tokens, False)
        done = False
        try:
            status, content = await self.transport.request("POST", self.base_url + "/generate", dumps(body),
                                                           timeout_s=self.timeout_s)
            done = True  # the engine answered (a refusal too): nothing of the request runs there
        except TransportError as exc:
            raise self._unreachable(exc) from exc
        finally:
            await abort_unless(done, self._abort, body["rid"], self.base_url)
        if status >= 400:
            raise engine_error(self.errors, self.base_url, status, error_text(content, f"HTTP {status}"))
        return parse_output(self._json(content, "/generate"), errors=self.errors)

    async def generate_stream(
        self, input_ids: list[int], params: SamplingParams, max_new_tokens: int
    ) -> AsyncIterator[EngineOutput]:
        """Outputs as the engine streams them (SGLang's default, cumulative mode): each one holds the tokens
        from its ``start`` on, the earlier ones being those of the outputs before it."""
        body = self._body(input_ids, params, max_new_tokens, True)
        malformed = self.errors.failed(f"engine {self.base_url} sent a malformed stream chunk")
        done = False
        try:
            async with self.transport.stream(self.base_url + "/generate", dumps(body),
                                             timeout_s=self.timeout_s) as resp:
                if resp.status >= 400:
                    content = await resp.read()
                    done = True  # refused: nothing runs
                    raise engine_error(self.errors, self.base_url, resp.status,
                                       error_text(content, f"HTTP {resp.status}"))
                known = 0
                lines = resp.lines()
                events = sse_json(lines, malformed)
                try:
                    async for chunk in events:
                        if chunk is SSE_DONE:
                            done = True
                            await resp.finish()  # the response's end follows [DONE]: the connection is kept
                            return
                        if isinstance(chunk, dict) and "error" in chunk:
                            done = True  # SGLang's refusal once the stream began: the request is over
                            raise stream_error(self.errors, self.base_url, chunk["error"])
                        out = parse_output(chunk, known, self.errors)
                        known = out.start + len(out.output_ids)
                        done = out.finish is not None
                        yield out
                finally:
                    await events.aclose()
                    await lines.aclose()
        except TransportError as exc:
            raise self._unreachable(exc) from exc
        finally:
            await abort_unless(done, self._abort, body["rid"], self.base_url)

    # ---- health and information
    async def health(self, *, paused: bool = False) -> bool | None:
        """Whether the engine serves: True, False (refused, an error status), or None when it did not answer
        within the probe's 5 s (alive but busy: loading weights, or a probe queued behind a long batch).
        SGLang's ``/health`` runs a one-token generation, which waits behind a pause
        (``SGLANG_HEALTH_CHECK_TIMEOUT``, 20 s, then 503); an engine the caller paused is probed for liveness
        with the model-info route instead (``/model_info``; ``/get_model_info`` on the embedded engine),
        which SGLang answers without its scheduler."""
        path = self.dialect.model_info_route if paused else "/health"
        try:
            status, _ = await self.transport.request("GET", self.base_url + path, timeout_s=5.0)
        except TransportError as exc:
            return None if exc.kind == "timeout" else False
        return status == 200

    async def model_info(self) -> dict[str, Any]:
        info: dict[str, Any] = self._json(await self._call("GET", self.dialect.model_info_route, timeout_s=10.0),
                                          self.dialect.model_info_route)
        return info

    async def server_info(self) -> dict[str, Any]:
        """``/server_info`` (SGLang), else ``/get_server_info`` (the embedded engine); learns the dialect."""
        for path, modern in (("/server_info", True), ("/get_server_info", False)):
            try:
                status, content = await self.transport.request("GET", self.base_url + path, timeout_s=10.0)
            except TransportError as exc:
                raise self._unreachable(exc) from exc
            if status == 404 and modern:
                continue
            if status >= 400:
                raise engine_error(self.errors, self.base_url, status, error_text(content, f"HTTP {status}"))
            info: dict[str, Any] = self._json(content, path)
            self.dialect = dialect_from(info, info_routes=modern)
            return info
        raise self.errors.failed(f"engine {self.base_url} answers neither /server_info nor /get_server_info")

    async def describe(self) -> EngineInfo:
        try:
            server = await self.server_info()
            context = int(server.get("context_length") or server.get("max_req_input_len") or 0)
        except Exception:  # noqa: BLE001 - the context length is optional; model info below is not
            context = 0
        info = await self.model_info()
        return EngineInfo(model_path=info.get("model_path"), tokenizer_path=info.get("tokenizer_path"),
                          weight_version=parse_version(info.get("weight_version")), context_length=context)

    async def weight_version(self) -> int | None:
        # the model-info route carries it (SGLang 0.5.19, 0.5.23, the embedded engine); /get_weight_version is
        # a 404 in 0.5.19 and gone in 0.5.23
        return parse_version((await self.model_info()).get("weight_version"))

    # ---- control
    async def pause(self, mode: str = "abort") -> None:
        await self._call("POST", "/pause_generation", {"mode": mode}, timeout_s=60.0)

    async def continue_generation(self) -> None:
        await self._call("POST", "/continue_generation", {}, timeout_s=60.0)

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        result: dict[str, Any] = self._json(await self._call("POST", "/update_weights_from_disk", body),
                                            "/update_weights_from_disk")
        return result


class SGLangOps:
    """The trainer's calls to one SGLang-native engine (:class:`engines.control.EngineOps`)."""

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

    # ------------------------------------------------------------------------------ LoRA adapters
    # Routes and bodies read in 0.5.19 and 0.5.23 (``srt/entrypoints/http_server.py``, ``srt/managers/
    # io_struct.py``: LoadLoRAAdapterReqInput, LoadLoRAAdapterFromTensorsReqInput, UnloadLoRAAdapterReqInput);
    # each answers ``LoRAUpdateOutput`` {success, error_message, loaded_adapters}, 400 when refused. The server
    # runs with ``--enable-lora`` (and ``--max-lora-rank``, ``--lora-target-modules`` to load adapters later).
    def load_adapter(self, name: str, path: str) -> None:
        """Load the peft directory ``path`` as ``name`` (refused, 400, while ``name`` is loaded)."""
        post(self.client, f"{self.url}/load_lora_adapter", {"lora_name": name, "lora_path": str(path)},
             timeout=600.0)

    def load_adapter_tensors(self, name: str, config_dict: dict[str, Any], serialized: str) -> None:
        """Load an adapter from tensors: ``config_dict`` is the ``adapter_config.json`` content, ``serialized``
        base64 of SGLang's ``MultiprocessingSerializer`` form of ``{peft key: tensor}`` (one copy per TP rank)."""
        post(self.client, f"{self.url}/load_lora_adapter_from_tensors",
             {"lora_name": name, "config_dict": config_dict, "serialized_named_tensors": self.tensor_payloads(serialized),
              "load_format": None}, timeout=600.0)

    def unload_adapter(self, name: str) -> bool:
        """Unload ``name``; False when the engine did not have it (SGLang's 400 "... does not exist")."""
        try:
            post(self.client, f"{self.url}/unload_lora_adapter", {"lora_name": name})
        except EngineOpsError as exc:
            if "does not exist" in str(exc):  # lora/lora_registry.py's answer for an unknown name
                return False
            raise
        return True

    def reload_adapter(self, name: str, path: str) -> None:
        """A new version under the same name: SGLang refuses to load a loaded name, so unload, then load (while
        generation is paused: no request sees the name missing). The reloaded adapter gets a new id, and the
        radix cache is keyed by it: no KV of the old version is reused."""
        self.unload_adapter(name)
        self.load_adapter(name, path)

    def reload_adapter_tensors(self, name: str, config_dict: dict[str, Any], serialized: str) -> None:
        self.unload_adapter(name)
        self.load_adapter_tensors(name, config_dict, serialized)

    # ------------------------------------------------------------------------------ memory
    def release_memory(self, tags: list[str]) -> None:
        # ReleaseMemoryOccupationReqInput (0.5.19, 0.5.23); the server must be idle (the gateway's abort pause)
        post(self.client, f"{self.url}/release_memory_occupation", {"tags": list(tags)}, timeout=600.0)

    def resume_memory(self, tags: list[str]) -> None:
        post(self.client, f"{self.url}/resume_memory_occupation", {"tags": list(tags)}, timeout=600.0)
