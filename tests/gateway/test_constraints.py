"""Output constraints (structured output, forced tool calls, regex / ebnf) are sent to the engine as SGLang's
grammar parameters and recorded, in all three wire formats; bad or contradictory ones are refused (400,
``param`` set, nothing recorded), never silently dropped. Driven by the real ``openai`` and ``anthropic`` SDKs
against the stand-in engine (which records what it was sent); the enforcement itself on the real engine is
``tests/gateway/test_structured.py``."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pydantic
import pytest

from tests.gateway.test_messages import WEATHER, claude
from tests.gateway.test_openai_inprocess import (  # noqa: F401  (fixtures)
    TOOLS,
    Gw,
    interactions,
    make_gw,
    tokenizer,
)
from tests.gateway.test_responses import FN_TOOL

MSGS = [{"role": "user", "content": "hi"}]
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "strict": True, "schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


class City(pydantic.BaseModel):
    city: str


async def _refused(call: Any, param: str, fragment: str = "") -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await call
    err = info.value.body
    assert isinstance(err, dict) and err["param"] == param, err
    assert fragment in err["message"], err


def _grammar(sampling: dict[str, Any]) -> tuple[str, str] | None:
    found = [(k, sampling[k]) for k in ("json_schema", "regex", "ebnf", "structural_tag") if k in sampling]
    assert len(found) <= 1, sampling
    return found[0] if found else None


async def test_chat_sends_each_constraint_as_sglangs_grammar_and_records_it(make_gw: Any) -> None:
    async with make_gw(['{"city": "Paris"}'] * 12) as gw:
        sess = await gw.session()
        client = gw.sdk(key=sess["api_key"])
        cases: list[tuple[dict[str, Any], str, str]] = [
            ({"response_format": {"type": "json_object"}}, "json_schema", "response_format"),
            ({"response_format": SCHEMA_FORMAT}, "json_schema", "response_format"),
            ({"extra_body": {"regex": "[a-z]+"}}, "regex", "regex"),
            ({"extra_body": {"ebnf": 'root ::= "a" | "b"'}}, "ebnf", "ebnf"),
            ({"tools": TOOLS, "tool_choice": "required"}, "ebnf", "tool_choice"),
            ({"tools": TOOLS, "tool_choice": NAMED, "parallel_tool_calls": False}, "ebnf", "tool_choice"),
            ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "ebnf", "response_format"),
        ]
        for kwargs, kind, origin in cases:
            for stream in (False, True):
                before = len(gw.engine.sampling)
                reply = await client.chat.completions.create(model="m", messages=MSGS, max_tokens=20,
                                                             stream=stream, **kwargs)
                if stream:
                    async for _ in reply:  # type: ignore[union-attr]
                        pass
                sent = _grammar(gw.engine.sampling[before])
                assert sent is not None and sent[0] == kind, (kwargs, sent)
        sent = [_grammar(p) for p in gw.engine.sampling]
        assert sent[0] == ("json_schema", '{"type": "object"}')  # what SGLang's own OpenAI server sends
        assert json.loads(sent[2][1]) == SCHEMA_FORMAT["json_schema"]["schema"]  # type: ignore[index]
        assert sent[4] == ("regex", "[a-z]+")
        required, named = sent[8][1], sent[10][1]  # type: ignore[index]
        assert 'get_weather' in required and "tool_call_block" in required  # one or more calls
        assert 'get_weather' in named and "tool_call_block" not in named  # exactly one call
        turns = await interactions(gw, sess["session_id"])
        assert [(t.request["params"]["grammar"]["kind"], t.request["params"]["grammar"]["origin"])
                for t in turns[::2]] == [(k, o) for _, k, o in cases]
        assert all(t.request["params"]["grammar"]["source"] == s[1] for t, s in zip(turns, sent))  # type: ignore[index]
        # unconstrained requests send no grammar and record none
        await client.chat.completions.create(model="m", messages=MSGS, max_tokens=2, response_format={"type": "text"},
                                             tools=TOOLS, tool_choice="auto", parallel_tool_calls=False)
        assert _grammar(gw.engine.sampling[-1]) is None
        assert "grammar" not in (await interactions(gw, sess["session_id"]))[-1].request["params"]


async def test_chat_refuses_bad_or_unenforceable_constraints_and_records_nothing(make_gw: Any) -> None:
    async with make_gw(["a"] * 5) as gw:
        sess = await gw.session()
        client = gw.sdk(key=sess["api_key"])
        bad: list[tuple[dict[str, Any], str, str]] = [
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
             "response_format.json_schema.schema", "not a JSON schema"),
            ({"extra_body": {"regex": "(unclosed"}}, "regex", "not a regular expression that compiles"),
            ({"extra_body": {"regex": "a", "ebnf": 'root ::= "a"'}}, "ebnf", "only one output constraint"),
            ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
             "not in tools"),
            ({"tools": TOOLS, "tool_choice": NAMED, "response_format": SCHEMA_FORMAT}, "tool_choice",
             "cannot be combined"),
        ]
        for kwargs, param, fragment in bad:
            for stream in (False, True):
                await _refused(client.chat.completions.create(model="m", messages=MSGS, max_tokens=2, stream=stream,
                                                              **kwargs), param, fragment)
        # legacy completions: no insertion, no best_of (penalties are enforced: tests/gateway/test_penalties.py)
        await _refused(client.completions.create(model="m", prompt="hi", max_tokens=2, best_of=3), "best_of")
        await _refused(client.completions.create(model="m", prompt="hi", max_tokens=2, suffix="end"), "suffix")
        await _refused(client.completions.create(model="m", prompt="hi", max_tokens=2, extra_body={"regex": "("}),
                       "regex")
        assert await interactions(gw, sess["session_id"]) == []
        assert gw.engine.generate_calls == 0
        # out-of-range values are ordinary validation errors
        for kwargs, param in [({"presence_penalty": 3}, "presence_penalty"),
                              ({"logit_bias": {"x": 1}}, "logit_bias"),
                              ({"logit_bias": {"5": 101}}, "logit_bias"),
                              ({"response_format": {"type": "xml"}}, "response_format.type")]:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="m", messages=MSGS, max_tokens=2, **kwargs)
            body = info.value.body
            assert isinstance(body, dict) and body["param"] == param, body


async def test_responses_maps_text_format_and_forced_tools(make_gw: Any) -> None:
    async with make_gw(['{"city": "Paris"}'] * 4) as gw:
        sess = await gw.session()
        client = gw.sdk(key=sess["api_key"])
        fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA_FORMAT["json_schema"]["schema"]}
        await client.responses.create(model="m", input="hi", text={"format": fmt})
        assert _grammar(gw.engine.sampling[-1]) == ("json_schema", json.dumps(fmt["schema"]))
        parsed = await client.responses.parse(model="m", input="hi again", text_format=City)
        assert parsed.output_parsed == City(city="Paris")
        await client.responses.create(model="m", input="tool", tools=[FN_TOOL], tool_choice="required")
        assert _grammar(gw.engine.sampling[-1])[0] == "ebnf"  # type: ignore[index]
        await _refused(client.responses.create(model="m", input="hi", text={"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "nope"}}}), "text.format.schema")
        await _refused(client.responses.create(model="m", input="hi", tools=[FN_TOOL],
                                               tool_choice={"type": "function", "name": "nope"}), "tool_choice")
        assert len(await interactions(gw, sess["session_id"])) == 3


async def test_messages_maps_forced_tools_output_format_and_top_k(make_gw: Any) -> None:
    async with make_gw(["a"] * 6) as gw:
        sess = await gw.session()
        client = claude(gw, key=sess["api_key"])
        msgs: Any = [{"role": "user", "content": "hi"}]
        cases: list[tuple[dict[str, Any], str]] = [
            ({"tools": [WEATHER], "tool_choice": {"type": "any"}}, "ebnf"),
            ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}, "ebnf"),
            ({"extra_body": {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}},
             "json_schema"),
        ]
        for kwargs, kind in cases:
            await client.messages.create(model="m", max_tokens=2, messages=msgs, **kwargs)
            assert _grammar(gw.engine.sampling[-1])[0] == kind, kwargs  # type: ignore[index]
        for kwargs, param in [({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
                              ({"extra_body": {"output_config": {"format": {"type": "json_schema",
                                                                             "schema": {"type": "nope"}}}}},
                               "output_config.format.schema")]:
            with pytest.raises(anthropic.BadRequestError) as info:
                await client.messages.create(model="m", max_tokens=2, messages=msgs, **kwargs)
            assert isinstance(info.value.body, dict) and param in str(info.value.body), info.value.body
        assert len(await interactions(gw, sess["session_id"])) == 3
        ok = await client.messages.create(model="m", max_tokens=2, messages=msgs, tools=[WEATHER],
                                          tool_choice={"type": "auto"})
        assert ok.content[0].type == "text"
        # top_k is enforced (sent to the engine as SGLang's top_k) and recorded, so export can refuse it
        ok = await client.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "k"}],
                                          extra_body={"top_k": 5})
        assert ok.content[0].type == "text"
        recorded = await interactions(gw, sess["session_id"])
        assert [t.request["params"].get("top_k") for t in recorded][-2:] == [None, 5]
