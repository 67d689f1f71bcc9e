"""``POST /v1/responses`` driven by the real ``openai`` SDK (in-process gateway, stand-in engine, SQLite store).

Every follow-up turn must link to its parent, and the exported row must be token-identical to the same
conversation sent through chat completions.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import openai
import pytest

from agentrl.trajectory import export_session, turn_from_interaction
from tests.gateway.test_openai_inprocess import (  # noqa: F401  (fixtures)
    ADMIN,
    CALL_PARIS,
    CALL_ROME,
    TOOLS,
    Gw,
    assistant,
    make_gw,
    tokenizer,
)

FN_TOOL = {"type": "function", "name": "get_weather", "description": "weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
INSTRUCTIONS = "You are helpful."


def items(output: list[Any]) -> list[dict[str, Any]]:
    """Output items as a store:false client sends them back."""
    return [o.model_dump(exclude_none=True) for o in output]


async def rows(gw: Gw, session_id: str) -> list[Any]:
    turns = await gw.store.session_interactions(session_id=session_id)
    return export_session([turn_from_interaction(t) for t in turns], mode="concat", gamma=1.0)


async def chat_conversation(gw: Gw) -> tuple[str, list[str]]:
    """The reference: the same three-turn tool conversation through chat completions."""
    sess = await gw.session()
    client = gw.sdk(key=sess["api_key"])
    msgs: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS},
                                  {"role": "user", "content": "Weather in Paris?"}]
    ids = []
    r1 = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=64)
    call = r1.choices[0].message.tool_calls[0]
    msgs += [assistant(r1.choices[0].message), {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r2 = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=64)
    msgs += [assistant(r2.choices[0].message), {"role": "user", "content": "Thanks!"}]
    r3 = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=64)
    ids = [r1.id, r2.id, r3.id]
    return sess["session_id"], ids


def same_rows(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b) == 1
    for name in ("input_ids", "loss_mask", "logprobs", "versions", "turn_ids"):
        assert np.array_equal(getattr(a[0], name), getattr(b[0], name)), name


async def test_store_false_history_links_and_exports_like_chat(make_gw: Any) -> None:
    async with make_gw([CALL_PARIS, "It is sunny in Paris.", "You are welcome!"] * 2) as gw:
        sess = await gw.session()
        client = gw.sdk(key=sess["api_key"])
        history: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
        r1 = await client.responses.create(model="m", instructions=INSTRUCTIONS, input=history, tools=[FN_TOOL],
                                           max_output_tokens=64, store=False)
        assert r1.id.startswith("resp_") and r1.status == "completed"
        (call,) = r1.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
        history += items(r1.output) + [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
        r2 = await client.responses.create(model="m", instructions=INSTRUCTIONS, input=history, tools=[FN_TOOL],
                                           max_output_tokens=64, store=False)
        assert r2.output_text == "It is sunny in Paris."
        assert r2.output[0].type == "message" and r2.output[0].content[0].type == "output_text"
        history += items(r2.output) + [{"role": "user", "content": [{"type": "input_text", "text": "Thanks!"}]}]
        r3 = await client.responses.create(model="m", instructions=INSTRUCTIONS, input=history, tools=[FN_TOOL],
                                           max_output_tokens=64, store=False)
        assert r3.output_text == "You are welcome!"
        assert r3.usage is not None and r3.usage.output_tokens > 0
        t1, t2, t3 = [await gw.store.get_interaction(interaction_id=r.id) for r in (r1, r2, r3)]
        assert (t1.parent_id, t2.parent_id, t3.parent_id) == (None, t1.id, t2.id)
        assert t2.root_reason is None and t3.root_reason is None and t3.request["format"] == "responses"
        assert r3.usage.input_tokens == len(await gw.store.full_sequence(interaction_id=t3.id)) - len(t3.output_ids)

        chat_session, _ = await chat_conversation(gw)
        same_rows(await rows(gw, sess["session_id"]), await rows(gw, chat_session))


async def test_previous_response_id_chains_and_get_returns_the_turn(make_gw: Any) -> None:
    async with make_gw([CALL_PARIS, "It is sunny in Paris.", "You are welcome!"] * 2) as gw:
        client = gw.sdk()  # implicit mode: the previous response finds the episode
        r1 = await client.responses.create(model="m", instructions=INSTRUCTIONS, input="Weather in Paris?",
                                           tools=[FN_TOOL], max_output_tokens=64)
        call = r1.output[0]
        r2 = await client.responses.create(
            model="m", instructions=INSTRUCTIONS, previous_response_id=r1.id, tools=[FN_TOOL], max_output_tokens=64,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
        r3 = await client.responses.create(model="m", instructions=INSTRUCTIONS, previous_response_id=r2.id,
                                           input="Thanks!", tools=[FN_TOOL], max_output_tokens=64)
        t1, t2, t3 = [await gw.store.get_interaction(interaction_id=r.id) for r in (r1, r2, r3)]
        assert (t2.parent_id, t3.parent_id) == (t1.id, t2.id)
        assert t1.session_id == t2.session_id == t3.session_id
        assert r3.previous_response_id == r2.id

        got = await client.responses.retrieve(r2.id)
        assert got.id == r2.id and got.output_text == r2.output_text == "It is sunny in Paris."
        assert got.usage.input_tokens == r2.usage.input_tokens and got.output[0].id == r2.output[0].id
        got1 = await client.responses.retrieve(r1.id)
        assert got1.output[0].call_id == call.call_id and got1.output[0].id == call.id

        # the same conversation through chat completions gives the same row
        chat_session, _ = await chat_conversation(gw)
        same_rows(await rows(gw, t1.session_id), await rows(gw, chat_session))

        # rewards take resp_ ids
        ok = await gw.post("/reward", {"response_id": r3.id, "reward": 1.0}, key=ADMIN)
        assert ok.status_code == 200 and ok.json()["response_id"] == r3.id

        with pytest.raises(openai.NotFoundError) as err:
            await client.responses.create(model="m", previous_response_id="resp_nope", input="hi")
        assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve("resp_nope")


async def test_streaming_event_sequence_and_final_response(make_gw: Any) -> None:
    async with make_gw(["Hello there, how are you?", CALL_PARIS + "\n" + CALL_ROME]) as gw:
        client = gw.sdk()
        plain_text = ""
        async with client.responses.stream(model="m", input="hi", max_output_tokens=50,
                                           include=["message.output_text.logprobs"]) as stream:
            kinds, seqs = [], []
            async for event in stream:
                kinds.append(event.type)
                seqs.append(event.sequence_number)
                if event.type == "response.output_text.delta":
                    plain_text += event.delta
            final = await stream.get_final_response()
        assert seqs == list(range(len(seqs)))
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.completed"]
        assert plain_text == final.output_text == "Hello there, how are you?"
        logprobs = final.output[0].content[0].logprobs
        turn = await gw.store.get_interaction(interaction_id=final.id)
        assert [lp.logprob for lp in logprobs] == pytest.approx(turn.output_logprobs[: len(logprobs)])
        assert len(logprobs) == len(turn.output_ids) - 1  # all but the end-of-turn token

        # two function calls, streamed; the SDK's helper assembles them
        history: list[Any] = [{"role": "user", "content": "Weather in Paris and Rome?"}]
        async with client.responses.stream(model="m", input=history, tools=[FN_TOOL], max_output_tokens=100) as s:
            kinds = [event.type async for event in s]
            final = await s.get_final_response()
        calls = [o for o in final.output if o.type == "function_call"]
        assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]
        assert kinds.count("response.function_call_arguments.done") == 2
        assert kinds.count("response.output_item.done") == 2 and kinds[-1] == "response.completed"
        assert "response.output_text.delta" not in kinds


async def test_max_output_tokens_makes_an_incomplete_response(make_gw: Any) -> None:
    async with make_gw(["one two three four five six seven eight nine ten"]) as gw:
        client = gw.sdk()
        r = await client.responses.create(model="m", input="count", max_output_tokens=3)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        async with client.responses.stream(model="m", input="count", max_output_tokens=3) as stream:
            kinds = [event.type async for event in stream]
        assert kinds[-1] == "response.incomplete"


async def test_unsupported_tools_dropped_or_refused_and_reasoning_kept_out(make_gw: Any) -> None:
    hosted = [FN_TOOL, {"type": "web_search"}, {"type": "custom", "name": "apply_patch"},
              {"type": "namespace", "name": "fs", "description": "files", "tools": [
                  {"type": "function", "name": "read_file", "parameters": {"type": "object", "properties": {}}}]}]
    read_call = '<tool_call>\n{"name": "read_file", "arguments": {}}\n</tool_call>'
    async with make_gw([read_call, "ok"]) as gw:
        client = gw.sdk()
        r = await client.responses.create(model="m", input="read it", tools=hosted, max_output_tokens=64)
        (call,) = r.output
        assert call.name == "read_file" and call.namespace == "fs"
        turn = await gw.store.get_interaction(interaction_id=r.id)
        assert [t["function"]["name"] for t in turn.request["tools"]] == ["get_weather", "read_file"]
        assert len(turn.request["dropped"]) == 2
        reasoning = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think"}]}
        r2 = await client.responses.create(
            model="m", tools=hosted, max_output_tokens=64,
            input=[{"role": "user", "content": "read it"}, reasoning, *items(r.output),
                   {"type": "function_call_output", "call_id": call.call_id, "output": "data"}])
        t2 = await gw.store.get_interaction(interaction_id=r2.id)
        assert t2.parent_id == turn.id and "think" not in json.dumps(t2.request["messages"])
        assert any("reasoning" in d for d in t2.request["dropped"])
    async with make_gw(["x"], unsupported_tools="reject") as gw:
        with pytest.raises(openai.BadRequestError) as err:
            await gw.sdk().responses.create(model="m", input="hi", tools=hosted)
        assert err.value.body["param"] == "tools[1].type"  # type: ignore[index]
        assert err.value.body["code"] == "unsupported_tool"  # type: ignore[index]


async def test_bad_inputs_get_openai_errors_and_record_nothing(make_gw: Any) -> None:
    async with make_gw(["a"]) as gw:
        sess = await gw.session()
        bad = [
            ({"input": []}, "input"),
            ({"input": 5}, "input"),
            ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
             "input[0].content[0].type"),
            ({"input": [{"role": "wizard", "content": "hi"}]}, "input[0].role"),
            ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
            ({"input": "hi", "temperature": 3}, "temperature"),
            ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
            ({"input": "hi", "tool_choice": {"type": "web_search"}}, "tool_choice"),
            ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
             "messages[0].tool_call_id"),
        ]
        for body, param in bad:
            resp = await gw.post("/v1/responses", {"model": "m", **body}, key=sess["api_key"])
            assert resp.status_code == 400, (body, resp.text)
            error = resp.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param, (body, error)
        assert (await gw.post("/v1/responses", {"input": "hi"}, key="wrong")).status_code == 401
        assert await gw.store.session_interactions(session_id=sess["session_id"]) == []
