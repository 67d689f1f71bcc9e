"""The wire formats' pure parts: Responses input items -> chat messages, Messages blocks <-> chat messages,
and the thinking split, streamed in any chunking, equal to the split of the whole text."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.chat.normalize import normalize_message
from gateway.errors import InvalidRequest
from gateway.formats import messages as msgs_fmt
from gateway.formats import responses as resp_fmt
from gateway.service import ChoiceRun

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def test_function_calls_join_the_assistant_message_they_follow() -> None:
    fc = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": 1}', "id": "fc_x",
          "status": "completed"}
    text = {"type": "message", "role": "assistant", "id": "msg_x", "status": "completed",
            "content": [{"type": "output_text", "text": "Let me check.", "annotations": [], "logprobs": []}]}
    out = resp_fmt.input_messages([{"role": "user", "content": "q"}, text, fc], [])
    assert out[1] == {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]}
    # text streamed after the calls, and calls alone
    out = resp_fmt.input_messages([{"role": "user", "content": "q"}, fc, text], [])
    assert out[1] == {"role": "assistant", "tool_calls": [CALL], "content": "Let me check."}
    out = resp_fmt.input_messages([{"role": "user", "content": "q"}, fc], [])
    assert out[1] == {"role": "assistant", "tool_calls": [CALL]}
    # two assistant messages in a row stay two
    assert len(resp_fmt.input_messages([text, text], [])) == 2


def test_responses_output_items_come_back_as_the_returned_message() -> None:
    returned = {"role": "assistant", "content": "Sure.", "tool_calls": [CALL]}
    items = resp_fmt.output_items("resp_abc", returned, "tool_calls", None, {})
    assert [i["type"] for i in items] == ["message", "function_call"] and items[1]["call_id"] == "call_1"
    back = resp_fmt.input_messages([{"role": "user", "content": "q"}, *items], [])[1]
    assert normalize_message(back) == normalize_message(returned)
    only_calls = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    items = resp_fmt.output_items("resp_abc", only_calls, "tool_calls", None, {})
    assert [i["type"] for i in items] == ["function_call"]
    back = resp_fmt.input_messages([{"role": "user", "content": "q"}, *items], [])[1]
    assert normalize_message(back) == normalize_message(only_calls)


def test_reasoning_items_are_kept_out_and_unknown_items_refused() -> None:
    dropped: list[str] = []
    out = resp_fmt.input_messages([{"type": "reasoning", "id": "rs_1", "summary": []},
                                   {"role": "user", "content": "q"}], dropped)
    assert out == [{"role": "user", "content": "q"}] and len(dropped) == 1
    with pytest.raises(InvalidRequest) as err:
        resp_fmt.input_messages([{"type": "web_search_call", "id": "ws"}], [])
    assert err.value.param == "input[0].type"


@pytest.mark.parametrize("content", [
    "plain answer", "<think>reason</think>answer", "<think>reason</think>", "<think></think>x",
    "<think>never closed", "<think>a</think>b</think>c", "<thin", "text <think>not leading</think>", "",
])
def test_thinking_split_is_invertible_and_blocks_round_trip(content: str) -> None:
    thinking, text, closed = msgs_fmt.split_thinking(content)
    if thinking is None:
        assert text == content
    else:
        assert "<think>" + thinking + ("</think>" if closed else "") + text == content
    returned = {"role": "assistant", "content": content}
    blocks = msgs_fmt.content_blocks(returned)
    back = msgs_fmt._assistant(blocks, "messages[1].content", [])
    assert normalize_message(back) == normalize_message(returned)


def _streamed_blocks(content: str, step: int) -> list[tuple[str, str, str]]:
    req = msgs_fmt.MessagesRequest(max_tokens=5, messages=[{"role": "user", "content": "q"}])
    stream = msgs_fmt.MessageStream(req, ChoiceRun(0, "msg_x", None, None), 0, "m", None)  # type: ignore[arg-type]
    raw: list[bytes] = []
    pieces = [content[i:i + step] for i in range(0, len(content), step)] or [""]
    for k, piece in enumerate(pieces):
        raw += stream._text(piece, final=k == len(pieces) - 1)
    raw += stream._close()
    blocks: list[list[str]] = []
    for chunk in raw:
        data = json.loads(chunk.decode().split("data: ", 1)[1])
        if data["type"] == "content_block_start":
            blocks.append([data["content_block"]["type"], "", ""])
        elif data["type"] == "content_block_delta":
            delta: dict[str, Any] = data["delta"]
            if delta["type"] == "signature_delta":
                blocks[-1][2] = delta["signature"]
            else:
                blocks[-1][1] += delta.get("text", delta.get("thinking", ""))
    return [(kind, text, sig) for kind, text, sig in blocks]


@pytest.mark.parametrize("content", ["plain answer", "<think>reason</think>answer", "<think>reason</think>",
                                     "<think>never closed", "<thi", "<think>a</thin", "<think>a</think></think>"])
@pytest.mark.parametrize("step", [1, 2, 3, 7, 100])
def test_streamed_thinking_equals_the_plain_blocks(content: str, step: int) -> None:
    plain = [(b["type"], b.get("text", b.get("thinking", "")), b.get("signature", ""))
             for b in msgs_fmt.content_blocks({"role": "assistant", "content": content})]
    assert _streamed_blocks(content, step) == plain


def test_messages_blocks_to_chat() -> None:
    req = msgs_fmt.MessagesRequest.model_validate({
        "max_tokens": 5, "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "text", "text": "ok"},
                                              {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "r",
                                          "is_error": True}, {"type": "text", "text": "and?"}]},
            {"role": "system", "content": "late system"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}, {"type": "web_search_20250305", "name": "w"}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    conv = msgs_fmt.to_conversation(req, reject_unsupported=False)
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "tool", "user", "system"]
    assert normalize_message(conv.messages[2]) == normalize_message(
        {"role": "assistant", "content": "ok", "tool_calls": [CALL]})
    assert conv.tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert (conv.tool_choice, conv.parallel_tool_calls) == ("required", False) and len(conv.dropped) == 1
    with pytest.raises(InvalidRequest) as err:
        msgs_fmt.to_conversation(req, reject_unsupported=True)
    assert err.value.param == "tools[1].type" and err.value.code == "unsupported_tool"
