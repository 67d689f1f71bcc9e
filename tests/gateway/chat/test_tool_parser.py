"""Tool calls out of model text, whole and streamed (gateway.chat.tool_parser)."""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable

import pytest

from gateway.chat import (
    ContentDelta,
    StreamingToolParser,
    ToolCallDelta,
    new_call_id,
    parse_tool_calls,
    tool_parsing_enabled,
)
from gateway.chat.tool_parser import ToolCall


def ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def call(i: int, name: str, arguments: str) -> ToolCall:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}


PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ROME = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


def test_plain_text_has_no_calls() -> None:
    assert parse_tool_calls("The answer is 4.", ids()) == ("The answer is 4.", [])
    assert parse_tool_calls("  spaced out \n", ids()) == ("spaced out", [])
    assert parse_tool_calls("", ids()) == ("", [])
    assert parse_tool_calls("a < b and <tool c", ids()) == ("a < b and <tool c", [])


def test_single_call() -> None:
    assert parse_tool_calls(PARIS, ids()) == (None, [call(0, "get_weather", '{"city": "Paris"}')])


def test_parallel_calls_all_returned_in_order() -> None:
    content, calls = parse_tool_calls(PARIS + "\n" + ROME, ids())
    assert content is None
    assert calls == [call(0, "get_weather", '{"city": "Paris"}'), call(1, "get_weather", '{"city": "Rome"}')]


def test_content_around_calls() -> None:
    text = "Let me check both.\n" + PARIS + "\nand\n" + ROME + "\n"
    content, calls = parse_tool_calls(text, ids())
    assert content == "Let me check both.\n\nand"
    assert len(calls) == 2


def test_whitespace_tolerance_and_compact_json() -> None:
    text = '<tool_call>   {"name":"add","arguments":{"a":1,"b":[2,3]}}\t\n\n</tool_call>'
    assert parse_tool_calls(text, ids()) == (None, [call(0, "add", '{"a": 1, "b": [2, 3]}')])


def test_arguments_variants() -> None:
    # arguments given as a JSON string are kept verbatim; "parameters" is accepted; missing means {}
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\":1}"}</tool_call>', ids())[1] == [
        call(0, "f", '{"x":1}')
    ]
    assert parse_tool_calls('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', ids())[1] == [
        call(0, "f", '{"x": 1}')
    ]
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>', ids())[1] == [call(0, "f", "{}")]
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {"city": "Zürich"}}</tool_call>', ids())[1] == [
        call(0, "f", '{"city": "Zürich"}')
    ]


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',  # missing brace
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": 3}</tool_call>',
        "<tool_call>[1, 2]</tool_call>",
    ],
)
def test_invalid_block_stays_in_content(block: str) -> None:
    content, calls = parse_tool_calls("Trying: " + block + " " + PARIS, ids())
    assert content == "Trying: " + block
    assert calls == [call(0, "get_weather", '{"city": "Paris"}')]


def test_unclosed_last_block() -> None:
    # the model stopped right after the JSON: still a call
    assert parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {}}\n', ids()) == (None, [call(0, "f", "{}")])
    # cut in the middle of the JSON (max_tokens): content
    assert parse_tool_calls('Sure <tool_call>\n{"name": "f", "argu', ids()) == ('Sure <tool_call>\n{"name": "f", "argu', [])


def test_default_ids_are_openai_shaped_and_unique() -> None:
    _, calls = parse_tool_calls(PARIS + ROME)
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    assert new_call_id() != new_call_id()


def test_tool_parsing_enabled() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert tool_parsing_enabled(tools, None)
    assert tool_parsing_enabled(tools, "auto")
    assert tool_parsing_enabled(tools, "required")
    assert tool_parsing_enabled(tools, {"type": "function", "function": {"name": "f"}})
    assert not tool_parsing_enabled(tools, "none")
    assert not tool_parsing_enabled(None, "auto")
    assert not tool_parsing_enabled([], None)


# ---------------------------------------------------------------------------------------------- streaming


def stream(chunks: list[str]) -> tuple[str | None, list[ToolCall], list[ContentDelta | ToolCallDelta]]:
    parser = StreamingToolParser(ids())
    events = [e for chunk in chunks for e in parser.feed(chunk)] + parser.finish()
    text = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = [e.call for e in events if isinstance(e, ToolCallDelta)]
    assert [e.index for e in events if isinstance(e, ToolCallDelta)] == list(range(len(calls)))
    assert all(isinstance(e, ToolCallDelta) or e.text for e in events)  # no empty content deltas
    return (None if not text and calls else text), calls, events


TEXTS = [
    "The answer is 4.",
    "  padded  \n",
    PARIS,
    PARIS + "\n" + ROME,
    "Let me check both.\n" + PARIS + "\nand\n" + ROME + "\n",
    "Trying: <tool_call>not json</tool_call> then " + PARIS + " done",
    '<tool_call>\n{"name": "f", "arguments": {}}\n',
    'Sure <tool_call>\n{"name": "f", "argu',
    "a < b, <tool c, <tool_cal",
    "x <tool_call" + PARIS,
]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_whole_parse_for_every_split(text: str) -> None:
    whole = parse_tool_calls(text, ids())
    assert stream([text])[:2] == whole
    assert stream(list(text))[:2] == whole  # one character at a time
    for cut in range(1, len(text)):
        assert stream([text[:cut], text[cut:]])[:2] == whole, cut
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(4, len(text) - 1)))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert stream(chunks)[:2] == whole, chunks


def test_stream_releases_content_immediately_and_holds_tag_prefixes() -> None:
    parser = StreamingToolParser(ids())
    assert parser.feed("Hello wor") == [ContentDelta("Hello wor")]
    assert parser.feed("ld <tool") == [ContentDelta("ld")]  # " <tool" could start a block
    assert parser.feed("_call>\n{\"name\": \"f\", ") == []
    assert parser.feed('"arguments": {"x": 1}}\n</tool_call>') == [ToolCallDelta(0, call(0, "f", '{"x": 1}'))]
    assert parser.feed(" and more") == [ContentDelta("  and more")]  # the held space comes out before text
    assert parser.feed("<tooltip>") == [ContentDelta("<tooltip>")]
    assert parser.finish() == []
