"""``tools`` and ``tool_choice`` of any JSON shape get a 400 naming the field, never a 500, in all three wire
formats (issue 36: ``"tools": 5`` on the chat route raised ``TypeError`` in ``gateway/constraints.py``, which
runs before the chat layer's validation). Raw HTTP bodies, since the SDKs would not send these shapes."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gateway.test_openai_inprocess import (  # noqa: F401  (fixtures)
    TOOLS,
    interactions,
    make_gw,
    tokenizer,
)
from tests.gateway.test_responses import FN_TOOL

NOT_LISTS: list[Any] = [5, 0, 2.5, True, False, "get_weather", {"type": "function"}]
BAD_CHOICES: list[Any] = [5, True, 1.5, "sometimes", [], ["auto"], {"type": 5}, {"type": "function"},
                          {"type": "function", "function": 5}, {"type": "function", "function": {"name": 5}}]


def _is_400_naming(resp: Any, param: str) -> None:
    assert resp.status_code == 400, (resp.status_code, resp.text)
    body = resp.json()
    error = body.get("error", body)
    assert isinstance(error, dict) and param in str(error.get("param") or error.get("message")), body


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_tools_and_tool_choice_of_any_shape_are_400_naming_them(make_gw: Any, stream: bool) -> None:
    async with make_gw(["a"] * 4) as gw:
        sess = await gw.session()
        base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": stream}
        for tools in NOT_LISTS + [[5], [{"type": "function", "function": 5}]]:
            for choice in (None, "auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
                resp = await gw.post("/v1/chat/completions", {**base, "tools": tools, "tool_choice": choice},
                                     key=sess["api_key"])
                _is_400_naming(resp, "tools")
        for choice in BAD_CHOICES:
            resp = await gw.post("/v1/chat/completions", {**base, "tools": TOOLS, "tool_choice": choice},
                                 key=sess["api_key"])
            _is_400_naming(resp, "tool_choice")
        assert await interactions(gw, sess["session_id"]) == []
        assert gw.engine.generate_calls == 0


async def test_responses_and_messages_tools_and_tool_choice_of_any_shape_are_400(make_gw: Any) -> None:
    async with make_gw(["a"] * 4) as gw:
        sess = await gw.session()
        responses = {"model": "m", "input": "hi", "max_output_tokens": 2}
        messages = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        for tools in NOT_LISTS + [[5]]:
            _is_400_naming(await gw.post("/v1/responses", {**responses, "tools": tools}, key=sess["api_key"]),
                           "tools")
            _is_400_naming(await gw.post("/v1/messages", {**messages, "tools": tools}, key=sess["api_key"]),
                           "tools")
        for choice in BAD_CHOICES:
            _is_400_naming(await gw.post("/v1/responses", {**responses, "tools": [FN_TOOL], "tool_choice": choice},
                                         key=sess["api_key"]), "tool_choice")
            _is_400_naming(await gw.post("/v1/messages", {**messages, "tool_choice": choice}, key=sess["api_key"]),
                           "tool_choice")
        assert await interactions(gw, sess["session_id"]) == []
        assert gw.engine.generate_calls == 0
