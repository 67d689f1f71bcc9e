"""The SGLang-native engine client (:class:`EngineClient`, one per URL) and the :class:`EngineRouter` over engines.

The router speaks the engine protocol of :mod:`gateway.engines` (:class:`~gateway.engines.Engine`), so it
routes over SGLang-native engines (SGLang, the embedded engine) and vLLM servers
(:class:`gateway.engines.vllm.VLLMClient`) alike.

The wire shapes are those of ``docs/sglang-protocol.md`` (``POST /generate`` token in / token out with
logprobs; pause/continue; weight updates; health). Every client takes an injected ``httpx.AsyncClient`` so
that tests put a ``MockTransport`` at the protocol boundary. httpx errors are translated here, where they
enter the gateway: connection problems become :class:`EngineUnavailable`, a 400 from the engine (or an
error event in its stream, SGLang's way of refusing a streamed request) becomes :class:`InvalidRequest`
with the engine's message, anything else :class:`EngineError`.

The router keeps several engines in rotation: least in-flight requests first, with session affinity (a
session sticks to the engine that served it, so that its prefix cache stays warm), periodic health
checks (a dead engine leaves the rotation and comes back when ``/health`` answers 200 again). It also
owns generation across weight updates: ``pause`` aborts in-flight generations on the engines; the router
holds each aborted request, and on ``resume`` re-sends it as prompt + partial output, so the caller sees
one uninterrupted generation whose tokens carry the weight version of the segment that produced them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import httpx

from engines.sglang import SGLangDialect, dialect_from
from gateway import jsonio
from gateway.fasthttp import FastHTTP, HTTPFailure, lines, supported
from gateway.sizedlru import CacheSize
from gateway.errors import ContextLengthExceeded, EngineError, EngineUnavailable, GatewayError, InvalidRequest

if TYPE_CHECKING:
    from gateway.engines import Engine, EngineInfo

log = logging.getLogger("agentrl.gateway.engine")


@dataclass(slots=True)
class SamplingParams:
    """What the gateway asks of one generation (converted to SGLang ``sampling_params``)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    top_logprobs: int = 0
    penalties: dict[str, Any] = field(default_factory=dict)  # SGLang names (gateway.constraints.penalties)
    grammar: dict[str, str] = field(default_factory=dict)  # one SGLang grammar key (gateway.constraints.Grammar)

    def continued(self, generated: int) -> "SamplingParams":
        """The parameters of a segment that continues after ``generated`` tokens (a pause or a lost engine):
        ``min_new_tokens`` asks only for what is still owed (engines refuse a minimum above the new maximum)."""
        owed = self.penalties.get("min_new_tokens")
        if not generated or not owed:
            return self
        penalties = dict(self.penalties)
        if owed > generated:
            penalties["min_new_tokens"] = owed - generated
        else:
            del penalties["min_new_tokens"]
        return replace(self, penalties=penalties)

    def to_wire(self, max_new_tokens: int) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "skip_special_tokens": False,
        }
        if self.top_k > 0:
            params["top_k"] = self.top_k
        if self.seed is not None:
            params["sampling_seed"] = self.seed
        if self.stop:
            params["stop"] = list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        params.update(self.penalties)
        params.update(self.grammar)
        return params


@dataclass(slots=True)
class EngineOutput:
    """The cumulative state of one ``/generate`` call (SGLang streams cumulative chunks by default)."""

    output_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    finish: str | None  # "stop" | "length" | "abort" | None while running
    matched: int | str | None
    weight_version: int | None
    prompt_tokens: int
    abort_status: int | None = None  # SGLang's refusal inside a stream: finish_reason.status_code
    abort_message: str | None = None
    # the weight version of each output token, from the finished output's ``weight_versions`` spans
    # (SGLang 0.5.19, vLLM 0.32); None where the engine sent none (intermediate chunks) or "default"
    versions: list[int] | None = None
    # the output position the lists start at: a cumulative stream chunk is parsed only past what the
    # chunks before it held (``parse_output(body, known)``), so per chunk the work is its new tokens
    start: int = 0


@dataclass(slots=True)
class Generation:
    """The cumulative state of a generation across segments (abort + resume makes several)."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop" | "length" when done
    matched: int | str | None = None
    segments: int = 0
    engine_url: str = ""


def _parse_version(raw: object) -> int | None:
    try:
        return int(str(raw))
    except (TypeError, ValueError):
        return None  # SGLang's default version is the string "default"


def span_versions(spans: object, n: int) -> list[int] | None:
    """Per-token versions from ``weight_versions`` spans ``[{"version", "start", "end"}, ...]`` (SGLang 0.5.19
    ``utils/weight_versions.py``; vLLM 0.32 the same shape) over ``n`` output tokens; None when absent, when
    a version is not an integer (``"default"``) or when the spans do not cover the tokens exactly."""
    if not isinstance(spans, list) or not spans:
        return None
    out: list[int] = []
    for span in spans:
        version = _parse_version(span.get("version")) if isinstance(span, dict) else None
        start, end = (span.get("start"), span.get("end")) if isinstance(span, dict) else (None, None)
        if version is None or start != len(out) or not isinstance(end, int) or end < start:
            return None
        out.extend([version] * (end - start))
    return out if len(out) == n else None


def parse_output(body: dict[str, Any], known: int = 0) -> EngineOutput:
    """One SGLang ``/generate`` response (or cumulative stream chunk) as an :class:`EngineOutput`.

    ``known``: output tokens the stream's earlier chunks held; a chunk that still holds them (SGLang's
    cumulative streams) is read from there on (``start`` = ``known``), else whole (``start`` = 0)."""
    if "error" in body:
        err = body["error"]
        raise EngineError(f"engine error: {err.get('message', err) if isinstance(err, dict) else err}")
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
            raise EngineError(
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
                        _parse_version(meta.get("weight_version")), int(meta.get("prompt_tokens") or 0),
                        status, message, span_versions(spans, len(ids)), start)


def engine_error(base_url: str, status: int, message: str) -> GatewayError:
    """The gateway error for an engine error of this HTTP status (a response, an error event, or an abort
    chunk's ``status_code``)."""
    if status == 400:
        if "context" in message.lower() or "too long" in message.lower():
            return ContextLengthExceeded(f"the engine rejected the prompt: {message}", param="messages")
        return InvalidRequest(f"the engine rejected the request: {message}")
    if status == 503:
        return EngineUnavailable(f"engine {base_url} unavailable: {message}")
    return EngineError(f"engine {base_url} answered {status}: {message}")


def _error_message(resp: httpx.Response) -> str:
    return error_text(resp.content, resp.reason_phrase)


def error_text(content: bytes, reason: str = "") -> str:
    """The message of an engine's error response body (JSON ``error.message`` / ``message``, else text)."""
    try:
        body = jsonio.loads(content)
    except ValueError:
        return content.decode("utf-8", "replace")[:500] or reason
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)[:500]


async def _drain(chunks: AsyncIterator[Any], within_s: float = 1.0) -> None:
    """Read what is left of a response (normally only its end), so that its connection can be reused; one
    that does not end within ``within_s`` is closed instead (by the caller's ``aclose``)."""
    try:
        async with asyncio.timeout(within_s):
            async for _ in chunks:
                pass
    except (TimeoutError, HTTPFailure):  # the generation is complete either way
        pass


_JSON = {"content-type": "application/json"}
SSE_DONE = object()  # what :func:`sse_json` yields for the stream's ``data: [DONE]`` line


async def sse_json(resp: httpx.Response | AsyncIterator[str], malformed: str) -> AsyncIterator[Any]:
    """The JSON payloads of an engine's SSE stream (``data:`` lines of a response, or of its lines), then
    :data:`SSE_DONE` if the engine ended it with ``[DONE]``; a payload that is not JSON raises
    EngineError(``malformed``)."""
    async for line in (resp.aiter_lines() if isinstance(resp, httpx.Response) else resp):
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            yield SSE_DONE
            return
        try:
            yield jsonio.loads(data)
        except ValueError as exc:
            raise EngineError(malformed) from exc


class EngineClient:
    """One SGLang-native engine at ``base_url``, spoken to through the injected ``http`` client."""

    kind = "sglang"

    def __init__(self, base_url: str, http: httpx.AsyncClient, *, timeout_s: float = 600.0,
                 fast: FastHTTP | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = http
        self.timeout = httpx.Timeout(timeout_s, connect=5.0)
        self.timeout_s = timeout_s
        # /generate (streamed or not) goes through the lean client when given one (the app's own, not an
        # injected httpx client) and it can reach the URL; everything else through ``http``
        self.fast = fast if fast is not None and supported(self.base_url) else None
        # what this server's release speaks (info routes, weight-update sessions), learned by describe();
        # until then the routes every SGLang-native server answers (the embedded engine has only these)
        self.dialect = SGLangDialect()

    def _translate(self, exc: httpx.HTTPError | HTTPFailure) -> EngineUnavailable:
        name = f"HTTP {exc.kind}" if isinstance(exc, HTTPFailure) else type(exc).__name__
        return EngineUnavailable(f"engine {self.base_url} unreachable: {name}: {exc}")

    def error(self, status: int, message: str) -> GatewayError:
        return engine_error(self.base_url, status, message)

    def _check(self, resp: httpx.Response) -> None:
        if resp.status_code >= 400:
            raise self.error(resp.status_code, _error_message(resp))

    def _stream_error(self, err: object) -> GatewayError:
        """An error event in a stream (SGLang: a request it refuses once the stream has begun, e.g. a
        prompt longer than the context). It carries no status, or (newer releases) ``code``; without one
        it is the refusal a non-streamed request gets as a 400."""
        if not isinstance(err, dict):
            return self.error(400, str(err))
        code = err.get("code")
        status = code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600 else 400
        return self.error(status, str(err.get("message", err)))

    async def _post(self, path: str, body: dict[str, Any], timeout: float | None = None) -> httpx.Response:
        try:
            resp = await self.http.post(self.base_url + path, content=jsonio.dumps(body), headers=_JSON,
                                        timeout=self.timeout if timeout is None else timeout)
        except httpx.HTTPError as exc:
            raise self._translate(exc) from exc
        self._check(resp)
        return resp

    async def _get(self, path: str, timeout: float = 10.0) -> httpx.Response:
        try:
            resp = await self.http.get(self.base_url + path, timeout=timeout)
        except httpx.HTTPError as exc:
            raise self._translate(exc) from exc
        self._check(resp)
        return resp

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
        """Abort one request (SGLang 0.5.19 ``AbortReq``: ``rid``; the embedded engine speaks it too)."""
        await self._post("/abort_request", {"rid": request_id}, timeout=30.0)

    async def _abort_unless(self, done: bool, request_id: str) -> None:
        """Abort ``request_id`` on the engine when its reader stopped before the end (the agent went away,
        or the turn failed elsewhere).

        An engine aborts a request whose HTTP connection closes, but a cancelled reader does not reliably
        close it: Starlette cancels the gateway's turn inside a cancel scope that also cancels httpx's close
        of the engine connection, so the socket stayed open and the engine generated to ``max_tokens``
        (seen live with vLLM and SGLang). The abort is sent from its own task, which that cancellation does
        not reach."""
        if done:
            return
        task = asyncio.ensure_future(self._abort(request_id))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved even if nobody waits
        try:
            await asyncio.shield(task)
        except GatewayError as exc:  # the engine is gone or refuses: the error that ended the reader stands
            log.info("abort of %s on %s failed: %s", request_id, self.base_url, exc)

    async def _generate_fast(self, body: dict[str, Any]) -> bytes:
        assert self.fast is not None
        try:
            status, content = await self.fast.request(self.base_url + "/generate", "POST", jsonio.dumps(body),
                                                      timeout_s=self.timeout_s)
        except HTTPFailure as exc:
            raise self._translate(exc) from exc
        if status >= 400:
            raise self.error(status, error_text(content, f"HTTP {status}"))
        return content

    async def generate(self, input_ids: list[int], params: SamplingParams, max_new_tokens: int) -> EngineOutput:
        body = self._body(input_ids, params, max_new_tokens, False)
        done = False
        try:
            if self.fast is not None:
                content = await self._generate_fast(body)
            else:
                content = (await self._post("/generate", body)).content
            done = True
        except (InvalidRequest, EngineError):
            done = True  # the engine answered (with a refusal): nothing of the request runs there
            raise
        finally:
            await self._abort_unless(done, body["rid"])
        try:
            out = jsonio.loads(content)
        except ValueError as exc:
            raise EngineError(f"engine {self.base_url} answered /generate with a body that is not JSON") from exc
        return parse_output(out)

    async def generate_stream(
        self, input_ids: list[int], params: SamplingParams, max_new_tokens: int
    ) -> AsyncIterator[EngineOutput]:
        """Outputs as the engine streams them (SGLang's default, cumulative mode): each one holds the tokens
        from its ``start`` on, the earlier ones being those of the outputs before it."""
        body = self._body(input_ids, params, max_new_tokens, True)
        if self.fast is not None:
            async for out in self._stream_fast(body):
                yield out
            return
        done = False
        try:
            async with self.http.stream("POST", self.base_url + "/generate", json=body,
                                        timeout=self.timeout) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    done = True  # refused: nothing runs
                    self._check(resp)
                known = 0
                async for chunk in sse_json(resp, f"engine {self.base_url} sent a malformed stream chunk"):
                    if chunk is SSE_DONE:
                        done = True
                        return
                    if isinstance(chunk, dict) and "error" in chunk:
                        done = True  # SGLang's refusal once the stream began: the request is over
                        raise self._stream_error(chunk["error"])
                    out = parse_output(chunk, known)
                    known = out.start + len(out.output_ids)
                    done = out.finish is not None
                    yield out
        except httpx.HTTPError as exc:
            raise self._translate(exc) from exc
        finally:
            await self._abort_unless(done, body["rid"])

    async def _stream_fast(self, body: dict[str, Any]) -> AsyncIterator[EngineOutput]:
        """:meth:`generate_stream` through the lean client (the same outputs and errors)."""
        assert self.fast is not None
        done = False
        chunks = self.fast.stream(self.base_url + "/generate", jsonio.dumps(body), timeout_s=self.timeout_s)
        text = lines(chunks)
        events = sse_json(text, f"engine {self.base_url} sent a malformed stream chunk")
        try:
            status, _ = await chunks.__anext__()
            if status >= 400:
                content = b"".join([chunk async for _, chunk in chunks if chunk])
                done = True  # refused: nothing runs
                raise self.error(status, error_text(content, f"HTTP {status}"))
            known = 0
            async for chunk in events:
                if chunk is SSE_DONE:
                    done = True
                    await _drain(chunks)  # the response's end follows [DONE]: read it, so the connection is kept
                    return
                if isinstance(chunk, dict) and "error" in chunk:
                    done = True  # SGLang's refusal once the stream began: the request is over
                    raise self._stream_error(chunk["error"])
                out = parse_output(chunk, known)
                known = out.start + len(out.output_ids)
                done = out.finish is not None
                yield out
        except HTTPFailure as exc:
            raise self._translate(exc) from exc
        finally:
            await events.aclose()
            await text.aclose()
            await chunks.aclose()  # before its end: closes the connection, so the engine sees us go
            await self._abort_unless(done, body["rid"])

    async def health(self, *, paused: bool = False) -> bool | None:
        """Whether the engine serves: True, False (refused, an error status), or None when it did not answer
        within the probe's 5 s (alive but busy: loading weights, or a probe queued behind a long batch).
        SGLang's ``/health`` runs a one-token generation, which waits behind a pause
        (``SGLANG_HEALTH_CHECK_TIMEOUT``, 20 s, then 503); an engine the caller paused is probed for liveness
        with the model-info route instead (``/model_info``; ``/get_model_info`` on the embedded engine),
        which SGLang answers without its scheduler."""
        url = self.base_url + (self.dialect.model_info_route if paused else "/health")
        if self.fast is not None:  # its kept connections expire first, and one the engine drops is retried
            try:
                status, _ = await self.fast.request(url, "GET", timeout_s=5.0)
            except HTTPFailure as exc:
                return None if exc.kind == "timeout" else False
            return status == 200
        try:
            resp = await self.http.get(url, timeout=5.0)
        except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout):
            return None
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def model_info(self) -> dict[str, Any]:
        info: dict[str, Any] = (await self._get(self.dialect.model_info_route)).json()
        return info

    async def server_info(self) -> dict[str, Any]:
        """``/server_info`` (SGLang), else ``/get_server_info`` (the embedded engine); learns the dialect."""
        for route, modern in (("/server_info", True), ("/get_server_info", False)):
            try:
                resp = await self.http.get(self.base_url + route, timeout=10.0)
            except httpx.HTTPError as exc:
                raise self._translate(exc) from exc
            if resp.status_code == 404 and modern:
                continue
            self._check(resp)
            info: dict[str, Any] = resp.json()
            self.dialect = dialect_from(info, info_routes=modern)
            return info
        raise EngineError(f"engine {self.base_url} answers neither /server_info nor /get_server_info")

    async def describe(self) -> EngineInfo:
        from gateway.engines import EngineInfo

        try:
            server = await self.server_info()
            context = int(server.get("context_length") or server.get("max_req_input_len") or 0)
        except GatewayError:
            context = 0
        info = await self.model_info()
        return EngineInfo(model_path=info.get("model_path"), tokenizer_path=info.get("tokenizer_path"),
                          weight_version=_parse_version(info.get("weight_version")), context_length=context)

    async def weight_version(self) -> int | None:
        # the model-info route carries it (SGLang 0.5.19, 0.5.23, the embedded engine); /get_weight_version is
        # a 404 in 0.5.19 and gone in 0.5.23
        return _parse_version((await self.model_info()).get("weight_version"))

    async def pause(self, mode: str = "abort") -> None:
        await self._post("/pause_generation", {"mode": mode}, timeout=60.0)

    async def continue_generation(self) -> None:
        await self._post("/continue_generation", {}, timeout=60.0)

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        result: dict[str, Any] = (await self._post("/update_weights_from_disk", body)).json()
        return result


@dataclass(slots=True)
class EngineState:
    client: Engine
    healthy: bool = True
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    last_error: str | None = None
    last_check: float = 0.0
    last_output: float = 0.0  # time.monotonic() of the last engine output received for a generation
    busy: bool = False  # its last probe got no answer in time: alive but occupied (loading weights, a long batch)

    def as_json(self) -> dict[str, Any]:
        return {"url": self.client.base_url, "kind": self.client.kind, "healthy": self.healthy, "in_flight": self.in_flight,
                "served": self.served, "failures": self.failures, "last_error": self.last_error,
                "last_check": self.last_check}


class EngineRouter:
    """Routes generations over engines and holds them across pause/resume (see the module docstring)."""

    def __init__(self, clients: list[Engine], *, health_interval_s: float = 5.0,
                 affinity_size: int = 100_000, busy_wait_s: float = 60.0) -> None:
        if not clients:
            raise ValueError("EngineRouter needs at least one engine")
        self.engines = [EngineState(c) for c in clients]
        self.health_interval_s = health_interval_s
        # a failed probe of an engine that produced output for an in-flight request this recently is
        # not taken as down (see check_health)
        self.busy_window_s = health_interval_s + 10.0
        # how long a request waits for a busy engine (one whose probe timed out: loading weights, say) to
        # answer again when no engine is in rotation, before it gets 503
        self.busy_wait_s = busy_wait_s
        self._probe: asyncio.Task[None] | None = None  # the health check waiting requests share
        self._affinity: OrderedDict[str, int] = OrderedDict()
        self._affinity_size = affinity_size
        self._running = asyncio.Event()
        self._running.set()
        self._pause_epoch = 0
        self._pause_mode: str | None = None  # the mode of the pause in force (None while running)
        self._owes_continue: set[int] = set()  # engines paused by this router and not yet continued
        self.weight_version = 0
        self.held = 0  # generations waiting for resume
        self.version_mismatches = 0  # segments whose engine reported a different weight version
        # Asked before an unexplained abort is called an error: did another replica pause (control plane)?
        self.pause_check: Callable[[], Awaitable[bool]] | None = None
        self._health_task: asyncio.Task[None] | None = None

    # ---- lifecycle and health ----
    async def start(self) -> None:
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop(), name="engine-health")

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except asyncio.CancelledError:
                pass

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.check_health()

    async def check_health(self) -> None:
        """Probe every engine. An engine this router paused is probed for liveness only (SGLang's
        ``/health`` cannot answer behind a pause); one that still owes a ``continue_generation`` (resume
        could not reach it) gets it again first, once the router is no longer paused."""
        if not self.paused and self._owes_continue:
            await self._continue(sorted(self._owes_continue))
        pushing = {i for i in self._owes_continue if self.paused}
        results = await asyncio.gather(*(
            e.client.health(paused=i in pushing) for i, e in enumerate(self.engines)))
        now = time.monotonic()
        for i, (state, answer) in enumerate(zip(self.engines, results)):
            state.busy = answer is None
            ok = bool(answer)
            if answer is None and i in pushing and state.healthy:
                # paused by this router for a weight push: an engine loading weights may not answer even
                # its liveness route in time; it is not taken out of rotation for that (resume's
                # continue_generation tells whether it came back; a refused connection still counts)
                log.info("engine %s did not answer its liveness probe while paused (loading weights?): kept",
                         state.client.base_url)
                ok = True
            if not ok and state.healthy and state.in_flight and now - state.last_output < self.busy_window_s:
                # SGLang's /health is a generation queued behind the running batch: an engine busy with many
                # requests can miss the probe's 5 s while it is visibly producing output for us. Taking it
                # out of rotation for that turned load into 503s; a dead engine breaks its streams instead
                # (_mark_failed), and a hung one stops producing output and fails the next probe.
                log.info("engine %s missed a health probe while busy (%d in flight, output %.1f s ago): kept",
                         state.client.base_url, state.in_flight, now - state.last_output)
                ok = True
            if ok != state.healthy:
                log.warning("engine %s is now %s", state.client.base_url, "healthy" if ok else "unhealthy")
            state.healthy = ok
            state.last_check = time.time()
            if ok:
                state.last_error = None

    async def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            await self.check_health()
            if any(e.healthy for e in self.engines):
                return
            if time.monotonic() > deadline:
                raise EngineUnavailable(
                    f"no engine became healthy within {timeout_s:.0f}s: "
                    + ", ".join(e.client.base_url for e in self.engines))
            await asyncio.sleep(0.5)

    def healthy_engine(self) -> Engine:
        for state in self.engines:
            if state.healthy:
                return state.client
        raise EngineUnavailable("no healthy engine")

    def _mark_failed(self, state: EngineState, exc: Exception) -> None:
        state.failures += 1
        state.healthy = False
        state.last_error = str(exc)
        log.warning("engine %s taken out of rotation: %s", state.client.base_url, exc)

    # ---- routing ----
    def pick(self, affinity_key: str | None, exclude: set[int] | None = None) -> int:
        """Index of the engine for a request: the session's engine if healthy, else the least loaded."""
        exclude = exclude or set()
        if affinity_key is not None and affinity_key in self._affinity:
            index = self._affinity[affinity_key]
            if self.engines[index].healthy and index not in exclude:
                self._affinity.move_to_end(affinity_key)
                return index
        candidates = [i for i, e in enumerate(self.engines) if e.healthy and i not in exclude]
        if not candidates:
            raise EngineUnavailable(
                "no healthy engine to serve the request (checked: "
                + ", ".join(e.client.base_url for e in self.engines) + ")")
        index = min(candidates, key=lambda i: (self.engines[i].in_flight, self.engines[i].served))
        if affinity_key is not None:
            self._affinity[affinity_key] = index
            self._affinity.move_to_end(affinity_key)
            while len(self._affinity) > self._affinity_size:
                self._affinity.popitem(last=False)
        return index

    async def _pick_or_wait(self, affinity_key: str | None, exclude: set[int]) -> int:
        """:meth:`pick`; when no engine is in rotation but one is busy (alive, but its probe timed out: the
        only engine loading weights, say), the request waits for it, re-probing, up to ``busy_wait_s``.
        Engines that refused the connection are not waited for: 503 at once, as before."""
        try:
            return self.pick(affinity_key, exclude)
        except EngineUnavailable:
            if not any(e.busy for i, e in enumerate(self.engines) if i not in exclude):
                raise
        deadline = time.monotonic() + self.busy_wait_s
        while True:
            if self._probe is None or self._probe.done():
                self._probe = asyncio.create_task(self.check_health(), name="engine-probe")
            await asyncio.shield(self._probe)
            try:
                return self.pick(affinity_key, exclude)
            except EngineUnavailable:
                waiting = any(e.busy for i, e in enumerate(self.engines) if i not in exclude)
                if not waiting or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(min(0.5, self.health_interval_s))

    def cache_sizes(self) -> list[CacheSize]:
        """The session -> engine affinity map."""
        return [CacheSize("engine_affinity", len(self._affinity), len(self._affinity), self._affinity_size)]

    # ---- pause / resume ----
    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    async def pause(self, mode: str = "abort") -> None:
        """Stop generation on every engine; in-flight generations are aborted and held until resume.

        Every engine sent a pause owes a ``continue_generation``, whatever its health afterwards: SGLang
        stays paused until told otherwise. An engine that cannot be reached leaves the rotation; any other
        refusal (a bad ``mode``) is raised once every engine has been tried.

        An ``abort`` pause while this router holds the engines in an ``in_place`` or ``retract`` pause (an
        operator's, before a push) first continues them, so that the abort reaches their schedulers and
        empties them: a push flushes the prefix cache with the update, which SGLang accepts only from an
        idle scheduler (0.5.19 asserts and dies otherwise, 0.5.23 answers 400). Their requests end as
        aborted and are held and re-sent after resume, like every other."""
        if mode == "abort" and self.paused and self._pause_mode in ("in_place", "retract") and self._owes_continue:
            log.info("abort pause over a %s pause: continuing the engines first so that they empty",
                     self._pause_mode)
            await self._continue(sorted(self._owes_continue))
        self._pause_mode = mode
        self._pause_epoch += 1
        self._running.clear()
        targets = [i for i, e in enumerate(self.engines) if e.healthy]
        self._owes_continue.update(targets)
        results = await asyncio.gather(*(self.engines[i].client.pause(mode) for i in targets),
                                       return_exceptions=True)
        refused: BaseException | None = None
        for i, result in zip(targets, results):
            if isinstance(result, EngineUnavailable):
                self._mark_failed(self.engines[i], result)
            elif isinstance(result, BaseException) and refused is None:
                refused = result
        if refused is not None:
            raise refused

    async def resume(self, weight_version: int) -> None:
        """Set the weight version, let engines generate again, and re-send every held generation.

        ``continue_generation`` goes to every engine this router paused, healthy or not (a paused SGLang
        fails its health probe, so health cannot decide who to resume), and to every healthy one. An engine
        that cannot be reached keeps owing it; the health loop sends it again until it lands."""
        self.weight_version = weight_version
        self._pause_mode = None
        targets = sorted(self._owes_continue | {i for i, e in enumerate(self.engines) if e.healthy})
        self._owes_continue.update(targets)
        try:
            await self._continue(targets)
        finally:  # held generations go on even if a continue failed or this call was cancelled
            self._running.set()

    async def _continue(self, targets: list[int]) -> None:
        results = await asyncio.gather(*(self.engines[i].client.continue_generation() for i in targets),
                                       return_exceptions=True)
        for i, result in zip(targets, results):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result  # cancellation and friends
                self._mark_failed(self.engines[i], result)
            else:
                self._owes_continue.discard(i)
                state = self.engines[i]
                if not state.healthy:  # it answered: back in rotation now, not at the next probe
                    log.warning("engine %s is now healthy (generation continued)", state.client.base_url)
                state.healthy, state.busy, state.last_error = True, False, None

    # ---- generation ----
    async def generate(
        self, input_ids: list[int], params: SamplingParams, *, affinity_key: str | None, stream: bool
    ) -> AsyncIterator[Generation]:
        """Yield the cumulative :class:`Generation` as tokens arrive (once per segment without ``stream``).

        The last item has ``finish`` set. An abort caused by a pause (or an engine lost mid-generation
        while another is healthy) is invisible here: the partial output is kept and generation continues
        from prompt + partial output after resume, each segment's tokens tagged with its weight version.
        """
        gen = Generation()
        excluded: set[int] = set()
        while True:
            remaining = params.max_new_tokens - len(gen.output_ids)
            if remaining <= 0:
                gen.finish = "length"
                yield gen
                return
            if not self._running.is_set():
                self.held += 1
                try:
                    await self._running.wait()
                finally:
                    self.held -= 1
            epoch = self._pause_epoch
            index = await self._pick_or_wait(affinity_key, excluded)
            state = self.engines[index]
            gen.engine_url = state.client.base_url
            gen.segments += 1
            base = len(gen.output_ids)
            segment_version = self.weight_version
            segment_ids = input_ids + gen.output_ids if base else input_ids
            segment_params = params.continued(base)
            state.in_flight += 1
            last: EngineOutput | None = None
            try:
                if stream:
                    async for out in state.client.generate_stream(segment_ids, segment_params, remaining):
                        last = out
                        state.last_output = time.monotonic()
                        self._merge(gen, base, out, segment_version)
                        if out.finish is None or out.finish != "abort":
                            yield gen
                else:
                    last = await state.client.generate(segment_ids, segment_params, remaining)
                    state.last_output = time.monotonic()
                    self._merge(gen, base, last, segment_version)
            except EngineUnavailable as exc:
                self._mark_failed(state, exc)
                excluded.add(index)
                if not any(e.healthy for i, e in enumerate(self.engines) if i not in excluded):
                    raise
                _restart_constrained(gen, params, stream)
                continue  # another engine continues from prompt + partial output
            finally:
                state.in_flight -= 1
                state.served += 1
            if last is None:
                raise EngineError(f"engine {state.client.base_url} closed the stream without output")
            if last.finish == "abort":
                if last.abort_status is not None:  # a refusal (SGLang streams it as an abort chunk)
                    raise engine_error(state.client.base_url, last.abort_status, last.abort_message or "aborted")
                if self.paused or self._pause_epoch != epoch or (
                        self.pause_check is not None and await self.pause_check()):
                    _restart_constrained(gen, params, stream)
                    continue  # held: resent after resume
                raise EngineError(f"engine {state.client.base_url} aborted the generation")
            if last.finish not in ("stop", "length"):
                raise EngineError(f"engine {state.client.base_url} ended with finish_reason {last.finish!r}")
            gen.finish = last.finish
            gen.matched = last.matched
            if not stream:
                yield gen
            return

    def _merge(self, gen: Generation, base: int, out: EngineOutput, version: int) -> None:
        # A segment's tokens carry the weight version the engine reports for it (SGLang and the embedded
        # engine report the version their weights were pushed with): that is what sampled them, whatever
        # this replica was told. An engine that reports none (SGLang's "default") gets the gateway's
        # version at the time the segment was sent (set on resume after a push). Disagreements are counted.
        # A finished segment's per-token versions (``weight_versions`` spans) win: a request an engine held
        # across a push (retract / in_place pause without the gateway) has tokens of both versions.
        if out.weight_version is not None and out.weight_version != version:
            self.version_mismatches += 1
            version = out.weight_version
        # ``out`` starts at output position ``out.start`` of this segment (its earlier tokens are merged)
        keep = base + out.start
        del gen.output_ids[keep:], gen.logprobs[keep:], gen.versions[keep:], gen.top_logprobs[keep:]
        gen.output_ids.extend(out.output_ids)
        gen.logprobs.extend(out.logprobs)
        gen.versions.extend(out.versions if out.versions is not None else [version] * len(out.output_ids))
        if out.top_logprobs is not None:
            gen.top_logprobs.extend(out.top_logprobs)


def _restart_constrained(gen: Generation, params: SamplingParams, stream: bool) -> None:
    """A grammar-constrained generation cannot continue from prompt + partial output (the engine would start
    the grammar over inside the output): without streaming its partial output is dropped and it starts over
    (all of it then sampled under the new weights); a stream whose tokens were already sent fails."""
    if not params.grammar or not gen.output_ids:
        return
    if stream:
        raise EngineError("a grammar-constrained stream was interrupted (weight update or engine lost) after "
                          "it had sent tokens and cannot continue under its grammar; retry the request")
    del gen.output_ids[:], gen.logprobs[:], gen.versions[:], gen.top_logprobs[:]
