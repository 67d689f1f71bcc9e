"""Prompts as token ids from a Hugging Face chat template, and token-exact continuations of a turn.

A root turn's prompt is the template's rendering of its messages (:meth:`ChatTemplate.render`). A child
turn's prompt is NOT a re-rendering: it is the parent's exact prompt + output tokens, then
:meth:`ChatTemplate.continuation` = ``bridge_ids`` (the end-of-turn token, when the parent's output did
not end with one) + ``delta_ids`` (what the template renders for the new messages after an assistant turn,
plus the generation prompt). The model's own tokens are never re-tokenized, so a template that renders
history differently (one that strips earlier ``<think>`` blocks, say) cannot change what the model saw.

The delta is cut out of the template by difference: render a short stand-in conversation that ends in an
assistant turn (same leading system message, same tools, same tool calls as the parent), render it again
followed by the new messages, check that the first rendering is a prefix of the second, and take the rest
after the stand-in's end-of-turn token. With a tokenizer that splits cleanly at end-of-turn tokens
(checked at start-up; SmolLM2's does) the cut is made in the text and renderings are tokenized turn by
turn through a cache; otherwise whole renderings are tokenized and compared token by token.
Templates without tool support get tools in the Hermes format (:mod:`gateway.chat.hermes`).
:meth:`ChatTemplate.drift` says whether a re-render of the history would differ from the stitched tokens
(the server counts it). The algorithm is written out in ``docs/chat.md``.
"""

from __future__ import annotations

import functools
import json
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from jinja2 import TemplateError

from gateway.chat.errors import ChatFormatError, TemplateDriftError
from gateway.chat.hermes import text_of, to_hermes
from gateway.sizedlru import CacheSize, SizedLRU

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]
Tools = Sequence[Mapping[str, Any]] | None

_PROBE_FN = "agentrl_probe_function"
_PROBE_CALL_FN = "agentrl_probe_call"
_PROBE_TEXT = "agentrl probe reply"
# Turns' token ids kept by the segment cache; longer turns are tokenized every time. Worst case about
# 2048 x (8192 characters + 4 bytes per token) = ~40 MB; ordinary turns are far smaller.
SEGMENT_CACHE_SIZE = 2048
SEGMENT_CACHE_MAX_CHARS = 8192
# Renderings kept by the render cache, in characters of key + text (~16-32 MB). Prompts repeat: a GRPO group
# sends its root prompt once per member, and every stitched child turn renders the same short stand-in
# conversation (system prompt, tools, a fixed reply) before its new messages.
RENDER_CACHE_CHARS = 8_000_000
_TEMPLATE_ERRORS = (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError)


@dataclass(frozen=True)
class Continuation:
    """Tokens to append after a parent turn's prompt + output to prompt for the new messages."""

    bridge_ids: list[int]
    delta_ids: list[int]

    @property
    def prompt_ids(self) -> list[int]:
        """What the store records as this turn's ``prompt_ids`` (``bridge_len`` = ``len(bridge_ids)``)."""
        return self.bridge_ids + self.delta_ids


def _native_message(msg: Mapping[str, Any]) -> Message:
    """A message as HF templates expect it: text content as a string, tool-call arguments as an object."""
    out = dict(msg)
    if isinstance(out.get("content"), list):
        out["content"] = text_of(out["content"])
    calls = out.get("tool_calls")
    if calls:
        prepared = []
        for call in calls:
            call = dict(call)
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    parsed = json.loads(fn["arguments"])
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict):
                    fn["arguments"] = parsed
            call["function"] = fn
            prepared.append(call)
        out["tool_calls"] = prepared
    return out


class ChatTemplate:
    """A tokenizer's chat template, with tools natively or in the Hermes format, and stitching."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; pass a tokenizer directory that has one")
        self.tokenizer = tokenizer
        # A rendering depends only on its inputs, unless the template reads the clock (HF's strftime_now:
        # today's date in the system prompt); such a template is rendered every time.
        self._renders: SizedLRU[bytes, str] | None = (
            None if "strftime_now" in str(tokenizer.chat_template) else SizedLRU(RENDER_CACHE_CHARS, min_entry=256))
        self.native_tools = self._detect_native_tools()
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self.end_of_turn_ids: list[int] = self._detect_end_of_turn()
        stops = set(self.end_of_turn_ids)
        if self.eos_token_id is not None:
            stops.add(self.eos_token_id)
        self.stop_token_ids: list[int] = sorted(stops)
        self._end_of_turn_text = self._added_token_text(self.end_of_turn_ids[0])
        self.splits_at_end_of_turn = self._detect_split()
        # Turns repeat from request to request (system prompt and tools, then every earlier turn), so with
        # a tokenizer that splits at end-of-turn each turn's text is tokenized once and then looked up.
        self._segment_ids = functools.lru_cache(maxsize=SEGMENT_CACHE_SIZE)(self._encode_packed)

    def cache_sizes(self) -> list[CacheSize]:
        """Renderings (by characters) and tokenized turn segments (by entries)."""
        segments = self._segment_ids.cache_info()
        out = [CacheSize("template_segments", segments.currsize, segments.currsize, segments.maxsize or 0)]
        if self._renders is not None:
            out.append(CacheSize("template_renders", len(self._renders), self._renders.size, self._renders.max_size))
        return out

    # ------------------------------------------------------------------------------------ rendering

    def _apply(self, messages: Sequence[Mapping[str, Any]], tools: Tools, generation_prompt: bool,
               cache: bool = True) -> str:
        """The template's text for ``messages``, through the render cache (keyed by the exact JSON of the
        inputs, key order kept: a template may print a tool's keys in order). ``cache=False`` for renderings
        that hold a turn's new messages or a whole history: they do not come back, and would only push
        out those that do (root prompts, stand-in conversations)."""
        if self._renders is None or not cache:
            return self._render(messages, tools, generation_prompt)
        try:
            key = orjson.dumps((messages, tools, generation_prompt))
        except TypeError:  # not plain JSON values (orjson.JSONEncodeError is a TypeError): not cached
            return self._render(messages, tools, generation_prompt)
        text = self._renders.get(key)
        if text is None:
            text = self._render(messages, tools, generation_prompt)
            self._renders.put(key, text, len(key) + len(text))
        return text

    def _render(self, messages: Sequence[Mapping[str, Any]], tools: Tools, generation_prompt: bool) -> str:
        # HF types messages as dict[str, str]; ours hold tool calls and parts too
        prepared: list[Any]
        tools_arg: list[Any] | None
        if self.native_tools:
            prepared = [_native_message(m) for m in messages]
            tools_arg = [dict(t) for t in tools] if tools else None
        else:
            prepared = to_hermes(messages, tools)
            tools_arg = None
        try:
            text = self.tokenizer.apply_chat_template(
                prepared, tools=tools_arg, add_generation_prompt=generation_prompt, tokenize=False
            )
        except _TEMPLATE_ERRORS as exc:  # the template refuses the conversation (raise_exception, bad shape)
            raise ChatFormatError(f"the model's chat template cannot render these messages: {exc}", "messages") from exc
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
        return text

    def _ids(self, messages: Sequence[Mapping[str, Any]], tools: Tools, generation_prompt: bool,
             cache: bool = True) -> list[int]:
        return self._tokens(self._apply(messages, tools, generation_prompt, cache))

    def _tokens(self, text: str) -> list[int]:
        """``encode(text)``, turn by turn through the segment cache when the tokenizer allows it."""
        eot = self._end_of_turn_text
        if not self.splits_at_end_of_turn or eot is None:
            return self._encode(text)
        ids: list[int] = []
        start = 0
        while start < len(text):
            cut = text.find(eot, start)
            end = len(text) if cut < 0 else cut + len(eot)
            if end - start > SEGMENT_CACHE_MAX_CHARS:
                ids.extend(self._encode(text[start:end]))
            else:
                ids.extend(self._segment_ids(text[start:end]))
            start = end
        return ids

    def render_text(self, messages: Sequence[Mapping[str, Any]], tools: Tools = None) -> str:
        """The prompt text of a root turn (with the generation prompt)."""
        return self._apply(messages, tools, True)

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Tools = None) -> list[int]:
        """The prompt ids of a root turn (with the generation prompt)."""
        return self._ids(messages, tools, True)

    # ------------------------------------------------------------------------------------ detection

    def _detect_native_tools(self) -> bool:
        """True if the template renders ``tools`` and assistant ``tool_calls`` itself."""
        tool = {
            "type": "function",
            "function": {"name": _PROBE_FN, "description": "probe", "parameters": {"type": "object", "properties": {}}},
        }
        call = {"id": "call_probe", "type": "function", "function": {"name": _PROBE_CALL_FN, "arguments": {}}}
        messages: list[Any] = [
            {"role": "user", "content": "probe"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ]
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=[tool], tokenize=False)
        except _TEMPLATE_ERRORS:
            return False
        return isinstance(text, str) and _PROBE_FN in text and _PROBE_CALL_FN in text

    def _detect_end_of_turn(self) -> list[int]:
        """The special token the template puts after an assistant message's content (``<|im_end|>``)."""
        messages = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": _PROBE_TEXT}]
        text = self._apply(messages, None, False)
        tail = text[text.rfind(_PROBE_TEXT) + len(_PROBE_TEXT) :]
        special = set(self.tokenizer.all_special_ids) | set(self.tokenizer.added_tokens_decoder)
        for token in self.tokenizer.encode(tail, add_special_tokens=False):
            if token in special:
                return [token]
        if self.eos_token_id is not None:
            return [self.eos_token_id]
        raise ValueError("cannot find the chat template's end-of-turn token (no special token after a reply, no EOS)")

    def _added_token_text(self, token: int) -> str | None:
        added = self.tokenizer.added_tokens_decoder.get(token)
        return None if added is None else str(added.content)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _encode_packed(self, text: str) -> array[int]:
        return array("i", self._encode(text))

    def _detect_split(self) -> bool:
        """True if text after an end-of-turn token tokenizes the same on its own as inside the whole text.

        Holds for tokenizers that cut added tokens out before BPE and add no prefix at the start of the
        input (SmolLM2's); then a continuation's delta is the tokens of the text after the parent's
        end-of-turn, and the long rendered history never has to be tokenized again.
        """
        if self._end_of_turn_text is None:
            return False
        history = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": " Hello, how can I help?"}]
        new = [{"role": "user", "content": "  two leading spaces\n\nand a blank line"}]
        try:
            before = self._apply(history, None, False)
            after = self._apply([*history, *new], None, True)
        except ChatFormatError:
            return False
        cut = before.rfind(self._end_of_turn_text)
        if cut < 0 or not after.startswith(before):
            return False
        cut += len(self._end_of_turn_text)
        return self._encode(after) == self._encode(after[:cut]) + self._encode(after[cut:])

    # ------------------------------------------------------------------------------------ stitching

    def _turn_end(self, ids: Sequence[int]) -> int:
        """Index of the last end-of-turn token in ``ids`` (-1 if none)."""
        for k in range(len(ids) - 1, -1, -1):
            if ids[k] in self.end_of_turn_ids:
                return k
        return -1

    def _stand_in(self, history: Sequence[Mapping[str, Any]]) -> list[Message]:
        """A short conversation shaped like ``history``: its leading system message, one user turn and an
        assistant turn with the same tool calls (templates may check tool results against them)."""
        head = [dict(history[0])] if len(history) > 1 and history[0].get("role") in ("system", "developer") else []
        assistant: Message = {"role": "assistant", "content": "."}
        if history[-1].get("tool_calls"):
            assistant["tool_calls"] = history[-1]["tool_calls"]
        return head + [{"role": "user", "content": "."}, assistant]

    def _cut(
        self, prefix: Sequence[Mapping[str, Any]], new_messages: Sequence[Mapping[str, Any]], tools: Tools
    ) -> tuple[int, list[int]] | str:
        """``(end-of-turn token, tokens after it)`` for ``new_messages`` after ``prefix``, or why not."""
        eot_text = self._end_of_turn_text
        if self.splits_at_end_of_turn and eot_text is not None:
            before_text = self._apply(prefix, tools, False)
            after_text = self._apply([*prefix, *new_messages], tools, True, cache=False)
            cut = before_text.rfind(eot_text)
            if not after_text.startswith(before_text):
                return "prefix_mismatch"
            if cut < 0:
                return "no_end_of_turn"
            return self.end_of_turn_ids[0], self._tokens(after_text[cut + len(eot_text) :])
        before = self._ids(prefix, tools, False)
        after = self._ids([*prefix, *new_messages], tools, True, cache=False)
        if after[: len(before)] != before:
            return "prefix_mismatch"
        k = self._turn_end(before)
        if k < 0:
            return "no_end_of_turn"
        return before[k], before[k + 1 :] + after[len(before) :]

    def _delta(
        self, history: Sequence[Mapping[str, Any]], new_messages: Sequence[Mapping[str, Any]], tools: Tools
    ) -> tuple[int, list[int]]:
        """The stand-in first, then the real history; :class:`TemplateDriftError` if neither can be cut."""
        reasons: list[str] = []
        try:
            result = self._cut(self._stand_in(history), new_messages, tools)
        except ChatFormatError:  # a template may refuse the stand-in (say, it checks the real history)
            result = "stand_in_refused"
        if isinstance(result, str):
            reasons.append(result)
            result = self._cut(history, new_messages, tools)  # a refusal here is the request's own fault
        if isinstance(result, str):
            reasons.append(result)
            raise TemplateDriftError(
                "the chat template does not render the new messages as a suffix of the conversation "
                f"({', '.join(reasons)})",
                result,
            )
        return result

    def continuation(
        self,
        history: Sequence[Mapping[str, Any]],
        new_messages: Sequence[Mapping[str, Any]],
        tools: Tools,
        parent_output_ids: Sequence[int],
        parent_finish_reason: str | None = None,
        *,
        delta: tuple[int, list[int]] | None = None,
    ) -> Continuation:
        """Tokens to append after the parent's exact prompt + output tokens.

        ``history`` is the parent's messages ending with its returned assistant message; ``new_messages``
        follow it. Raises :class:`ChatFormatError` if the template refuses the conversation.
        ``bridge_ids`` is the end-of-turn token when ``parent_output_ids`` does not end with
        one (cut by length, by a stop string, or an engine that drops the stop token); the decision is
        taken on the tokens, not on ``parent_finish_reason`` (a ``stop`` finish covers both a stop token
        and a stop string), which is accepted for logging only. Raises :class:`TemplateDriftError`.
        ``delta``: :meth:`delta` of the same messages and tools, computed earlier (nothing is rendered).
        """
        del parent_finish_reason  # the tokens decide, see the docstring
        end_of_turn, ids = delta if delta is not None else self.delta(history, new_messages, tools)
        ended = bool(parent_output_ids) and parent_output_ids[-1] in self.end_of_turn_ids
        return Continuation(bridge_ids=[] if ended else [end_of_turn], delta_ids=ids)

    def delta(
        self, history: Sequence[Mapping[str, Any]], new_messages: Sequence[Mapping[str, Any]], tools: Tools
    ) -> tuple[int, list[int]]:
        """``(end-of-turn token, tokens after it)`` of ``new_messages`` after ``history`` (ending with the
        parent's assistant message): what :meth:`continuation` appends, whatever the parent's tokens.
        Raises :class:`TemplateDriftError`, :class:`ChatFormatError`."""
        if not history or history[-1].get("role") != "assistant":
            raise ValueError("history must end with the parent's assistant message")
        return self._delta(history, new_messages, tools)

    def drift(
        self,
        parent_full_ids: Sequence[int],
        history_messages: Sequence[Mapping[str, Any]],
        tools: Tools,
        new_messages: Sequence[Mapping[str, Any]] | None = None,
    ) -> bool:
        """True if the template's re-render of ``history_messages`` differs from the stitched tokens.

        ``parent_full_ids`` is the parent's full sequence (all ancestors' prompts and outputs) and
        ``history_messages`` ends with its assistant message. The history is rendered as the history of
        a later turn (followed by ``new_messages``, default a stand-in user message), because templates
        that rewrite history (strip earlier reasoning) only do so once a turn is no longer the last.
        Drift = that rendering does not start with ``parent_full_ids`` (+ the bridge token when the
        parent's output has no end-of-turn). Causes: such a template, or a model output that does not
        tokenize canonically. The stitched prompt is right either way; the server counts this.
        """
        if not parent_full_ids:
            return True
        following = list(new_messages) if new_messages else [{"role": "user", "content": "."}]
        rendered = self._ids([*history_messages, *following], tools, False, cache=False)
        stitched = list(parent_full_ids)
        if stitched[-1] not in self.end_of_turn_ids:
            stitched.append(self.end_of_turn_ids[0])
        return rendered[: len(stitched)] != stitched
