"""Responses and Messages over real sockets: a gateway process over the tiny embedded engine process
(random weights: free text), the real ``openai`` and ``anthropic`` SDKs streaming from it, and client shapes
as Codex-style and Claude-Code-style CLIs send them."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

from tests.gateway.conftest import GatewayProc
from tests.gateway.test_processes import read_turns


@pytest.mark.slow
def test_codex_and_claude_code_shaped_streams_record_and_link(gateway: GatewayProc) -> None:
    oai = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=gateway.agent_key, max_retries=0)
    tools: list[Any] = [
        {"type": "function", "name": "shell", "description": "run a command", "strict": False,
         "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                        "required": ["command"]}},
        {"type": "custom", "name": "apply_patch", "description": "patch files",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
        {"type": "web_search"}]
    history: list[Any] = [{"type": "message", "role": "developer", "content": [
                               {"type": "input_text", "text": "You are a coding agent."}]},
                          {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls"}]}]
    ids = []
    for turn in range(2):
        with oai.responses.stream(model="tiny", instructions="Be brief.", input=history, tools=tools,
                                  tool_choice="auto", parallel_tool_calls=False, store=False,
                                  reasoning={"effort": "medium", "summary": "auto"},
                                  include=["reasoning.encrypted_content"], prompt_cache_key="thread-1",
                                  max_output_tokens=8, temperature=1.0) as stream:
            events = list(stream)
        # a turn cut by max_output_tokens ends with response.incomplete (the SDK's get_final_response
        # then raises, as it does against OpenAI), so take the last event's response
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert events[-1].type in ("response.completed", "response.incomplete")
        final = events[-1].response
        assert final.output_text == text and final.status == events[-1].type.split(".")[1]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        ids.append(final.id)
        history += [o.model_dump(exclude_none=True) for o in final.output]
        history.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"go {turn}"}]})
    first, second = read_turns(gateway.db, ids)
    assert second.parent_id == first.id and len(first.request["dropped"]) == 2

    claude = anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.agent_key, max_retries=0)
    system: Any = [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
    tool = {"name": "Bash", "description": "run", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
    messages: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "ls",
                                                         "cache_control": {"type": "ephemeral"}}]}]
    msg_ids = []
    for turn in range(2):
        with claude.messages.stream(model="tiny", max_tokens=8, system=system, messages=messages, tools=[tool],
                                    metadata={"user_id": "u1"}, extra_body={"temperature": 1.0, "top_k": 40},
                                    extra_headers={"anthropic-beta": "claude-code-20250219"}) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")
        assert "".join(b.text for b in final.content if b.type == "text") == text
        msg_ids.append(final.id)
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
                     {"role": "user", "content": f"go {turn}"}]
    first, second = read_turns(gateway.db, msg_ids)
    assert second.parent_id == first.id and first.request["format"] == "messages"
