"""From a choice's output tokens to what the agent sees: text, stop strings, tool calls, logprobs.

One :class:`ChoiceDecoder` per choice serves both non-streaming and streaming responses, so that the two
return the same tokens and the same message. Rules:

- the engine's output ids are the model's exact tokens; a trailing stop/end-of-turn token (the engine's
  ``finish_reason.matched``) is kept in the recorded ``output_ids`` but not shown as text;
- text is ``tokenizer.decode(ids, skip_special_tokens=True)`` of the visible ids;
- ``stop`` strings are applied here, on the decoded text (whatever the engine did with them): the text is
  cut before the first stop string, finish reason ``stop``, and the recorded tokens end with the token
  that completed the stop string (so the child turn's stitching adds an end-of-turn bridge token);
- when the request offers tools (and ``tool_choice`` is not ``"none"``), every ``<tool_call>`` block is
  parsed (``gateway.chat.tool_parser``); a choice that ended normally with tool calls has finish reason
  ``tool_calls``;
- streaming releases text only when it can no longer change: not while the last token decodes to an
  incomplete UTF-8 character, nor while the tail could still grow into a stop string;
- streaming costs O(new tokens) per chunk, not O(output so far): the text is decoded incrementally
  (:class:`IncrementalText`: the new tokens with a few tokens of context before them) and stop strings
  are looked for only in the text not yet released; the whole output is decoded once, at the end. A
  tokenizer that cleans up spaces across tokens (``clean_up_tokenization_spaces``) is decoded whole at
  every chunk instead, as its text is not the concatenation of its pieces.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from gateway.chat.tool_parser import (
    ContentDelta,
    StreamingToolParser,
    ToolCallDelta,
    parse_tool_calls,
)
from gateway.engine_client import Generation

log = logging.getLogger("agentrl.gateway.decoding")


@dataclass(slots=True)
class ChoiceResult:
    """A finished choice: what is recorded and what is returned."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    top_logprobs: list[list[tuple[int, float]]]
    visible: int  # how many leading output ids are shown as text / logprobs
    text: str
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str  # "stop" | "length" | "tool_calls"
    segments: int = 1

    def message(self) -> dict[str, Any]:
        """The assistant message exactly as returned (and recorded)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


class IncrementalText:
    """The text of a growing list of token ids, decoded a few tokens at a time.

    :meth:`advance` returns what ``ids[read:upto]`` add to the text: it decodes them together with the
    tokens since the previous step's start (``prefix``) and removes the text of those, so that a token
    decoded differently after others (SentencePiece's leading space) comes out as in the whole text. While
    the new tokens end inside a UTF-8 character nothing is returned and they are retried with the next
    ones. Each call decodes the last step's tokens and the new ones: work proportional to the new tokens.
    ``decoded`` counts the token ids handed to the tokenizer (the benchmark's and tests' measure of work).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.prefix = 0  # start of the context window
        self.read = 0  # tokens whose text has been returned
        self.decoded = 0

    def advance(self, ids: list[int], upto: int) -> str:
        if upto <= self.read:
            return ""
        before = self._decode(ids[self.prefix:self.read]) if self.read > self.prefix else ""
        after = self._decode(ids[self.prefix:upto])
        self.decoded += (self.read - self.prefix) + (upto - self.prefix)
        if after.endswith("\ufffd") or not after.startswith(before):
            return ""  # an incomplete character (or a window that does not extend): wait for more tokens
        self.prefix, self.read = self.read, upto
        return after[len(before):]


@dataclass(slots=True)
class StreamDelta:
    """What one streaming step releases for a choice."""

    content: str = ""
    tool_calls: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    token_start: int = 0  # logprobs of output ids [token_start, token_end) go with this delta
    token_end: int = 0

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls or self.token_end > self.token_start)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


class ChoiceDecoder:
    def __init__(self, tokenizer: Any, *, stop: list[str], stop_token_ids: list[int], parse_tools: bool) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.stop_token_ids = set(stop_token_ids)
        self.parse_tools = parse_tools
        # streaming state
        self._released_text = 0
        self._released_tokens = 0
        self._parser = StreamingToolParser() if parse_tools else None
        self._content: list[str] = []
        self._calls: list[dict[str, Any]] = []
        self.stopped = False  # a stop string was found: the caller stops reading the engine
        # incremental decoding (None: the tokenizer's text is not the concatenation of its pieces). It gets a
        # function of the tokenizer, not the bound ``self.decode``: that would make the two objects a
        # reference cycle, freed only by the garbage collector's full passes (one per choice of every turn)
        self.text: IncrementalText | None = (
            None if getattr(tokenizer, "clean_up_tokenization_spaces", False)
            else IncrementalText(partial(_decode, tokenizer)))
        self._pending = ""  # decoded, not released (the tail that could still grow into a stop string)
        self._released: list[str] = []

    def decode(self, ids: list[int]) -> str:
        return _decode(self.tokenizer, ids)

    def _visible(self, gen: Generation, final: bool) -> int:
        ids = gen.output_ids
        if ids and ids[-1] in self.stop_token_ids and (gen.finish == "stop" or not final):
            return len(ids) - 1
        return len(ids)

    def _cut_at_stop(self, ids: list[int], visible: int) -> tuple[str, int, int] | None:
        """(text before the stop string, tokens to keep, visible tokens) if a stop string occurs."""
        if not self.stop:
            return None
        text = self.decode(ids[:visible])
        hits = [(text.find(s), s) for s in self.stop if s in text]
        if not hits:
            return None
        pos, s = min(hits)
        lo, hi = 1, visible  # smallest k whose decoded text holds the stop string at or before pos
        while lo < hi:
            mid = (lo + hi) // 2
            if s in self.decode(ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return text[:pos], lo, lo

    def _final_text(self, gen: Generation) -> tuple[str, int, int, str]:
        """(text, tokens kept, tokens visible, finish reason) of a finished generation, stop strings applied."""
        visible = self._visible(gen, final=True)
        cut = self._cut_at_stop(gen.output_ids, visible)
        if cut is not None:
            text, keep, visible = cut
            return text, keep, visible, "stop"
        return self.decode(gen.output_ids[:visible]), len(gen.output_ids), visible, gen.finish or "length"

    # ---- non-streaming ----
    def finish(self, gen: Generation) -> ChoiceResult:
        text, keep, visible, finish = self._final_text(gen)
        content: str | None = text
        calls: list[dict[str, Any]] = []
        if self.parse_tools:
            content, calls = parse_tool_calls(text)
        if calls and finish == "stop":
            finish = "tool_calls"
        return self._result(gen, keep, visible, text, content, calls, finish)

    @staticmethod
    def _result(gen: Generation, keep: int, visible: int, text: str, content: str | None,
                calls: list[dict[str, Any]], finish: str) -> ChoiceResult:
        return ChoiceResult(
            output_ids=gen.output_ids[:keep], logprobs=gen.logprobs[:keep], versions=gen.versions[:keep],
            top_logprobs=gen.top_logprobs[:visible], visible=visible, text=text, content=content,
            tool_calls=calls, finish_reason=finish, segments=gen.segments,
        )

    # ---- streaming ----
    def step(self, gen: Generation) -> StreamDelta:
        """Release what is certain after a new cumulative output (call :meth:`end` at the end)."""
        if self.text is None:
            return self._step_whole(gen)
        visible = self._visible(gen, final=False)
        self._pending += self.text.advance(gen.output_ids, visible)
        # a stop string can only start in the text not yet released: every tail that could grow into
        # one was held back
        if any(s in self._pending for s in self.stop):
            self.stopped = True
            return StreamDelta()  # end() releases the rest
        safe = len(self._pending) - _held_back(self._pending, self.stop)
        piece, self._pending = self._pending[:safe], self._pending[safe:]
        done = not self._pending and self.text.read == visible
        return self._release(piece, visible if done else None, self._released_text + len(piece))

    def _step_whole(self, gen: Generation) -> StreamDelta:
        """:meth:`step` decoding the whole output (tokenizers whose text is not the sum of its pieces)."""
        visible = self._visible(gen, final=False)
        cut = self._cut_at_stop(gen.output_ids, visible)
        if cut is not None:
            self.stopped = True
            return StreamDelta()  # end() releases the rest
        text = self.decode(gen.output_ids[:visible])
        safe = len(text)
        while safe > 0 and text[safe - 1] == "\ufffd":
            safe -= 1  # an incomplete UTF-8 character: wait for the next token
        safe -= _held_back(text[:safe], self.stop)  # the tail might grow into a stop string
        return self._release(text[self._released_text:safe], visible if safe == len(text) else None,
                             safe)

    def _release(self, piece: str, tokens_to: int | None, text_to: int) -> StreamDelta:
        delta = StreamDelta(token_start=self._released_tokens)
        if text_to > self._released_text:
            self._released_text = text_to
            self._released.append(piece)
            self._emit(piece, delta)
        if tokens_to is not None and tokens_to > self._released_tokens:
            self._released_tokens = tokens_to
        delta.token_end = self._released_tokens
        return delta

    def _emit(self, piece: str, delta: StreamDelta) -> None:
        if self._parser is None:
            if piece:
                self._content.append(piece)
                delta.content += piece
            return
        for event in self._parser.feed(piece) if piece else []:
            self._apply(event, delta)

    def _apply(self, event: ContentDelta | ToolCallDelta, delta: StreamDelta) -> None:
        if isinstance(event, ContentDelta):
            self._content.append(event.text)
            delta.content += event.text
        else:
            self._calls.append(event.call)
            delta.tool_calls.append((event.index, event.call))

    def end(self, gen: Generation) -> tuple[StreamDelta, ChoiceResult]:
        """The last delta and the finished choice; its message is exactly what the stream released."""
        text, keep, visible, finish = self._final_text(gen)
        if not text.startswith("".join(self._released)):  # never seen; would break "stream == non-stream"
            log.error("streamed text is not a prefix of the whole output's text (tokenizer %s); the stream "
                      "and the recorded message may differ", type(self.tokenizer).__name__)
        delta = StreamDelta(token_start=self._released_tokens)
        if len(text) > self._released_text:
            self._emit(text[self._released_text:], delta)
            self._released_text = len(text)
        if self._parser is not None:
            for event in self._parser.finish():
                self._apply(event, delta)
        self._released_tokens = visible
        delta.token_end = visible
        content: str | None = "".join(self._content)
        if self.parse_tools and self._calls and not content:
            content = None
        if self._calls and finish == "stop":
            finish = "tool_calls"
        return delta, self._result(gen, keep, visible, text, content, list(self._calls), finish)


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that could be the start of a stop string."""
    held = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return held


def logprobs_json(tokenizer: Any, ids: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]], want_top: int) -> list[dict[str, Any]]:
    """OpenAI ``choice.logprobs.content`` entries for ``ids`` (with ``top_logprobs`` when asked)."""
    needed = set(ids)
    if want_top:
        for row in top[: len(ids)]:
            needed.update(t for t, _ in row[:want_top])
    texts = dict(zip(needed, tokenizer.batch_decode([[t] for t in needed], skip_special_tokens=False)))

    def entry(token: int, lp: float) -> dict[str, Any]:
        text = texts[token]
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    out = []
    for i, (token, lp) in enumerate(zip(ids, logprobs)):
        item = entry(token, lp)
        row = top[i] if i < len(top) else []
        item["top_logprobs"] = [entry(t, p) for t, p in row[:want_top]] if want_top else []
        out.append(item)
    return out
