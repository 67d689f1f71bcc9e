"""What every engine kind's client shares: the wire types, the :class:`Engine` protocol, error mapping, SSE.

Everything above this seam (recording, stitching, versions, pause/resume with held requests, health and
routing in ``gateway.engine_client.EngineRouter``) speaks :class:`Engine` only; one module per kind
implements it (``engines.sglang``, ``engines.vllm``).

**Errors.** A client turns what its engine answers into errors of four meanings: the engine cannot be
reached (:meth:`EngineErrors.unavailable`), it refuses the request (``rejected``; ``too_long`` when the prompt
exceeds its context), or it fails otherwise (``failed``). Which exception classes carry them is the caller's
choice, given to the client as an :class:`EngineErrors`: the gateway passes its own OpenAI-shaped errors
(``gateway.engines.GATEWAY_ERRORS``); :data:`PLAIN_ERRORS` (the default) raises this module's
:class:`EngineCallError` family. So this package imports neither the gateway nor the trainer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import orjson

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SamplingParams:
    """What the gateway asks of one generation (each kind converts it to its engine's sampling fields)."""

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
        """SGLang's ``sampling_params`` (the native names; ``engines.vllm`` maps them to vLLM's)."""
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
    """The cumulative state of one generation call (SGLang streams cumulative chunks by default)."""

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
    # chunks before it held, so per chunk the work is its new tokens
    start: int = 0


@dataclass(slots=True)
class EngineInfo:
    """What the gateway learns from an engine at start-up."""

    model_path: str | None  # the served model directory (tokenizer and chat template come from here)
    tokenizer_path: str | None
    weight_version: int | None  # None: the engine has no integer version yet ("default", unset)
    context_length: int  # 0 = unknown


@runtime_checkable
class Engine(Protocol):
    """One engine at ``base_url``. Errors are those of the :class:`EngineErrors` the client was given."""

    kind: str
    base_url: str

    async def generate(self, input_ids: list[int], params: SamplingParams, max_new_tokens: int) -> EngineOutput:
        """The whole generation (``finish`` set; ``"abort"`` when a pause aborted it)."""
        ...

    def generate_stream(
        self, input_ids: list[int], params: SamplingParams, max_new_tokens: int
    ) -> AsyncIterator[EngineOutput]:
        """Cumulative outputs as tokens arrive; the last one has ``finish`` set."""
        ...

    async def health(self, *, paused: bool = False) -> bool | None:
        """True when the engine serves, False when it refuses or fails, None when it does not answer within
        the probe's timeout (alive but busy: the router waits for such an engine instead of refusing
        requests). ``paused``: the caller paused it, so only liveness is probed (SGLang's ``/health``
        generates a token and would wait behind the pause)."""
        ...

    async def describe(self) -> EngineInfo: ...

    async def weight_version(self) -> int | None: ...

    async def pause(self, mode: str = "abort") -> None:
        """Stop generating. ``abort``: in-flight requests end with finish ``abort`` (the router re-sends
        them after resume); ``in_place``/``retract``: they wait inside the engine."""
        ...

    async def continue_generation(self) -> None: ...

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> object:
        """Load new weights from a Hugging Face directory and tag later tokens with ``weight_version``."""
        ...


# ------------------------------------------------------------------------------------------ errors


class EngineErrors(Protocol):
    """The exceptions a client raises, one per meaning (see the module docstring)."""

    def unavailable(self, message: str) -> Exception: ...
    def rejected(self, message: str) -> Exception: ...
    def too_long(self, message: str) -> Exception: ...
    def failed(self, message: str) -> Exception: ...


class EngineCallError(Exception):
    """An engine call that did not give what was asked (:data:`PLAIN_ERRORS`)."""


class EngineUnreachable(EngineCallError):
    pass


class EngineRejected(EngineCallError):
    pass


class EnginePromptTooLong(EngineRejected):
    pass


class EngineFailed(EngineCallError):
    pass


class _Plain:
    def unavailable(self, message: str) -> Exception:
        return EngineUnreachable(message)

    def rejected(self, message: str) -> Exception:
        return EngineRejected(message)

    def too_long(self, message: str) -> Exception:
        return EnginePromptTooLong(message)

    def failed(self, message: str) -> Exception:
        return EngineFailed(message)


PLAIN_ERRORS: EngineErrors = _Plain()


def engine_error(errors: EngineErrors, base_url: str, status: int, message: str) -> Exception:
    """The error for an engine answer of this HTTP status (a response, an error event, or an abort chunk's
    ``status_code``)."""
    if status == 400:
        if "context" in message.lower() or "too long" in message.lower():
            return errors.too_long(f"the engine rejected the prompt: {message}")
        return errors.rejected(f"the engine rejected the request: {message}")
    if status == 503:
        return errors.unavailable(f"engine {base_url} unavailable: {message}")
    return errors.failed(f"engine {base_url} answered {status}: {message}")


def stream_error(errors: EngineErrors, base_url: str, err: object) -> Exception:
    """An error event inside a stream (SGLang: a request it refuses once the stream has begun, e.g. a prompt
    longer than the context; vLLM: its ``ErrorResponse``). It carries no status, or ``code``; without one it
    is the refusal a non-streamed request gets as a 400."""
    if not isinstance(err, dict):
        return engine_error(errors, base_url, 400, str(err))
    code = err.get("code")
    status = code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600 else 400
    return engine_error(errors, base_url, status, str(err.get("message", err)))


def error_text(content: bytes, reason: str = "") -> str:
    """The message of an engine's error response body (JSON ``error.message`` / ``message``, else text)."""
    try:
        body = orjson.loads(content)
    except ValueError:
        return content.decode("utf-8", "replace")[:500] or reason
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)[:500]


# ------------------------------------------------------------------------------------------ payloads


def parse_version(raw: object) -> int | None:
    """An engine's weight version (a string on the wire) as an integer; None for SGLang's ``"default"``."""
    try:
        return int(str(raw))
    except (TypeError, ValueError):
        return None


def span_versions(spans: object, n: int) -> list[int] | None:
    """Per-token versions from ``weight_versions`` spans ``[{"version", "start", "end"}, ...]`` (SGLang 0.5.19
    ``utils/weight_versions.py``; vLLM 0.32 the same shape) over ``n`` output tokens; None when absent, when
    a version is not an integer (``"default"``) or when the spans do not cover the tokens exactly."""
    if not isinstance(spans, list) or not spans:
        return None
    out: list[int] = []
    for span in spans:
        version = parse_version(span.get("version")) if isinstance(span, dict) else None
        start, end = (span.get("start"), span.get("end")) if isinstance(span, dict) else (None, None)
        if version is None or start != len(out) or not isinstance(end, int) or end < start:
            return None
        out.extend([version] * (end - start))
    return out if len(out) == n else None


def dumps(body: Any) -> bytes:
    """Compact UTF-8 JSON of a request body (``json``'s output where orjson refuses: integers beyond 64 bits)."""
    try:
        return orjson.dumps(body)
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def loads(content: bytes | str) -> Any:
    return orjson.loads(content)


async def abort_unless(done: bool, abort: Any, request_id: str, base_url: str) -> None:
    """Abort ``request_id`` on the engine (``abort``: the kind's abort call) when its reader stopped before
    the end (the agent went away, or the turn failed elsewhere).

    An engine aborts a request whose HTTP connection closes, but a cancelled reader does not reliably close
    it: Starlette cancels the gateway's turn inside a cancel scope that also cancels httpx's close of the
    engine connection, so the socket stayed open and the engine generated to ``max_tokens`` (seen live with
    vLLM and SGLang). The abort is sent from its own task, which that cancellation does not reach."""
    if done:
        return
    task = asyncio.ensure_future(abort(request_id))
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved even if nobody waits
    try:
        await asyncio.shield(task)
    except Exception as exc:  # noqa: BLE001 - the engine is gone or refuses: the error that ended the reader stands
        log.info("abort of %s on %s failed: %s", request_id, base_url, exc)


SSE_DONE = object()  # what :func:`sse_json` yields for the stream's ``data: [DONE]`` line


async def sse_json(lines: AsyncIterator[str], malformed: Exception) -> AsyncIterator[Any]:
    """The JSON payloads of an engine's SSE stream (its text lines), then :data:`SSE_DONE` if the engine
    ended it with ``[DONE]``; a payload that is not JSON raises ``malformed``."""
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            yield SSE_DONE
            return
        try:
            yield orjson.loads(data)
        except ValueError as exc:
            raise malformed from exc
