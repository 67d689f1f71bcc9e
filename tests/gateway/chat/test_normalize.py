"""Validation, normalisation and hash chains (gateway.chat.normalize)."""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessage

from gateway.chat import (
    ChatFormatError,
    chain_hash,
    chain_hashes,
    extend_chain,
    normalize_message,
    parent_candidates,
    tools_hash,
    validate_messages,
    validate_tool_choice,
)

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def convo() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]


# ------------------------------------------------------------------------------------------- validation


def test_valid_conversation_passes() -> None:
    validate_messages(convo(), TOOLS)
    validate_messages([{"role": "developer", "content": [{"type": "text", "text": "x"}]}, {"role": "user", "content": "y"}])


@pytest.mark.parametrize(
    ("messages", "param", "code"),
    [
        ([], "messages", "invalid_value"),
        ("hello", "messages", "invalid_type"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], "messages[1].role", "invalid_value"),
        ([{"content": "a"}], "messages[0].role", "invalid_value"),
        (["just text"], "messages[0]", "invalid_type"),
        ([{"role": "user"}], "messages[0].content", "missing_required_parameter"),
        ([{"role": "system", "content": None}], "messages[0].content", "missing_required_parameter"),
        ([{"role": "user", "content": 5}], "messages[0].content", "invalid_type"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0].type",
            "invalid_value",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text", "invalid_type"),
        # a tool result before any tool call, and one answering an id nobody issued
        ([{"role": "tool", "tool_call_id": "call_1", "content": "x"}], "messages[0].tool_call_id", "invalid_value"),
        (convo()[:3] + [{"role": "tool", "tool_call_id": "call_2", "content": "x"}], "messages[3].tool_call_id", "invalid_value"),
        (convo()[:3] + [{"role": "tool", "content": "x"}], "messages[3].tool_call_id", "missing_required_parameter"),
        (convo()[:3] + [{"role": "tool", "tool_call_id": "call_1"}], "messages[3].content", "missing_required_parameter"),
        ([{"role": "assistant", "tool_calls": {"id": "x"}}], "messages[0].tool_calls", "invalid_type"),
        ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
         "messages[0].tool_calls[0].id", "missing_required_parameter"),
        ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}],
         "messages[0].tool_calls[0].function", "missing_required_parameter"),
        ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"arguments": "{}"}}]}],
         "messages[0].tool_calls[0].function.name", "missing_required_parameter"),
        ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": 3}}]}],
         "messages[0].tool_calls[0].function.arguments", "invalid_type"),
        ([{"role": "assistant", "tool_calls": [CALL, CALL]}], "messages[0].tool_calls", "invalid_value"),
        ([{"role": "user", "content": "a", "name": 7}], "messages[0].name", "invalid_type"),
    ],
)
def test_invalid_messages(messages: Any, param: str, code: str) -> None:
    with pytest.raises(ChatFormatError) as info:
        validate_messages(messages, None)
    assert info.value.param == param
    assert info.value.code == code
    assert isinstance(info.value, ValueError)
    assert str(info.value)  # a readable message


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ({"type": "function"}, "tools"),
        ([{"type": "retrieval"}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
         "tools[1].function.name"),
    ],
)
def test_invalid_tools(tools: Any, param: str) -> None:
    with pytest.raises(ChatFormatError) as info:
        validate_messages([{"role": "user", "content": "hi"}], tools)
    assert info.value.param == param


def test_assistant_without_content_or_calls_is_accepted() -> None:
    # our own responses can have empty content; an SDK sends them back as content None
    validate_messages([{"role": "user", "content": "a"}, {"role": "assistant", "content": None}, {"role": "user", "content": "b"}])


# ---------------------------------------------------------------------------------------- normalisation


def test_sdk_round_trip_normalises_to_what_we_returned() -> None:
    returned = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"b": 1, "a": [1, 2]}'}}
        ],
    }
    sdk = ChatCompletionMessage.model_validate(returned)
    full_dump = sdk.model_dump()  # refusal/audio/annotations/function_call: None added by the SDK
    assert full_dump["refusal"] is None and "audio" in full_dump
    expected = {
        "role": "assistant",
        "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"a":[1,2],"b":1}'}}],
    }
    assert normalize_message(returned) == expected
    assert normalize_message(full_dump) == expected
    assert normalize_message(sdk.model_dump(exclude_unset=True)) == expected
    assert normalize_message(sdk.model_dump(exclude_none=True, mode="json")) == expected


def test_empty_defaults_dropped() -> None:
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": "Hi",
        "tool_calls": [],
        "function_call": None,
        "refusal": None,
        "audio": None,
        "annotations": [],
        "name": None,
    }
    assert normalize_message(msg) == {"role": "assistant", "content": "Hi"}


def test_assistant_empty_content_equals_missing() -> None:
    a = normalize_message({"role": "assistant", "content": "", "tool_calls": [CALL]})
    b = normalize_message({"role": "assistant", "content": None, "tool_calls": [CALL]})
    c = normalize_message({"role": "assistant", "tool_calls": [CALL]})
    assert a == b == c
    assert "content" not in a
    # a user's empty string is content, not a default
    assert normalize_message({"role": "user", "content": ""}) == {"role": "user", "content": ""}


def test_text_parts_collapse_to_string() -> None:
    msg = {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]}
    assert normalize_message(msg) == {"role": "user", "content": "Hello, world"}
    assert normalize_message({"role": "user", "content": []}) == {"role": "user", "content": ""}


def test_non_text_parts_are_kept_as_a_list() -> None:
    parts = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "u", "detail": None}}]
    assert normalize_message({"role": "user", "content": parts})["content"] == [
        {"type": "text", "text": "see"},
        {"type": "image_url", "image_url": {"url": "u", "detail": None}},  # nested values are left alone
    ]


def test_arguments_canonicalised_and_invalid_kept() -> None:
    def args(raw: object) -> object:
        msg = {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": raw}, "index": 0}]}
        out = normalize_message(msg)
        assert out["tool_calls"][0]["type"] == "function"  # default filled in
        assert "index" not in out["tool_calls"][0]  # streaming accumulators add it
        assert out["tool_calls"][0]["id"] == "c"
        return out["tool_calls"][0]["function"]["arguments"]

    assert args('{ "z": "é", "a": {"y": 2, "x": 1.5} }') == '{"a":{"x":1.5,"y":2},"z":"é"}'
    assert args({"b": 2, "a": 1}) == '{"a":1,"b":2}'
    assert args('{"city": "Par') == '{"city": "Par'  # invalid JSON: left as is
    assert args("") == ""


def test_normalize_is_pure_and_idempotent() -> None:
    msg = {"role": "assistant", "content": [{"type": "text", "text": "x"}], "tool_calls": [dict(CALL)], "refusal": None}
    before = copy.deepcopy(msg)
    once = normalize_message(msg)
    assert msg == before
    assert normalize_message(once) == once
    assert normalize_message(msg) == once


# ------------------------------------------------------------------------------------------ hash chains


def test_chain_hashes_by_hand() -> None:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "refusal": None}]
    h0 = hashlib.sha256(b'{"content":"hi","role":"user"}').hexdigest()
    h1 = hashlib.sha256(bytes.fromhex(h0) + b'{"content":"hello","role":"assistant"}').hexdigest()
    assert chain_hashes(msgs) == [h0, h1]
    assert chain_hash(msgs) == h1
    assert extend_chain(h0, msgs[1:]) == h1
    assert extend_chain("", msgs) == h1
    assert chain_hashes([]) == []
    with pytest.raises(ValueError):
        chain_hash([])


def test_chain_depends_on_order_and_content() -> None:
    a = {"role": "user", "content": "a"}
    b = {"role": "user", "content": "b"}
    assert chain_hash([a, b]) != chain_hash([b, a])
    assert chain_hash([a]) != chain_hash([b])
    assert chain_hashes([a, b])[0] == chain_hashes([a])[0]  # prefix hashes do not depend on what follows


def test_parent_lookup_matches_sdk_resend() -> None:
    request = convo()[:2]
    returned = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    stored_key = chain_hash(request + [returned])
    # the agent sends the turn back through the SDK (None fields, re-serialised arguments), plus a tool result
    resent = ChatCompletionMessage.model_validate(
        {"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]}
    ).model_dump()
    new_request = request + [resent, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    candidates = parent_candidates(new_request)
    assert candidates[0] == (3, stored_key)


def test_parent_candidates_longest_first_assistant_only() -> None:
    u = {"role": "user", "content": "q"}
    a = {"role": "assistant", "content": "r"}
    msgs = [{"role": "system", "content": "s"}, u, a, u, a, u]
    hashes = chain_hashes(msgs)
    assert parent_candidates(msgs) == [(5, hashes[4]), (3, hashes[2])]
    # the whole request is never its own parent; no assistant, no candidate
    assert parent_candidates([u, a]) == []
    assert parent_candidates([u]) == []


# ------------------------------------------------------------------------------------ tool_choice, tools


@pytest.mark.parametrize("choice", [None, "none", "auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_valid_tool_choice(choice: object) -> None:
    validate_tool_choice(choice, TOOLS)


@pytest.mark.parametrize(
    ("choice", "tools", "param"),
    [
        ("sometimes", TOOLS, "tool_choice"),
        ("required", None, "tool_choice"),
        ({"type": "function", "function": {"name": "other"}}, TOOLS, "tool_choice.function.name"),
        ({"type": "function"}, TOOLS, "tool_choice.function.name"),
        ({"type": "custom"}, TOOLS, "tool_choice"),
        (3, TOOLS, "tool_choice"),
    ],
)
def test_invalid_tool_choice(choice: object, tools: Any, param: str) -> None:
    with pytest.raises(ChatFormatError) as info:
        validate_tool_choice(choice, tools)
    assert info.value.param == param


def test_tools_hash() -> None:
    assert tools_hash(None) == tools_hash([]) == ""
    reordered = [{"function": {"parameters": {"type": "object"}, "name": "get_weather"}, "type": "function"}]
    assert tools_hash(TOOLS) == tools_hash(reordered)  # key order does not matter
    expected = hashlib.sha256(
        b'[{"function":{"name":"get_weather","parameters":{"type":"object"}},"type":"function"}]'
    ).hexdigest()
    assert tools_hash(TOOLS) == expected
    assert tools_hash(TOOLS) != tools_hash([{"type": "function", "function": {"name": "other"}}])


def test_lone_surrogates_are_rejected_with_their_path() -> None:
    import json

    messages = json.loads('[{"role": "user", "content": [{"type": "text", "text": "ok \\ud800"}]}]')
    with pytest.raises(ChatFormatError) as info:
        validate_messages(messages, None)
    assert info.value.param == "messages[0].content[0].text"
    tools = json.loads('[{"type": "function", "function": {"name": "f", "description": "\\udfff"}}]')
    with pytest.raises(ChatFormatError) as info:
        validate_messages([{"role": "user", "content": "hi"}], tools)
    assert info.value.param == "tools[0].function.description"
    # hashing never fails, even on unvalidated input
    assert len(chain_hash(messages)) == 64


def test_cached_links_of_plain_messages_equal_the_uncached_hash_chain() -> None:
    """Plain {role, content} messages take a cached path; the chain must be the one computed from scratch."""
    from gateway.chat import normalize

    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "héllo"},
            {"role": "assistant", "content": ""}, {"role": "user", "content": "x" * 9000},
            {"role": "assistant", "content": "ok", "tool_calls": []}, {"role": "user", "content": "again"},
            {"role": "tool", "content": "é" * 3000}]
    long_hits = normalize._long_links.hits
    for _ in range(2):  # the second pass is answered from the caches
        expected, previous = [], ""
        for msg in msgs:
            previous = normalize._link_uncached(previous, msg)
            expected.append(previous)
        assert chain_hashes(msgs) == expected
    assert normalize._plain_link.cache_info().hits >= 4
    assert normalize._long_links.hits == long_hits + 1  # the 3,000-character message


def test_long_message_links_are_bounded_by_characters() -> None:
    """The cache of long messages' links holds at most its budget of characters, oldest out first."""
    from gateway.chat import normalize

    cache = normalize._LinkCache(10_000, entry_chars=400)
    links = [cache("", "user", f"{i}" + "y" * 2999) for i in range(5)]  # 15,000 characters offered
    assert len(cache) == 3 and cache.chars == 9000  # the two oldest are gone
    assert cache("", "user", "2" + "y" * 2999) == links[2] and cache.hits == 1  # 2 is now the most recent
    cache("", "user", "5" + "y" * 2999)  # 12,000 > 10,000: the least recently used (3) goes
    assert len(cache) == 3 and cache.chars == 9000
    assert cache("", "user", "2" + "y" * 2999) == links[2] and cache.hits == 2  # kept
    assert cache("", "user", "3" + "y" * 2999) == links[3] and cache.hits == 2  # recomputed, not a hit
    cache("", "user", "z")  # a short one counts as 400
    assert cache.chars == 9400 and len(cache) == 4
    assert links[0] == normalize._link_uncached("", {"role": "user", "content": "0" + "y" * 2999})
