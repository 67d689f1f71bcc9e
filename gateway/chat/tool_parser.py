"""Tool calls out of the model's text: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks.

The model (through the chat template or the Hermes system prompt) writes each call as a JSON object
between ``<tool_call>`` and ``</tool_call>``; several blocks are several (parallel) calls. The parser
returns OpenAI-shaped calls and the remaining text as content. Rules (also in ``docs/chat.md``):

- every block is parsed, in order; whitespace around and inside the tags is ignored;
- a block whose body is not a JSON object with a string ``name`` stays in the content verbatim;
- ``arguments`` (or ``parameters``) given as an object becomes a JSON string (``json.dumps``, default
  separators, non-ASCII kept); given as a string it is kept as is; missing, it is ``"{}"``;
- a last block that was never closed (the model stopped right after the JSON) counts if its body is valid;
- content is the text outside the parsed blocks with surrounding whitespace stripped, ``None`` when that
  leaves nothing and there are tool calls (``""`` when there are none).

:class:`StreamingToolParser` applies the same rules to text deltas, so that the concatenation of its
content deltas and its tool calls equal :func:`parse_tool_calls` of the whole text.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"

ToolCall = dict[str, Any]
IdFactory = Callable[[], str]


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id (``call_`` + 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


def tool_parsing_enabled(tools: Sequence[Any] | None, tool_choice: object) -> bool:
    """Tool calls are parsed only when the request offers tools and does not say ``tool_choice: "none"``."""
    return bool(tools) and tool_choice != "none"


def _call_from_body(body: str, make_id: IdFactory) -> ToolCall | None:
    """The OpenAI tool call for one block body, or ``None`` if the body is not a valid call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        arguments = args
    else:
        arguments = json.dumps(args, ensure_ascii=False)
    return {"id": make_id(), "type": "function", "function": {"name": obj["name"], "arguments": arguments}}


def _finish_content(parts: list[str], has_calls: bool) -> str | None:
    content = "".join(parts).strip()
    if not content and has_calls:
        return None
    return content


def parse_tool_calls(text: str, make_id: IdFactory = new_call_id) -> tuple[str | None, list[ToolCall]]:
    """Split model text into ``(content, tool_calls)`` following the module's rules."""
    parts: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            parts.append(text[pos:])
            break
        parts.append(text[pos:start])
        end = text.find(CLOSE, start + len(OPEN))
        body_end = len(text) if end < 0 else end
        block_end = len(text) if end < 0 else end + len(CLOSE)
        call = _call_from_body(text[start + len(OPEN) : body_end], make_id)
        if call is None:
            parts.append(text[start:block_end])
        else:
            calls.append(call)
        pos = block_end
        if end < 0:
            break
    return _finish_content(parts, bool(calls)), calls


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A complete tool call, ``index`` counting the calls of this choice from 0 (for SSE ``delta.tool_calls``)."""

    index: int
    call: ToolCall


StreamEvent = ContentDelta | ToolCallDelta


def _partial_open_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0


class StreamingToolParser:
    """Incremental :func:`parse_tool_calls`: feed text deltas, get content deltas and finished tool calls.

    Content is released as soon as it cannot be part of a ``<tool_call>`` tag; whitespace is held back
    until non-space content follows it, so leading and trailing whitespace never reaches the client
    (matching the non-streaming content, which is stripped). A block is reported when it closes (or at
    :meth:`finish`, if it was never closed and its body is a valid call).
    """

    def __init__(self, make_id: IdFactory = new_call_id) -> None:
        self._make_id = make_id
        self._buffer = ""  # text not yet classified: a partial tag, or the body of an open block
        self._inside = False
        self._pending_space = ""  # whitespace held until non-space content follows
        self._started = False  # some non-space content was released
        self._calls = 0

    def _content(self, text: str) -> list[StreamEvent]:
        if not text:
            return []
        stripped = text.rstrip()
        if not stripped:
            self._pending_space += text
            return []
        lead = self._pending_space if self._started else ""
        if not self._started:
            stripped = stripped.lstrip()
        self._pending_space = text[len(text.rstrip()) :]
        self._started = True
        return [ContentDelta(lead + stripped)]

    def feed(self, delta: str) -> list[StreamEvent]:
        """Events released by one more piece of text."""
        self._buffer += delta
        events: list[StreamEvent] = []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    return events
                events += self._block(self._buffer[:end], OPEN + self._buffer[: end + len(CLOSE)])
                self._buffer = self._buffer[end + len(CLOSE) :]
                self._inside = False
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                events += self._content(self._buffer[:start])
                self._buffer = self._buffer[start + len(OPEN) :]
                self._inside = True
                continue
            keep = _partial_open_len(self._buffer)
            events += self._content(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return events

    def _block(self, body: str, raw: str) -> list[StreamEvent]:
        call = _call_from_body(body, self._make_id)
        if call is None:
            return self._content(raw)
        self._calls += 1
        return [ToolCallDelta(self._calls - 1, call)]

    def finish(self) -> list[StreamEvent]:
        """Events for whatever is still buffered at the end of the output."""
        events: list[StreamEvent] = []
        if self._inside:
            events = self._block(self._buffer, OPEN + self._buffer)
        else:
            events = self._content(self._buffer)
        self._buffer = ""
        self._inside = False
        return events
