"""Anthropic's Messages API (``POST /v1/messages``) as a wire format over the conversation core.

Shapes follow the installed ``anthropic`` package's ``anthropic/types`` (``MessageCreateParams``, ``Message``,
``TextBlock``, ``ToolUseBlock``, ``ThinkingBlock``, the ``Raw*Event`` stream events, ``ErrorResponse``).

Parsing (:func:`to_conversation`): ``system`` (a string or text blocks; ``cache_control`` ignored) becomes
the leading system message; each message becomes chat messages:

- a user message's ``text`` blocks -> a user message (consecutive blocks joined); each ``tool_result``
  block -> a ``tool`` message answering ``tool_use_id`` (content a string or text blocks; ``is_error`` is
  accepted, the model sees the tool's text as is); ``image`` / ``document`` blocks -> 400 (text-only models);
- an assistant message's ``text`` blocks -> its content, ``tool_use`` blocks -> its ``tool_calls`` (id kept,
  ``input`` as JSON arguments); a ``thinking`` block this gateway returned (signature ``agentrl``) -> the
  ``<think>...</think>`` text the model wrote, so the message is again exactly what was recorded; other
  ``thinking`` / ``redacted_thinking`` blocks (another model's) are kept out of the prompt and listed in the
  recorded request's ``dropped``;
- a ``role: "system"`` message inside ``messages`` -> a system message at that position.

Rendering: a returned assistant message becomes ``content`` blocks: the model's leading
``<think>...</think>`` as a ``thinking`` block (exactly invertible, see :func:`split_thinking`), its text as
a ``text`` block, each tool call as a ``tool_use`` block; ``stop_reason`` ``end_turn`` / ``max_tokens`` /
``stop_sequence`` (with ``stop_sequence``) / ``tool_use``. :class:`MessageStream` renders the core's events
as ``message_start``, ``ping``, ``content_block_start`` / ``_delta`` (``text_delta``, ``thinking_delta``,
``input_json_delta``) / ``_stop``, ``message_delta`` and ``message_stop``; a failure after the start ends the
stream with an ``error`` event.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, StrictBool, StrictInt, ValidationError

from gateway.constraints import refuse_unenforced
from gateway.decoding import ChoiceResult, StreamDelta
from gateway.errors import GatewayError, InvalidRequest, anthropic_error_body, from_validation_error
from gateway.formats.common import sse, unsupported_tool
from gateway.formats.contract import CoreRequest
from gateway.service import ChoiceRun, TurnEvent
from gateway.wire import ChatCompletionRequest, WireModel

log = logging.getLogger("agentrl.gateway.formats.messages")

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SIGNATURE = "agentrl"  # a thinking block this gateway returned, closed by </think>
SIGNATURE_OPEN = "agentrl-unclosed"  # ... that the model never closed (cut by max_tokens)
_ROLES = ("user", "assistant", "system")


class MessagesRequest(WireModel):
    """``MessageCreateParams``: the fields the gateway reads; everything else is accepted and logged."""

    model: str | None = None
    max_tokens: StrictInt = Field(ge=1)
    messages: list[Any] = Field(min_length=1)
    system: Any = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt | None = Field(default=None, ge=0)
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


class CountTokensRequest(WireModel):
    """``MessageCountTokensParams``."""

    model: str | None = None
    messages: list[Any] = Field(min_length=1)
    system: Any = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: Any
    parallel_tool_calls: bool | None
    dropped: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------- parsing


def _text_blocks(content: object, param: str, what: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{what} must be a string or a list of text blocks", param=param, code="invalid_type")
    out = []
    for j, block in enumerate(content):
        if not isinstance(block, Mapping) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, Mapping) else None
            raise InvalidRequest(f"block type {kind!r} is not supported here (text only; this gateway serves "
                                 "text-only models)", param=f"{param}[{j}].type")
        if not isinstance(block.get("text"), str):
            raise InvalidRequest("a text block needs a string 'text'", param=f"{param}[{j}].text", code="invalid_type")
        out.append(block["text"])
    return "".join(out)


def _user(content: object, param: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise InvalidRequest("content must be a string or a list of blocks", param=param, code="invalid_type")
    out: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        bp = f"{param}[{j}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            text = _text_blocks([block], param, "content")
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += text
            else:
                out.append({"role": "user", "content": text})
        elif kind == "tool_result":
            assert isinstance(block, Mapping)
            tool_id = block.get("tool_use_id")
            if not isinstance(tool_id, str) or not tool_id:
                raise InvalidRequest("a tool_result block needs a tool_use_id", param=f"{bp}.tool_use_id",
                                     code="missing_required_parameter")
            result = block.get("content", "")
            out.append({"role": "tool", "tool_call_id": tool_id,
                        "content": _text_blocks(result, f"{bp}.content", "tool_result content")})
        else:
            raise InvalidRequest(
                f"content block type {kind!r} is not supported in a user message (supported: text, "
                "tool_result; this gateway serves text-only models)", param=f"{bp}.type")
    return out


def _assistant(content: object, param: str, dropped: list[str]) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise InvalidRequest("content must be a string or a list of blocks", param=param, code="invalid_type")
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        bp = f"{param}[{j}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        assert isinstance(block, Mapping) or kind is None
        if kind == "text":
            text.append(_text_blocks([block], param, "content"))
        elif kind == "tool_use":
            assert isinstance(block, Mapping)
            for key in ("id", "name"):
                if not isinstance(block.get(key), str) or not block[key]:
                    raise InvalidRequest(f"a tool_use block needs a string {key!r}", param=f"{bp}.{key}",
                                         code="missing_required_parameter")
            if not isinstance(block.get("input"), Mapping):
                raise InvalidRequest("a tool_use block needs an object 'input'", param=f"{bp}.input",
                                     code="invalid_type")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        elif kind == "thinking" and isinstance(block, Mapping) and block.get("signature") in (SIGNATURE, SIGNATURE_OPEN):
            close = THINK_CLOSE if block["signature"] == SIGNATURE else ""
            text.append(THINK_OPEN + str(block.get("thinking", "")) + close)
        elif kind in ("thinking", "redacted_thinking"):
            dropped.append(f"{bp}: {kind} block (not model output of this gateway)")
        else:
            raise InvalidRequest(f"content block type {kind!r} is not supported in an assistant message "
                                 "(supported: text, tool_use, thinking, redacted_thinking)", param=f"{bp}.type")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def convert_tools(tools: list[Any] | None, reject_unsupported: bool, dropped: list[str]) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise InvalidRequest("a tool must be an object", param=param, code="invalid_type")
        if tool.get("type") not in (None, "custom") or "input_schema" not in tool:
            unsupported_tool(tool.get("type"), param, reject_unsupported, dropped)
            continue
        fn: dict[str, Any] = {"name": tool.get("name")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        fn["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": fn})
    return out or None


def convert_tool_choice(choice: Mapping[str, Any] | None) -> tuple[object, bool | None]:
    """Anthropic ``tool_choice`` -> (chat ``tool_choice``, ``parallel_tool_calls``)."""
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    kind = choice.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise InvalidRequest("tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
                         param="tool_choice.type")


def to_conversation(req: MessagesRequest | CountTokensRequest, reject_unsupported: bool) -> Conversation:
    dropped: list[str] = []
    messages: list[dict[str, Any]] = []
    if req.system is not None:
        messages.append({"role": "system", "content": _text_blocks(req.system, "system", "system")})
    for i, msg in enumerate(req.messages):
        param = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise InvalidRequest("a message must be an object", param=param, code="invalid_type")
        role, content = msg.get("role"), msg.get("content")
        if role not in _ROLES:
            raise InvalidRequest(f"unknown role {role!r}; valid roles: {', '.join(_ROLES)}", param=f"{param}.role")
        if content is None:
            raise InvalidRequest("a message needs content", param=f"{param}.content",
                                 code="missing_required_parameter")
        if role == "user":
            messages += _user(content, f"{param}.content")
        elif role == "assistant":
            messages.append(_assistant(content, f"{param}.content", dropped))
        else:
            messages.append({"role": "system", "content": _text_blocks(content, f"{param}.content", "content")})
    tools = convert_tools(req.tools, reject_unsupported, dropped)
    choice, parallel = convert_tool_choice(req.tool_choice)
    return Conversation(messages, tools, choice, parallel, dropped)


def to_chat_request(req: MessagesRequest, conv: Conversation) -> ChatCompletionRequest:
    body: dict[str, Any] = {
        "messages": conv.messages, "tools": conv.tools, "tool_choice": conv.tool_choice,
        "parallel_tool_calls": conv.parallel_tool_calls, "max_tokens": req.max_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k or None,
        "stop": req.stop_sequences or None,
        "stream": req.stream, "response_format": _response_format(req.output_config),
    }
    try:
        chat_req = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        err = from_validation_error(exc)
        if err.param == "stop":
            err.param = "stop_sequences"
        raise err from exc
    refuse_unenforced(chat_req, WIRE_NAMES)
    return chat_req


# the core's field names as a Messages client says them (CoreRequest.wire_names: the param of a 400)
WIRE_NAMES = {"response_format": "output_config.format", "response_format.type": "output_config.format.type",
              "response_format.json_schema.schema": "output_config.format.schema", "tool_choice": "tool_choice",
              "tools[].function.parameters": "tools[].input_schema",
              "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}


def _response_format(config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``output_config.format`` (``JSONOutputFormatParam``: ``{type: "json_schema", schema}``) -> chat's
    ``response_format``."""
    fmt = (config or {}).get("format")
    if not isinstance(fmt, Mapping):
        return None
    if fmt.get("type") != "json_schema":
        return dict(fmt)
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema")}}


def recorded_meta(conv: Conversation) -> dict[str, Any]:
    meta: dict[str, Any] = {"format": "messages"}
    if conv.dropped:
        meta["dropped"] = conv.dropped
    return meta


# --------------------------------------------------------------------------------------------- rendering


def split_thinking(content: str) -> tuple[str | None, str, bool]:
    """``(thinking, text, closed)`` of a returned message's content: a leading ``<think>...</think>`` is the
    thinking (``closed`` False when the model never closed it), the rest the text. Exactly invertible:
    ``<think>`` + thinking + (``</think>`` if closed) + text == content."""
    if not content.startswith(THINK_OPEN):
        return None, content, True
    end = content.find(THINK_CLOSE)
    if end < 0:
        return content[len(THINK_OPEN):], "", False
    return content[len(THINK_OPEN):end], content[end + len(THINK_CLOSE):], True


def _tool_input(arguments: object) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {}


def content_blocks(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    thinking, text, closed = split_thinking(message.get("content") or "")
    if thinking is not None:
        blocks.append({"type": "thinking", "thinking": thinking, "signature": SIGNATURE if closed else SIGNATURE_OPEN})
    if text:
        blocks.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        blocks.append({"type": "tool_use", "id": call.get("id"), "name": fn.get("name"),
                       "input": _tool_input(fn.get("arguments"))})
    return blocks


def stop_reason(res: ChoiceResult, stops: list[str], tokenizer: Any) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` of a finished choice."""
    if res.finish_reason == "length":
        return "max_tokens", None
    if res.finish_reason == "tool_calls":
        return "tool_use", None
    if stops and res.visible == len(res.output_ids):  # no end-of-turn token: cut at a stop string
        full = tokenizer.decode(res.output_ids, skip_special_tokens=True)
        hits = [s for s in stops if full.startswith(res.text + s)]
        if hits:
            return "stop_sequence", hits[0]
    return "end_turn", None


def usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0}


def message_object(run_id: str, model: str, content: list[dict[str, Any]], stop: str | None, stop_seq: str | None,
                   usage_json: dict[str, Any]) -> dict[str, Any]:
    return {"id": run_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop, "stop_sequence": stop_seq, "usage": usage_json}


def render_message(req: MessagesRequest, run: ChoiceRun, prompt_len: int, model: str, tokenizer: Any) -> dict[str, Any]:
    res = run.result
    assert res is not None
    stop, seq = stop_reason(res, req.stop_sequences or [], tokenizer)
    return message_object(run.id, model, content_blocks(res.message()), stop, seq,
                          usage(prompt_len, len(res.output_ids)))


class MessageStream:
    """The core's events of one turn as Messages server-sent events (see the module docstring).

    Content deltas are split into thinking and text on the fly: until the text can no longer start with
    ``<think>`` it is held; inside the thinking, a tail that could begin ``</think>`` is held."""

    def __init__(self, req: MessagesRequest, run: ChoiceRun, prompt_len: int, model: str, tokenizer: Any) -> None:
        self.req, self.run, self.prompt_len, self.model, self.tokenizer = req, run, prompt_len, model, tokenizer
        self.index = -1  # index of the open content block
        self.block: str | None = None  # its type
        self.mode = "start"  # start (undecided) | thinking | text
        self.held = ""

    def _event(self, kind: str, **body: Any) -> bytes:
        return sse(kind, {"type": kind, **body})

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.block = kind
        out.append(self._event("content_block_start", index=self.index, content_block=block))
        return out

    def _close(self, signature: str = SIGNATURE) -> list[bytes]:
        if self.block is None:
            return []
        out = []
        if self.block == "thinking":
            out.append(self._event("content_block_delta", index=self.index,
                                   delta={"type": "signature_delta", "signature": signature}))
        out.append(self._event("content_block_stop", index=self.index))
        self.block = None
        return out

    def _emit(self, kind: str, piece: str) -> list[bytes]:
        if not piece:
            return []
        out: list[bytes] = []
        if self.block != kind:
            block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "",
                                                                          "signature": ""}
            out += self._open(kind, block)
        delta = {"type": "text_delta", "text": piece} if kind == "text" else {"type": "thinking_delta",
                                                                              "thinking": piece}
        out.append(self._event("content_block_delta", index=self.index, delta=delta))
        return out

    def _text(self, piece: str, final: bool) -> list[bytes]:
        self.held += piece
        out: list[bytes] = []
        if self.mode == "start":
            if self.held.startswith(THINK_OPEN):
                self.mode, self.held = "thinking", self.held[len(THINK_OPEN):]
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            elif THINK_OPEN.startswith(self.held) and not final:
                return out
            else:
                self.mode = "text"
        if self.mode == "thinking":
            end = self.held.find(THINK_CLOSE)
            if end >= 0:
                out += self._emit("thinking", self.held[:end])
                out += self._close(SIGNATURE)
                self.mode, self.held = "text", self.held[end + len(THINK_CLOSE):]
            else:
                keep = 0 if final else next((n for n in range(min(len(THINK_CLOSE) - 1, len(self.held)), 0, -1)
                                             if self.held.endswith(THINK_CLOSE[:n])), 0)
                out += self._emit("thinking", self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                if final:
                    out += self._close(SIGNATURE_OPEN)
                return out
        if self.mode == "text":
            out += self._emit("text", self.held)
            self.held = ""
        return out

    def _delta(self, delta: StreamDelta, final: bool) -> list[bytes]:
        out = self._text(delta.content, final) if delta.content or final else []
        for _, call in delta.tool_calls:
            fn = call.get("function") or {}
            out += self._open("tool_use", {"type": "tool_use", "id": call.get("id"), "name": fn.get("name"),
                                           "input": {}})
            args = json.dumps(_tool_input(fn.get("arguments")))
            out.append(self._event("content_block_delta", index=self.index,
                                   delta={"type": "input_json_delta", "partial_json": args}))
        return out

    async def render(self, events: AsyncIterator[TurnEvent]) -> AsyncIterator[bytes]:
        try:
            yield self._event("message_start", message=message_object(
                self.run.id, self.model, [], None, None, usage(self.prompt_len, 0)))
            yield self._event("ping")
            async for ev in events:
                if ev.kind == "recorded":
                    break
                assert ev.delta is not None
                for chunk in self._delta(ev.delta, ev.kind == "end"):
                    yield chunk
                if ev.kind == "end":
                    for chunk in self._close():
                        yield chunk
            res = self.run.result
            assert res is not None
            stop, seq = stop_reason(res, self.req.stop_sequences or [], self.tokenizer)
            yield self._event("message_delta", delta={"stop_reason": stop, "stop_sequence": seq},
                              usage={"input_tokens": self.prompt_len, "output_tokens": len(res.output_ids)})
            yield self._event("message_stop")
        except GatewayError as exc:
            log.warning("messages stream ended with an error, nothing recorded: %s", exc.message)
            _, body = anthropic_error_body(exc)
            yield self._event("error", error=body["error"])
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()


# -------------------------------------------------------------------------- the Messages wire format


class MessagesFormat:
    """Anthropic's Messages API as a :class:`gateway.formats.contract.WireFormat`: errors in Anthropic's
    shape, ids ``msg_...``."""

    name = "messages"
    request_model = MessagesRequest
    id_prefix = "msg_"

    def error_body(self, exc: GatewayError) -> tuple[int, dict[str, Any]]:
        return anthropic_error_body(exc)

    async def to_core(self, svc: Any, who: Any, req: MessagesRequest) -> CoreRequest[MessagesRequest]:
        conv = to_conversation(req, svc.settings.unsupported_tools == "reject")
        return CoreRequest(wire=req, core=to_chat_request(req, conv), meta=recorded_meta(conv),
                           wire_names=WIRE_NAMES)

    def render(self, turn: CoreRequest[Any], plan: Any, runs: list[ChoiceRun], svc: Any) -> dict[str, Any]:
        return render_message(turn.wire, runs[0], len(plan.prompt), svc.model_name, svc.tokenizer)

    def stream(self, turn: CoreRequest[Any], plan: Any, runs: list[ChoiceRun], events: AsyncIterator[TurnEvent],
               svc: Any) -> AsyncIterator[bytes]:
        return MessageStream(turn.wire, runs[0], len(plan.prompt), svc.model_name, svc.tokenizer).render(events)


MESSAGES = MessagesFormat()
