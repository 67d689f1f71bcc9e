"""Constraints the gateway does not enforce (structured output, forced tool calls) are refused (400, ``param`` set, nothing recorded), never
silently dropped, in all three wire formats, driven by the real ``openai`` and ``anthropic`` SDKs."""

from __future__ import annotations

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


async def _refused(call: Any, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await call
    err = info.value.body
    assert isinstance(err, dict) and err["param"] == param, err
    assert err["code"] == "unsupported_parameter" and "not enforced" in err["message"], err


async def test_chat_refuses_each_unenforced_constraint_and_records_nothing(make_gw: Any) -> None:
    async with make_gw(["a"] * 5) as gw:
        sess = await gw.session()
        client = gw.sdk(key=sess["api_key"])
        cases: list[tuple[dict[str, Any], str]] = [
            ({"response_format": {"type": "json_object"}}, "response_format"),
            ({"response_format": SCHEMA_FORMAT}, "response_format"),
            ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
            ({"tools": TOOLS, "tool_choice": NAMED}, "tool_choice"),
        ]
        for kwargs, param in cases:
            await _refused(client.chat.completions.create(model="m", messages=MSGS, max_tokens=2, **kwargs), param)
            await _refused(client.chat.completions.create(model="m", messages=MSGS, max_tokens=2, stream=True,
                                                          **kwargs), param)
        # the SDK's structured-output helper is refused too (it sends a json_schema response_format)
        await _refused(client.chat.completions.parse(model="m", messages=MSGS, max_tokens=2,
                                                     response_format=City), "response_format")
        # legacy completions: no insertion, no best_of (penalties are enforced: tests/gateway/test_penalties.py)
        await _refused(client.completions.create(model="m", prompt="hi", max_tokens=2, best_of=3), "best_of")
        await _refused(client.completions.create(model="m", prompt="hi", max_tokens=2, suffix="end"), "suffix")
        assert await interactions(gw, sess["session_id"]) == []
        # defaults are served: zero penalties, an empty bias, text format, auto / none, parallel calls allowed
        ok = await client.chat.completions.create(
            model="m", messages=MSGS, max_tokens=2, presence_penalty=0, frequency_penalty=0.0, logit_bias={},
            response_format={"type": "text"}, tools=TOOLS, tool_choice="auto", parallel_tool_calls=True,
            extra_body={"repetition_penalty": 1, "min_tokens": 0})
        assert ok.choices[0].message.content == "a"
        ok = await client.chat.completions.create(model="m", messages=MSGS, max_tokens=2, tool_choice="none",
                                                  tools=TOOLS)
        # parallel_tool_calls=false is accepted, not enforced (Codex-style clients always send it)
        ok = await client.chat.completions.create(model="m", messages=MSGS, max_tokens=2, tools=TOOLS,
                                                  parallel_tool_calls=False)
        assert ok.choices[0].message.content == "a"
        assert len(await interactions(gw, sess["session_id"])) == 3
        # out-of-range values are ordinary validation errors
        for kwargs, param in [({"presence_penalty": 3}, "presence_penalty"),
                              ({"logit_bias": {"x": 1}}, "logit_bias"),
                              ({"logit_bias": {"5": 101}}, "logit_bias"),
                              ({"response_format": {"type": "xml"}}, "response_format.type")]:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="m", messages=MSGS, max_tokens=2, **kwargs)
            body = info.value.body
            assert isinstance(body, dict) and body["param"] == param, body


async def test_responses_refuses_text_format_and_forced_tools(make_gw: Any) -> None:
    async with make_gw(["a"] * 3) as gw:
        sess = await gw.session()
        client = gw.sdk(key=sess["api_key"])
        fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA_FORMAT["json_schema"]["schema"]}
        await _refused(client.responses.create(model="m", input="hi", text={"format": fmt}), "text.format")
        await _refused(client.responses.create(model="m", input="hi", text={"format": {"type": "json_object"}}),
                       "text.format")
        await _refused(client.responses.parse(model="m", input="hi", text_format=City), "text.format")
        await _refused(client.responses.create(model="m", input="hi", tools=[FN_TOOL], tool_choice="required"),
                       "tool_choice")
        await _refused(client.responses.create(model="m", input="hi", tools=[FN_TOOL],
                                               tool_choice={"type": "function", "name": "get_weather"}),
                       "tool_choice")
        assert await interactions(gw, sess["session_id"]) == []
        ok = await client.responses.create(model="m", input="hi", text={"format": {"type": "text"}},
                                           max_output_tokens=2)
        assert ok.output_text == "a"
        ok = await client.responses.create(model="m", input="hi again", tools=[FN_TOOL], parallel_tool_calls=False,
                                           max_output_tokens=2)  # accepted, not enforced (Codex sends it)
        assert ok.output_text == "a"


async def test_messages_refuses_forced_tools_output_format_and_top_k(make_gw: Any) -> None:
    async with make_gw(["a"] * 3) as gw:
        sess = await gw.session()
        client = claude(gw, key=sess["api_key"])
        msgs: Any = [{"role": "user", "content": "hi"}]
        cases: list[dict[str, Any]] = [
            {"tools": [WEATHER], "tool_choice": {"type": "any"}},
            {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}},
            {"extra_body": {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}},
        ]
        for kwargs in cases:
            with pytest.raises(anthropic.BadRequestError) as info:
                await client.messages.create(model="m", max_tokens=2, messages=msgs, **kwargs)
            assert "not enforced" in str(info.value), kwargs
        assert await interactions(gw, sess["session_id"]) == []
        ok = await client.messages.create(model="m", max_tokens=2, messages=msgs, tools=[WEATHER],
                                          tool_choice={"type": "auto"})
        assert ok.content[0].type == "text"
        # top_k is enforced (sent to the engine as SGLang's top_k) and recorded, so export can refuse it
        ok = await client.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "k"}],
                                          extra_body={"top_k": 5})
        assert ok.content[0].type == "text"
        recorded = await interactions(gw, sess["session_id"])
        assert [t.request["params"].get("top_k") for t in recorded] == [None, 5]
