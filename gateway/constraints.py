"""Request fields that constrain what the model may sample, and the refusal of those not enforced.

An agent that asks for JSON (``response_format``), a forced tool call (``tool_choice: "required"`` or a
named function) relies on the server *enforcing* it; a gateway that accepts such a field and samples without it hands the agent free text and
the trainer a distribution nobody asked for. So every such field at a non-default value that the gateway
does not enforce yet is refused here with a 400 naming the field (``param``), before anything is planned
or recorded.

One exception, on purpose: ``parallel_tool_calls: false`` (Messages: ``disable_parallel_tool_use``) is
accepted and not enforced, because Codex-style clients send it on every request and refusing it would refuse
those agents outright. The model may then return more than one call; the turn records exactly what was
sampled (the request, with the flag, is stored with it), so training stays on the sampled distribution.

Penalties are enforced: ``presence_penalty``, ``frequency_penalty``, ``logit_bias`` and the vLLM
extensions ``repetition_penalty``, ``min_tokens`` are sent as SGLang's own ``sampling_params``
(:func:`penalties`; the embedded engine implements them as SGLang does, ``engine/sampling.py``) and
recorded with the turn under their OpenAI names (:func:`penalties_json`).

The check runs on the conversation core's request (:class:`~gateway.wire.ChatCompletionRequest` or
:class:`~gateway.wire.CompletionRequest`); the Responses and Messages formats call it with ``names`` that
map the core's field names back onto their own wire names (``text.format``, ``tool_choice.type``), so the
error points at what their client sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.errors import InvalidRequest
from gateway.wire import ChatCompletionRequest, CompletionRequest, SamplingFields

_NOT_YET = "is not enforced by this gateway yet, and it refuses rather than silently ignoring it"


def _refuse(field: str, what: str, hint: str, names: Mapping[str, str]) -> InvalidRequest:
    param = names.get(field, field)
    return InvalidRequest(f"{param}: {what} {_NOT_YET}; {hint}", param=param, code="unsupported_parameter")


def _extra(req: SamplingFields, name: str) -> Any:
    return (req.model_extra or {}).get(name)


def penalties_json(req: SamplingFields, names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The penalties a request asks for, under their OpenAI names, non-default ones only: recorded with
    the turn (its ``params``) so that export and trainer can tell the turn was sampled under them.
    ``repetition_penalty`` (in (0, 2]) and ``min_tokens`` (>= 0) are vLLM's extension names."""
    names = names or {}
    out: dict[str, Any] = {}
    if req.presence_penalty:
        out["presence_penalty"] = req.presence_penalty
    if req.frequency_penalty:
        out["frequency_penalty"] = req.frequency_penalty
    if req.logit_bias:
        out["logit_bias"] = dict(req.logit_bias)
    repetition = _extra(req, "repetition_penalty")
    if repetition is not None:
        if isinstance(repetition, bool) or not isinstance(repetition, (int, float)) or not 0 < repetition <= 2:
            param = names.get("repetition_penalty", "repetition_penalty")
            raise InvalidRequest(f"{param} must be a number in (0, 2], got {repetition!r}", param=param)
        if repetition != 1:
            out["repetition_penalty"] = float(repetition)
    min_tokens = _extra(req, "min_tokens")
    if min_tokens is not None:
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            param = names.get("min_tokens", "min_tokens")
            raise InvalidRequest(f"{param} must be an integer >= 0, got {min_tokens!r}", param=param)
        if min_tokens:
            out["min_tokens"] = min_tokens
    return out


_SGLANG_NAMES = {"min_tokens": "min_new_tokens"}  # the rest are SGLang's names too (SamplingParams, 0.5.19)


def penalties(req: SamplingFields) -> dict[str, Any]:
    """The request's penalties as SGLang ``sampling_params`` (which the embedded engine implements too)."""
    return {_SGLANG_NAMES.get(k, k): v for k, v in penalties_json(req).items()}


def refuse_unenforced(req: ChatCompletionRequest | CompletionRequest,
                      names: Mapping[str, str] | None = None) -> None:
    """Raise :class:`InvalidRequest` (400, ``param`` set) for the first constraint the gateway would not
    enforce. ``names`` maps core field names to the caller's wire names for the error."""
    names = names or {}
    penalties_json(req, names)  # validates the extensions' values
    if isinstance(req, CompletionRequest):
        if req.best_of is not None and req.best_of != req.n:
            raise _refuse("best_of", f"best_of={req.best_of}", "leave it unset (n choices are all returned)",
                          names)
        if req.suffix:
            raise _refuse("suffix", "suffix (insertion)", "leave it unset", names)
        return
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, Mapping) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise InvalidRequest("response_format.type must be 'text', 'json_object' or 'json_schema'",
                                 param=names.get("response_format.type", "response_format.type"))
        if kind != "text":
            raise _refuse("response_format", f"response_format {kind!r} (constrained decoding)",
                          "ask for JSON in the prompt and parse it yourself, or leave it unset", names)
    if req.tools and req.tool_choice == "required":
        raise _refuse("tool_choice", "tool_choice 'required' (a forced tool call)",
                      "use 'auto' and check the reply for tool_calls", names)
    if req.tools and isinstance(req.tool_choice, Mapping):
        raise _refuse("tool_choice", "a named tool_choice (a forced call of one function)",
                      "use 'auto' and check the reply for tool_calls", names)
