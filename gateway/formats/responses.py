"""The OpenAI Responses API (``POST /v1/responses``) as a wire format over the conversation core.

Shapes follow the installed ``openai`` package's ``openai/types/responses`` (``ResponseCreateParams``,
``Response``, ``ResponseOutputMessage``, ``ResponseFunctionToolCall``, the ``Response*Event`` stream events).

Parsing (:func:`to_conversation`): ``instructions`` becomes a leading system message; ``input`` (a string, or
items) becomes chat messages:

- ``message`` items (roles user / system / developer / assistant; content a string or ``input_text`` /
  ``output_text`` / ``refusal`` parts) -> messages of that role (text parts joined);
- ``function_call`` items join the assistant message before them as ``tool_calls`` (``call_id`` is the
  tool call id; the item's own ``id`` is not part of the conversation), so that a returned
  ``[message, function_call...]`` comes back as exactly the assistant message the core recorded;
- ``function_call_output`` -> a ``tool`` message answering ``call_id``;
- ``reasoning`` items are kept out of the prompt (the model never produced them here; training on them
  would teach text the model did not see) and listed in the recorded request;
- any other item type, and non-text content (images, files, audio), is refused with 400.

``previous_response_id`` prepends the stored conversation of that turn (it becomes the parent). Function
tools are served; a ``namespace`` tool's functions are served under their own names (the output
``function_call`` carries the namespace); tool types the gateway cannot serve (``web_search``, ``custom``,
``tool_search``, ``file_search``, ``mcp``, ...) are dropped with a warning, or refused with 400 when the
gateway runs with ``--unsupported-tools reject``.

Rendering: :func:`render_response` (a finished turn) and :class:`ResponseStream` (the core's events ->
``response.*`` server-sent events with ``sequence_number``).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, StrictBool, StrictInt, ValidationError

from gateway.constraints import refuse_unenforced
from gateway.decoding import ChoiceResult, StreamDelta, logprobs_json
from gateway.engine_client import Generation
from gateway.episodes import compaction
from gateway.errors import GatewayError, InvalidRequest, error_body, from_validation_error
from gateway.formats.common import conversation_of, load_turn, sse, unsupported_tool
from gateway.formats.contract import CoreRequest
from gateway.service import ChoiceRun, TurnEvent
from gateway.wire import ChatCompletionRequest, WireModel

log = logging.getLogger("agentrl.gateway.formats.responses")

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TEXT_PARTS = {"input_text", "output_text", "text", "refusal"}
_CHAT_ROLES = {"user", "assistant", "system", "developer"}


class ResponsesRequest(WireModel):
    """``ResponseCreateParams``: the fields the gateway reads; everything else is accepted and logged."""

    model: str | None = None
    input: Any = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    stream: StrictBool = False
    store: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    user: str | None = None
    prompt_cache_key: str | None = None

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])


@dataclass
class Conversation:
    """A Responses request in the core's terms: chat messages and function tools (plus what was left out)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: Any
    namespaces: dict[str, str] = field(default_factory=dict)  # function name -> its namespace tool
    dropped: list[str] = field(default_factory=list)  # what the prompt leaves out, recorded with the turn


# --------------------------------------------------------------------------------------------- parsing


def _text(content: object, param: str, allowed: set[str]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest("content must be a string or a list of content parts", param=param,
                             code="invalid_type")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in allowed:
            raise InvalidRequest(
                f"content part type {kind!r} is not supported (supported: {', '.join(sorted(allowed))}); "
                "this gateway serves text-only models", param=f"{param}[{j}].type")
        key = "refusal" if kind == "refusal" else "text"
        value = part.get(key)
        if not isinstance(value, str):
            raise InvalidRequest(f"a {kind} part needs a string {key!r}", param=f"{param}[{j}].{key}",
                                 code="invalid_type")
        parts.append(value)
    return "".join(parts)


def _tool_output(output: object, param: str) -> str:
    return _text(output, param, {"input_text", "output_text", "text"})


def _items(value: object) -> list[Any]:
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("input must be a string or a non-empty list of input items", param="input",
                             code="invalid_type" if not isinstance(value, list) else "invalid_value")
    return value


def input_messages(value: object, dropped: list[str]) -> list[dict[str, Any]]:
    """Chat messages of ``input`` (see the module docstring for the rules)."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(_items(value)):
        param = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise InvalidRequest("an input item must be an object", param=param, code="invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        last = messages[-1] if messages else None
        if kind == "message":
            role = item.get("role")
            if role not in _CHAT_ROLES:
                raise InvalidRequest(f"unknown role {role!r}; valid roles: {', '.join(sorted(_CHAT_ROLES))}",
                                     param=f"{param}.role")
            text = _text(item.get("content"), f"{param}.content", _TEXT_PARTS)
            if role == "assistant" and last is not None and last["role"] == "assistant" and "content" not in last:
                last["content"] = text  # text streamed after this turn's function calls
            elif role == "assistant":
                messages.append({"role": "assistant", "content": text})
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            for key, v in (("call_id", call_id), ("name", name), ("arguments", arguments)):
                if not isinstance(v, str) or (key != "arguments" and not v):
                    raise InvalidRequest(f"a function_call item needs a string {key!r}", param=f"{param}.{key}",
                                         code="missing_required_parameter")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequest("a function_call_output item needs a call_id", param=f"{param}.call_id",
                                     code="missing_required_parameter")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _tool_output(item.get("output"), f"{param}.output")})
        elif kind == "reasoning":
            dropped.append(f"{param}: reasoning item {item.get('id')!r} (not model output of this gateway)")
        else:
            raise InvalidRequest(
                f"input item type {kind!r} is not supported (supported: message, function_call, "
                "function_call_output, reasoning)", param=f"{param}.type")
    return messages


def _function(tool: Mapping[str, Any], param: str) -> dict[str, Any]:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("a function tool needs a name", param=f"{param}.name", code="missing_required_parameter")
    fn: dict[str, Any] = {"name": name}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    if tool.get("parameters") is not None:
        fn["parameters"] = tool["parameters"]
    if tool.get("strict") is not None:
        fn["strict"] = tool["strict"]
    return {"type": "function", "function": fn}


def convert_tools(tools: list[Any] | None, reject_unsupported: bool, namespaces: dict[str, str],
                  dropped: list[str]) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise InvalidRequest("a tool must be an object", param=param, code="invalid_type")
        kind = tool.get("type")
        if kind == "function":
            out.append(_function(tool, param))
            continue
        if kind == "namespace" and isinstance(tool.get("tools"), list):
            for j, inner in enumerate(tool["tools"]):
                if isinstance(inner, Mapping) and inner.get("type") == "function":
                    out.append(_function(inner, f"{param}.tools[{j}]"))
                    namespaces[str(inner.get("name"))] = str(tool.get("name"))
                else:
                    unsupported_tool(inner.get("type") if isinstance(inner, Mapping) else None,
                                 f"{param}.tools[{j}]", reject_unsupported, dropped)
            continue
        unsupported_tool(kind, param, reject_unsupported, dropped)
    return out or None


def convert_tool_choice(choice: object) -> object:
    """Responses ``tool_choice`` -> chat ``tool_choice``."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, Mapping):
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        if choice.get("type") == "allowed_tools" and choice.get("mode") in ("auto", "required"):
            return choice["mode"]
    raise InvalidRequest("tool_choice must be 'none', 'auto', 'required', {'type': 'function', 'name': ...} or "
                         "{'type': 'allowed_tools', 'mode': ...}; hosted tools are not served", param="tool_choice")


def to_conversation(req: ResponsesRequest, history: list[dict[str, Any]], reject_unsupported: bool) -> Conversation:
    """The request as chat messages: ``history`` (the previous response's conversation) + ``input``, with
    ``instructions`` as the system message (replacing the history's leading one, as the Responses API does
    not carry instructions over)."""
    dropped: list[str] = []
    namespaces: dict[str, str] = {}
    new = input_messages(req.input, dropped)
    messages = list(history)
    if req.instructions is not None:
        system = {"role": "system", "content": req.instructions}
        if messages and messages[0].get("role") == "system":
            messages[0] = system
        else:
            messages.insert(0, system)
    messages += new
    tools = convert_tools(req.tools, reject_unsupported, namespaces, dropped)
    return Conversation(messages, tools, convert_tool_choice(req.tool_choice), namespaces, dropped)


# --------------------------------------------------------------------------------------------- rendering


def _base(response_id: str) -> str:
    return response_id.split("_", 1)[1] if "_" in response_id else response_id.split("-", 1)[-1]


def message_item_id(response_id: str) -> str:
    return f"msg_{_base(response_id)}"


def call_item_id(response_id: str, index: int) -> str:
    return f"fc_{_base(response_id)}_{index}"


def output_text(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(response_id: str, text: str, logprobs: list[dict[str, Any]] | None, status: str) -> dict[str, Any]:
    return {"id": message_item_id(response_id), "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text, logprobs)]}


def call_item(response_id: str, index: int, call: Mapping[str, Any], status: str,
              namespaces: Mapping[str, str]) -> dict[str, Any]:
    fn = call.get("function") or {}
    item = {"id": call_item_id(response_id, index), "type": "function_call", "call_id": call.get("id"),
            "name": fn.get("name"), "arguments": fn.get("arguments", ""), "status": status}
    if fn.get("name") in namespaces:
        item["namespace"] = namespaces[fn["name"]]
    return item


def output_items(response_id: str, message: Mapping[str, Any], finish_reason: str,
                 logprobs: list[dict[str, Any]] | None, namespaces: Mapping[str, str]) -> list[dict[str, Any]]:
    """The output items of a returned assistant message: a ``message`` (unless the turn is only tool calls)
    then one ``function_call`` per tool call."""
    status = "incomplete" if finish_reason == "length" else "completed"
    calls = message.get("tool_calls") or []
    items = []
    content = message.get("content")
    if content is not None or not calls:
        items.append(message_item(response_id, content or "", logprobs, status))
    items += [call_item(response_id, i, call, "completed", namespaces) for i, call in enumerate(calls)]
    return items


def usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def response_object(req: ResponsesRequest | None, response_id: str, model: str, created_at: float, status: str,
                    output: list[dict[str, Any]], usage_json: dict[str, Any] | None,
                    finish_reason: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``Response`` object; ``req`` None renders a stored turn (``GET /v1/responses/{id}``)."""
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "completed_at": time.time() if status in ("completed", "incomplete") else None,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
        "instructions": req.instructions if req else None,
        "max_output_tokens": req.max_output_tokens if req else None,
        "metadata": (req.metadata if req else None) or {},
        "model": model, "output": output,
        "parallel_tool_calls": True if req is None or req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id if req else None,
        "reasoning": (req.reasoning if req else None),
        "store": True if req is None or req.store is None else req.store,
        "temperature": req.temperature if req and req.temperature is not None else 1.0,
        "text": (req.text if req and req.text else {"format": {"type": "text"}}),
        "tool_choice": (req.tool_choice if req and req.tool_choice is not None else "auto"),
        "tools": (req.tools if req and req.tools else []),
        "top_p": req.top_p if req and req.top_p is not None else 1.0,
        "top_logprobs": req.top_logprobs if req else None,
        "truncation": "disabled", "usage": usage_json, "user": req.user if req else None,
        "prompt_cache_key": req.prompt_cache_key if req else None,
    }


def finished_status(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def render_response(req: ResponsesRequest, conv: Conversation, run: ChoiceRun, prompt_len: int, model: str,
                    tokenizer: Any, created_at: float) -> dict[str, Any]:
    res = run.result
    assert res is not None
    logprobs = _logprobs(tokenizer, res, req) if req.wants_logprobs else None
    items = output_items(run.id, res.message(), res.finish_reason, logprobs, conv.namespaces)
    return response_object(req, run.id, model, created_at, finished_status(res.finish_reason), items,
                           usage(prompt_len, len(res.output_ids)), res.finish_reason)


def _logprobs(tokenizer: Any, res: ChoiceResult, req: ResponsesRequest) -> list[dict[str, Any]]:
    n = res.visible
    return logprobs_json(tokenizer, res.output_ids[:n], res.logprobs[:n], res.top_logprobs, req.top_logprobs or 0)


class ResponseStream:
    """The core's events of one turn as Responses server-sent events.

    Order (as OpenAI streams them): ``response.created``, ``response.in_progress``; per output item
    ``response.output_item.added`` (+ ``response.content_part.added`` for a message), its deltas
    (``response.output_text.delta`` / ``response.function_call_arguments.delta``), its ``.done`` events
    and ``response.output_item.done``; then, once the turn is recorded, ``response.completed`` (or
    ``response.incomplete`` when cut by ``max_output_tokens``); an error after the stream started ends it
    with ``response.failed``.
    """

    def __init__(self, req: ResponsesRequest, conv: Conversation, run: ChoiceRun, prompt_len: int, model: str,
                 tokenizer: Any) -> None:
        self.req, self.conv, self.run, self.prompt_len = req, conv, run, prompt_len
        self.model, self.tokenizer = model, tokenizer
        self.created_at = time.time()
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.text: list[str] = []
        self.text_logprobs: list[dict[str, Any]] = []
        self.open_message: int | None = None  # output index of the message item being streamed

    def event(self, kind: str, **body: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **body}
        self.seq += 1
        return sse(kind, payload)

    def snapshot(self, status: str, usage_json: dict[str, Any] | None = None, finish: str | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_object(self.req, self.run.id, self.model, self.created_at, status, list(self.items),
                               usage_json, finish, error)

    def _open_message(self) -> list[bytes]:
        index = len(self.items)
        item = {**message_item(self.run.id, "", None, "in_progress"), "content": []}
        self.items.append(item)
        self.open_message = index
        self.text, self.text_logprobs = [], []
        return [self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.content_part.added", item_id=item["id"], output_index=index,
                           content_index=0, part=output_text("", None))]

    def _close_message(self, status: str) -> list[bytes]:
        if self.open_message is None:
            return []
        index, self.open_message = self.open_message, None
        text = "".join(self.text)
        logprobs = self.text_logprobs if self.req.wants_logprobs else None
        part = output_text(text, logprobs)
        item = message_item(self.run.id, text, logprobs, status)
        self.items[index] = item
        return [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=text, logprobs=logprobs or []),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def _delta(self, delta: StreamDelta, gen: Generation) -> list[bytes]:
        out: list[bytes] = []
        if delta.content:
            if self.open_message is None:
                out += self._open_message()
            logprobs: list[dict[str, Any]] = []
            if self.req.wants_logprobs and delta.token_end > delta.token_start:
                s, e = delta.token_start, delta.token_end
                logprobs = logprobs_json(self.tokenizer, gen.output_ids[s:e], gen.logprobs[s:e],
                                         gen.top_logprobs[s:e], self.req.top_logprobs or 0)
                self.text_logprobs += logprobs
            self.text.append(delta.content)
            assert self.open_message is not None
            out.append(self.event("response.output_text.delta", item_id=message_item_id(self.run.id),
                                  output_index=self.open_message, content_index=0, delta=delta.content,
                                  logprobs=logprobs))
        for call_index, call in delta.tool_calls:
            out += self._close_message("completed")
            index = len(self.items)
            item = call_item(self.run.id, call_index, call, "in_progress", self.conv.namespaces)
            self.items.append({**item, "arguments": ""})
            out.append(self.event("response.output_item.added", output_index=index, item={**item, "arguments": ""}))
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                  delta=item["arguments"]))
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=item["arguments"]))
            item = {**item, "status": "completed"}
            self.items[index] = item
            out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    async def render(self, events: AsyncIterator[TurnEvent]) -> AsyncIterator[bytes]:
        try:
            yield self.event("response.created", response=self.snapshot("in_progress"))
            yield self.event("response.in_progress", response=self.snapshot("in_progress"))
            async for ev in events:
                if ev.kind == "recorded":
                    break
                assert ev.delta is not None and ev.gen is not None
                for chunk in self._delta(ev.delta, ev.gen):
                    yield chunk
                if ev.kind == "end":
                    res = self.run.result
                    assert res is not None
                    if not self.items:  # an empty reply is still a message
                        for chunk in self._open_message():
                            yield chunk
                    for chunk in self._close_message(finished_status(res.finish_reason)):
                        yield chunk
            res = self.run.result
            assert res is not None
            status = finished_status(res.finish_reason)
            final = self.snapshot(status, usage(self.prompt_len, len(res.output_ids)), res.finish_reason)
            yield self.event(f"response.{status}", response=final)
        except GatewayError as exc:
            log.warning("responses stream ended with an error, nothing recorded: %s", exc.message)
            error = {"code": "server_error" if exc.status >= 500 else "invalid_prompt", "message": exc.message}
            yield self.event("response.failed", response=self.snapshot("failed", error=error))
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()


def to_chat_request(req: ResponsesRequest, conv: Conversation) -> ChatCompletionRequest:
    """The core's request: the conversation plus the sampling fields the Responses API names differently."""
    body: dict[str, Any] = {
        "messages": conv.messages, "tools": conv.tools, "tool_choice": conv.tool_choice,
        "parallel_tool_calls": req.parallel_tool_calls, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
        "logprobs": req.wants_logprobs, "top_logprobs": req.top_logprobs if req.wants_logprobs else None,
        "response_format": response_format(req.text),
    }
    try:
        chat_req = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        raise from_validation_error(exc) from exc
    refuse_unenforced(chat_req, WIRE_NAMES)
    return chat_req


# the core's field names as a Responses client says them (CoreRequest.wire_names: the param of a 400)
WIRE_NAMES = {"response_format": "text.format", "response_format.type": "text.format.type",
              "response_format.json_schema.schema": "text.format.schema",
              "tools[].function.parameters": "tools[].parameters"}


def response_format(text: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` (``ResponseFormatTextConfigParam``: flat ``{type, name, schema, strict}``) -> chat's
    ``response_format`` (``{type, json_schema: {name, schema, strict}}``)."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, Mapping):
        return None
    if fmt.get("type") != "json_schema":
        return dict(fmt)
    return {"type": "json_schema",
            "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}


def recorded_meta(conv: Conversation) -> dict[str, Any]:
    """What the turn's recorded request keeps about its wire format."""
    meta: dict[str, Any] = {"format": "responses"}
    if conv.dropped:
        meta["dropped"] = conv.dropped
    if conv.namespaces:
        meta["namespaces"] = conv.namespaces
    return meta


# ------------------------------------------------------------------------- the Responses wire format


class ResponsesFormat:
    """The OpenAI Responses API as a :class:`gateway.formats.contract.WireFormat`: ids ``resp_...``; a
    ``previous_response_id`` brings the stored conversation it continues; a remote compaction request
    (``gateway.episodes.compaction``) is answered with one compaction item."""

    name = "responses"
    request_model = ResponsesRequest
    id_prefix = "resp_"

    def error_body(self, exc: GatewayError) -> tuple[int, dict[str, Any]]:
        return error_body(exc)

    async def to_core(self, svc: Any, who: Any, req: ResponsesRequest) -> CoreRequest[ResponsesRequest]:
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = await load_turn(svc.store, who, req.previous_response_id, "previous_response_id")
            history = await conversation_of(svc.store, previous, "previous_response_id")
        prepared, compacting = compaction.prepare(req)  # remote compaction v2 items
        conv = to_conversation(prepared, history, svc.settings.unsupported_tools == "reject")
        if compacting:
            conv.tool_choice = "none"
        return CoreRequest(wire=req, core=to_chat_request(prepared, conv), meta=recorded_meta(conv),
                           wire_names=WIRE_NAMES, state={"request": prepared, "conversation": conv, "compacting": compacting,
                                  "created": time.time()})

    def render(self, turn: CoreRequest[Any], plan: Any, runs: list[ChoiceRun], svc: Any) -> dict[str, Any]:
        req, created = turn.state["request"], turn.state["created"]
        if turn.state["compacting"]:
            return compaction.render(_THIS, req, runs[0], len(plan.prompt), svc.model_name, created)
        return render_response(req, turn.state["conversation"], runs[0], len(plan.prompt), svc.model_name,
                               svc.tokenizer, created)

    def stream(self, turn: CoreRequest[Any], plan: Any, runs: list[ChoiceRun], events: AsyncIterator[TurnEvent],
               svc: Any) -> AsyncIterator[bytes]:
        req = turn.state["request"]
        if turn.state["compacting"]:
            return compaction.stream(_THIS, req, runs[0], len(plan.prompt), svc.model_name, events)
        return ResponseStream(req, turn.state["conversation"], runs[0], len(plan.prompt), svc.model_name,
                              svc.tokenizer).render(events)


_THIS = sys.modules[__name__]  # compaction renders with this module's item and response builders
RESPONSES = ResponsesFormat()
