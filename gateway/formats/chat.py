"""OpenAI chat completions and text completions as wire formats over the conversation core.

The request bodies are already the core's model (``ChatCompletionRequest``, ``CompletionRequest``), so this
module only renders: a finished turn as a ``chat.completion`` / ``text_completion`` object, and the core's
stream events (``TurnEvent``) as ``data:`` chunks ending in ``data: [DONE]``. The final chunk of every
choice (``finish_reason``) is sent only once all choices are recorded; an error after the stream started
is sent as an OpenAI error body, then ``[DONE]``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from gateway.decoding import ChoiceResult, StreamDelta, logprobs_json
from gateway.engine_client import Generation
from gateway.errors import GatewayError, error_body
from gateway.formats.contract import CoreRequest
from gateway.jsonio import dumps
from gateway.service import ChoiceRun, TurnEvent, TurnPlan
from gateway.wire import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("agentrl.gateway.formats.chat")

Piece = dict[str, Any]


def _usage(plan: TurnPlan, runs: list[ChoiceRun]) -> dict[str, int]:
    completion = sum(len(r.result.output_ids) for r in runs if r.result)
    return {"prompt_tokens": len(plan.prompt), "completion_tokens": completion,
            "total_tokens": len(plan.prompt) + completion}


def _finish(run: ChoiceRun) -> str | None:
    return run.result.finish_reason if run.result else None


async def _chunks(plan: TurnPlan, runs: list[ChoiceRun], events: AsyncIterator[TurnEvent],
                  chunk: Callable[..., bytes], include_usage: bool, opening: Callable[[ChoiceRun], Piece] | None,
                  render: Callable[[ChoiceRun, StreamDelta, Generation], Piece | None],
                  closing: Callable[[ChoiceRun], Piece]) -> AsyncIterator[bytes]:
    """SSE chunks of a turn's events, shared by chat and text completions."""
    try:
        if opening is not None:
            for run in runs:
                yield chunk([opening(run)])
        async for event in events:
            if event.kind == "recorded":
                break
            assert event.run is not None and event.delta is not None and event.gen is not None
            payload = render(event.run, event.delta, event.gen)
            if payload is not None:
                yield chunk([payload])
        for run in runs:
            yield chunk([closing(run)])
        if include_usage:
            yield chunk([], _usage(plan, runs), last=True)
        yield b"data: [DONE]\n\n"
    except GatewayError as exc:
        _, body = error_body(exc)
        log.warning("stream ended with an error, nothing recorded: %s", exc.message)
        yield b"data: " + dumps(body) + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def _chunker(obj: str, first_id: str, model: str, include_usage: bool, extra: Piece) -> Callable[..., bytes]:
    created = int(time.time())

    def chunk(choices: list[Piece], usage: dict[str, Any] | None = None, last: bool = False) -> bytes:
        body: Piece = {"id": first_id, "object": obj, "created": created, "model": model, **extra,
                       "choices": choices}
        if include_usage:
            body["usage"] = usage if last else None
        return b"data: " + dumps(body) + b"\n\n"
    return chunk


# ------------------------------------------------------------------------------------------ chat


def _chat_logprobs(tokenizer: Any, req: ChatCompletionRequest, res: ChoiceResult) -> Piece | None:
    if not req.logprobs:
        return None
    n = res.visible
    return {"content": logprobs_json(tokenizer, res.output_ids[:n], res.logprobs[:n], res.top_logprobs,
                                     req.top_logprobs or 0)}


def chat_response(req: ChatCompletionRequest, plan: TurnPlan, runs: list[ChoiceRun], model: str,
                  tokenizer: Any) -> Piece:
    choices = []
    for run in runs:
        res = run.result
        assert res is not None
        choices.append({"index": run.index, "message": res.message(), "logprobs": _chat_logprobs(tokenizer, req, res),
                        "finish_reason": res.finish_reason, "response_id": run.id})
    return {"id": runs[0].id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "system_fingerprint": None, "usage": _usage(plan, runs)}


def chat_chunks(req: ChatCompletionRequest, plan: TurnPlan, runs: list[ChoiceRun], events: AsyncIterator[TurnEvent],
                model: str, tokenizer: Any) -> AsyncIterator[bytes]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def delta_choice(run: ChoiceRun, delta: StreamDelta, gen: Generation) -> Piece | None:
        if not delta:
            return None
        out: Piece = {}
        if delta.content:
            out["content"] = delta.content
        if delta.tool_calls:
            out["tool_calls"] = [{"index": i, **call} for i, call in delta.tool_calls]
        logprobs = None
        if req.logprobs and delta.token_end > delta.token_start:
            s, e = delta.token_start, delta.token_end
            logprobs = {"content": logprobs_json(tokenizer, gen.output_ids[s:e], gen.logprobs[s:e],
                                                 gen.top_logprobs[s:e], req.top_logprobs or 0)}
        if not out and logprobs is None:
            return None
        return {"index": run.index, "delta": out, "logprobs": logprobs, "finish_reason": None, "response_id": run.id}

    return _chunks(plan, runs, events,
                   _chunker("chat.completion.chunk", runs[0].id, model, include_usage, {"system_fingerprint": None}),
                   include_usage,
                   lambda run: {"index": run.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None, "response_id": run.id},
                   delta_choice,
                   lambda run: {"index": run.index, "delta": {}, "logprobs": None, "finish_reason": _finish(run),
                                "response_id": run.id})


# ------------------------------------------------------------------------------------------ completions


def _completion_logprobs(tokenizer: Any, req: CompletionRequest, res: ChoiceResult) -> Piece | None:
    if req.logprobs is None:
        return None
    n = res.visible
    return _legacy_logprobs(tokenizer, req, res.output_ids[:n], res.logprobs[:n], res.top_logprobs)


def _legacy_logprobs(tokenizer: Any, req: CompletionRequest, ids: list[int], logprobs: list[float],
                     tops: list[list[tuple[int, float]]] | None) -> Piece:
    """The legacy ``logprobs`` object (``openai.types.completion_choice.Logprobs``) of some output tokens."""
    entries = logprobs_json(tokenizer, ids, logprobs, tops or [], req.logprobs or 0)
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries]
            if req.logprobs else None,
            "text_offset": None}


def completion_response(req: CompletionRequest, plan: TurnPlan, runs: list[ChoiceRun], model: str,
                        tokenizer: Any) -> Piece:
    choices = []
    for run in runs:
        res = run.result
        assert res is not None
        choices.append({"index": run.index, "text": res.text, "finish_reason": res.finish_reason,
                        "logprobs": _completion_logprobs(tokenizer, req, res), "response_id": run.id})
    return {"id": runs[0].id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": _usage(plan, runs)}


def completion_chunks(req: CompletionRequest, plan: TurnPlan, runs: list[ChoiceRun],
                      events: AsyncIterator[TurnEvent], model: str, tokenizer: Any) -> AsyncIterator[bytes]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def delta_choice(run: ChoiceRun, delta: StreamDelta, gen: Generation) -> Piece | None:
        logprobs = None
        if req.logprobs is not None and delta.token_end > delta.token_start:
            s, e = delta.token_start, delta.token_end
            logprobs = _legacy_logprobs(tokenizer, req, gen.output_ids[s:e], gen.logprobs[s:e],
                                        gen.top_logprobs[s:e])
        if not delta.content and logprobs is None:
            return None
        return {"index": run.index, "text": delta.content, "logprobs": logprobs, "finish_reason": None,
                "response_id": run.id}

    return _chunks(plan, runs, events, _chunker("text_completion", runs[0].id, model, include_usage, {}),
                   include_usage, None, delta_choice,
                   lambda run: {"index": run.index, "text": "", "logprobs": None, "finish_reason": _finish(run),
                                "response_id": run.id})


# ------------------------------------------------------------------------------ the chat wire format


class ChatFormat:
    """Chat completions as a :class:`gateway.formats.contract.WireFormat`: the request is the core's own."""

    name = "chat"
    request_model = ChatCompletionRequest
    id_prefix = "chatcmpl"

    def error_body(self, exc: GatewayError) -> tuple[int, dict[str, Any]]:
        return error_body(exc)

    async def to_core(self, svc: Any, who: Any, req: ChatCompletionRequest) -> CoreRequest[ChatCompletionRequest]:
        return CoreRequest(wire=req, core=req, meta={})  # recorded as sent: nothing to note about the format

    def render(self, turn: CoreRequest[Any], plan: TurnPlan, runs: list[ChoiceRun], svc: Any) -> Piece:
        return chat_response(turn.core, plan, runs, svc.model_name, svc.tokenizer)

    def stream(self, turn: CoreRequest[Any], plan: TurnPlan, runs: list[ChoiceRun], events: AsyncIterator[TurnEvent],
               svc: Any) -> AsyncIterator[bytes]:
        return chat_chunks(turn.core, plan, runs, events, svc.model_name, svc.tokenizer)


CHAT = ChatFormat()
