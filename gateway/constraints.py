"""Request fields that constrain what the model may sample, and the refusal of those not enforced.

An agent that asks for JSON (``response_format``), a forced tool call (``tool_choice: "required"`` or a
named function), one tool call per turn (``parallel_tool_calls: false``) or a penalised distribution
(``presence_penalty``, ``frequency_penalty``, ``logit_bias``, and the vLLM/SGLang extensions
``repetition_penalty``, ``min_tokens``) relies on the server *enforcing* it; a gateway that accepts such a
field and samples without it hands the agent free text and the trainer a distribution nobody asked for.
So every such field at a non-default value that the gateway does not enforce yet is refused here with a
400 naming the field (``param``), before anything is planned or recorded.

The check runs on the conversation core's request (:class:`~gateway.wire.ChatCompletionRequest` or
:class:`~gateway.wire.CompletionRequest`); the Responses and Messages formats call it with ``names`` that
map the core's field names back onto their own wire names (``text.format``, ``tool_choice.type``), so the
error points at what their client sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.errors import InvalidRequest
from gateway.wire import ChatCompletionRequest, CompletionRequest

_NOT_YET = "is not enforced by this gateway yet, and it refuses rather than silently ignoring it"


def _refuse(field: str, what: str, hint: str, names: Mapping[str, str]) -> InvalidRequest:
    param = names.get(field, field)
    return InvalidRequest(f"{param}: {what} {_NOT_YET}; {hint}", param=param, code="unsupported_parameter")


def _extra(req: ChatCompletionRequest | CompletionRequest, name: str) -> Any:
    return (req.model_extra or {}).get(name)


def refuse_unenforced(req: ChatCompletionRequest | CompletionRequest,
                      names: Mapping[str, str] | None = None) -> None:
    """Raise :class:`InvalidRequest` (400, ``param`` set) for the first constraint the gateway would not
    enforce. ``names`` maps core field names to the caller's wire names for the error."""
    names = names or {}
    if req.presence_penalty:
        raise _refuse("presence_penalty", f"presence_penalty={req.presence_penalty}",
                      "leave it unset or 0", names)
    if req.frequency_penalty:
        raise _refuse("frequency_penalty", f"frequency_penalty={req.frequency_penalty}",
                      "leave it unset or 0", names)
    if req.logit_bias:
        raise _refuse("logit_bias", "logit_bias", "leave it unset or empty", names)
    repetition = _extra(req, "repetition_penalty")
    if repetition is not None and repetition != 1:
        raise _refuse("repetition_penalty", f"repetition_penalty={repetition!r}", "leave it unset or 1", names)
    min_tokens = _extra(req, "min_tokens")
    if min_tokens is not None and min_tokens != 0:
        raise _refuse("min_tokens", f"min_tokens={min_tokens!r}", "leave it unset or 0", names)
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
    if req.tools and req.parallel_tool_calls is False:
        raise _refuse("parallel_tool_calls", "parallel_tool_calls=false (at most one tool call)",
                      "leave it unset or true and use the first tool call", names)
