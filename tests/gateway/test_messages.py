"""``POST /v1/messages`` driven by the real ``anthropic`` SDK (in-process gateway, stand-in engine, SQLite);
also formats mixed within one conversation."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx2
import pytest

from tests.gateway.test_openai_inprocess import (  # noqa: F401  (fixtures)
    ADMIN,
    AGENT,
    CALL_PARIS,
    CALL_ROME,
    TOOLS,
    Gw,
    assistant,
    make_gw,
    tokenizer,
)
from tests.gateway.test_responses import FN_TOOL, INSTRUCTIONS, chat_conversation, rows, same_rows

WEATHER = {"name": "get_weather", "description": "weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def claude(gw: Gw, key: str = AGENT, base: str = "", bearer: bool = False) -> anthropic.AsyncAnthropic:
    """The real SDK over ASGI (it speaks ``httpx2``, not ``httpx``)."""
    auth: dict[str, Any] = {"auth_token": key} if bearer else {"api_key": key}
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=gw.app), timeout=30)
    return anthropic.AsyncAnthropic(base_url=f"http://gw{base}", http_client=http, max_retries=0, **auth)


def sent_back(message: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]}


async def test_tool_use_round_trip_links_and_exports_like_chat(make_gw: Any) -> None:
    async with make_gw([CALL_PARIS, "It is sunny in Paris.", "You are welcome!"] * 2) as gw:
        sess = await gw.session()
        client = claude(gw, key=sess["api_key"])  # x-api-key with a session key
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
        m1 = await client.messages.create(model="m", max_tokens=64, system=INSTRUCTIONS, messages=msgs,
                                          tools=[WEATHER])
        assert m1.id.startswith("msg_") and m1.stop_reason == "tool_use" and m1.role == "assistant"
        (use,) = m1.content
        assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
        msgs += [sent_back(m1), {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "sunny"}]}]}]
        m2 = await client.messages.create(model="m", max_tokens=64, messages=msgs, tools=[WEATHER],
                                          system=[{"type": "text", "text": INSTRUCTIONS,
                                                   "cache_control": {"type": "ephemeral"}}])
        assert m2.stop_reason == "end_turn" and m2.content[0].text == "It is sunny in Paris."
        msgs += [sent_back(m2), {"role": "user", "content": "Thanks!"}]
        m3 = await client.messages.create(model="m", max_tokens=64, system=INSTRUCTIONS, messages=msgs,
                                          tools=[WEATHER], extra_headers={"anthropic-beta": "x-2026-01-01"})
        t1, t2, t3 = [await gw.store.get_interaction(interaction_id=m.id) for m in (m1, m2, m3)]
        assert (t1.parent_id, t2.parent_id, t3.parent_id) == (None, t1.id, t2.id)
        assert t3.request["format"] == "messages" and t1.session_id == sess["session_id"]
        assert m3.usage.input_tokens == len(await gw.store.full_sequence(interaction_id=t3.id)) - len(t3.output_ids)
        chat_session, _ = await chat_conversation(gw)
        same_rows(await rows(gw, sess["session_id"]), await rows(gw, chat_session))
        ok = await gw.post("/reward", {"response_id": m3.id, "reward": 1.0}, key=ADMIN)
        assert ok.status_code == 200 and ok.json()["response_id"] == m3.id


async def test_stream_with_thinking_matches_plain_and_links(make_gw: Any) -> None:
    reply = "<think>Paris is in France.</think>It is sunny."
    async with make_gw([reply, reply, "Bye!"]) as gw:
        client = claude(gw)
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "Weather?"}]
        plain = await client.messages.create(model="m", max_tokens=64, messages=msgs,
                                             thinking={"type": "enabled", "budget_tokens": 32})
        assert [b.type for b in plain.content] == ["thinking", "text"]
        assert plain.content[0].thinking == "Paris is in France." and plain.content[1].text == "It is sunny."
        kinds, deltas = [], []
        async with client.messages.stream(model="m", max_tokens=64, messages=msgs) as stream:
            async for event in stream:
                kinds.append(event.type)
                if event.type == "content_block_delta":
                    deltas.append(event.delta.type)
            final = await stream.get_final_message()
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in plain.content]
        assert final.stop_reason == "end_turn" and final.usage.output_tokens == plain.usage.output_tokens
        assert {"thinking_delta", "text_delta", "signature_delta"} <= set(deltas)
        raw = [k for k in kinds if k in ("message_start", "content_block_start", "content_block_stop",
                                         "message_delta", "message_stop")]
        assert raw == ["message_start", "content_block_start", "content_block_stop", "content_block_start",
                       "content_block_stop", "message_delta", "message_stop"]
        a, b = [await gw.store.get_interaction(interaction_id=m.id) for m in (plain, final)]
        for attr in ("prompt_ids", "output_ids", "response_message", "chain_hash"):
            assert getattr(a, attr) == getattr(b, attr), attr
        # the thinking block sent back restores the recorded message: the next turn links
        m3 = await client.messages.create(model="m", max_tokens=64,
                                          messages=msgs + [sent_back(final), {"role": "user", "content": "ok"}])
        t3 = await gw.store.get_interaction(interaction_id=m3.id)
        assert t3.parent_id == b.id and t3.root_reason is None
        # another model's thinking is kept out of the prompt
        foreign = {"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": "sig"},
                                                     {"type": "text", "text": "It is sunny."}]}
        m4 = await client.messages.create(model="m", max_tokens=8, messages=msgs + [foreign,
                                                                                  {"role": "user", "content": "ok"}])
        t4 = await gw.store.get_interaction(interaction_id=m4.id)
        assert any("thinking" in d for d in t4.request["dropped"])


async def test_streamed_parallel_tool_use_and_stop_reasons(make_gw: Any) -> None:
    async with make_gw([CALL_PARIS + "\n" + CALL_ROME, "one two three four five six", "alpha beta STOP gamma"]) as gw:
        client = claude(gw, bearer=True)  # Authorization: Bearer works too
        async with client.messages.stream(model="m", max_tokens=100, tools=[WEATHER],
                                          messages=[{"role": "user", "content": "Paris and Rome?"}]) as stream:
            deltas = [e.delta.type async for e in stream if e.type == "content_block_delta"]
            final = await stream.get_final_message()
        assert [b.input["city"] for b in final.content] == ["Paris", "Rome"] and final.stop_reason == "tool_use"
        assert deltas == ["input_json_delta", "input_json_delta"]
        cut = await client.messages.create(model="m", max_tokens=3, messages=[{"role": "user", "content": "count"}])
        assert cut.stop_reason == "max_tokens"
        stop = await client.messages.create(model="m", max_tokens=50, stop_sequences=["STOP"],
                                            messages=[{"role": "user", "content": "go"}])
        assert stop.stop_reason == "stop_sequence" and stop.stop_sequence == "STOP"
        assert stop.content[0].text == "alpha beta "


async def test_mixed_formats_link_in_one_conversation(make_gw: Any) -> None:
    async with make_gw([CALL_PARIS, "It is sunny in Paris.", "You are welcome!"]) as gw:
        sess = await gw.session()
        openai_client = gw.sdk(key=sess["api_key"])
        msgs: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS},
                                      {"role": "user", "content": "Weather in Paris?"}]
        r1 = await openai_client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=64)
        call = r1.choices[0].message.tool_calls[0]
        m2 = await claude(gw, key=sess["api_key"]).messages.create(
            model="m", max_tokens=64, system=INSTRUCTIONS, tools=[WEATHER], messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": "get_weather",
                                                   "input": json.loads(call.function.arguments)}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}])
        r3 = await openai_client.responses.create(model="m", instructions=INSTRUCTIONS, previous_response_id=m2.id,
                                                  input="Thanks!", tools=[FN_TOOL], max_output_tokens=64)
        t1, t2, t3 = [await gw.store.get_interaction(interaction_id=i) for i in (r1.id, m2.id, r3.id)]
        assert (t2.parent_id, t3.parent_id) == (t1.id, t2.id)
        assert [t.request.get("format") for t in (t1, t2, t3)] == [None, "messages", "responses"]


async def test_errors_in_anthropic_shape_count_tokens_head_and_beta(make_gw: Any) -> None:
    async with make_gw(["Hi."]) as gw:
        client = claude(gw)
        bad = [
            ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
            ({"max_tokens": 5, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
             "messages[0].content[0].type"),
            ({"max_tokens": 5, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
            ({"max_tokens": 5, "messages": []}, "messages"),
            ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "x"}},
             "tool_choice"),
        ]
        headers = {"x-api-key": AGENT, "anthropic-version": "2023-06-01"}
        for body, param in bad:
            resp = await gw.http.post("/v1/messages", json={"model": "m", **body}, headers=headers)
            assert resp.status_code == 400, (body, resp.text)
            assert resp.json()["type"] == "error"
            error = resp.json()["error"]
            assert error["type"] == "invalid_request_error" and param in error["message"], (body, error)
        with pytest.raises(anthropic.BadRequestError) as err:  # the SDK reads the shape
            await client.messages.create(model="m", **bad[1][0])  # type: ignore[arg-type]
        assert err.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        with pytest.raises(anthropic.AuthenticationError) as auth:
            await claude(gw, key="wrong").messages.create(model="m", max_tokens=5,
                                                          messages=[{"role": "user", "content": "hi"}])
        assert auth.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]

        msgs = [{"role": "user", "content": "Weather in Paris?"}]
        counted = await client.messages.count_tokens(model="m", system=INSTRUCTIONS, messages=msgs, tools=[WEATHER])
        m = await client.beta.messages.create(model="m", max_tokens=5, system=INSTRUCTIONS, messages=msgs,
                                              tools=[WEATHER])  # POST /v1/messages?beta=true
        assert counted.input_tokens == m.usage.input_tokens > 0
        assert (await gw.http.head("/")).status_code == 200
        # errors from the other routes keep OpenAI's shape
        resp = await gw.post("/v1/responses", {"input": 5})
        assert resp.status_code == 400 and "error" in resp.json() and "type" not in resp.json()


async def test_failures_before_and_after_the_stream_starts(make_gw: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import openai

    from gateway.store import errors as store_errors

    async with make_gw(["Hello there."]) as gw:
        sess = await gw.session()
        client, oai = claude(gw, key=sess["api_key"]), gw.sdk(key=sess["api_key"])
        msgs = [{"role": "user", "content": "hi"}]

        # the store fails when recording, after the stream started: the format's failure event
        async def broken(*_: Any, **__: Any) -> None:
            raise store_errors.StoreUnavailable("disk full")

        with monkeypatch.context() as patch:
            patch.setattr(gw.store, "record_interactions", broken)
            with pytest.raises(anthropic.APIStatusError) as err:
                async with client.messages.stream(model="m", max_tokens=20, messages=msgs) as stream:
                    async for _ in stream:
                        pass
            assert err.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
            async with oai.responses.stream(model="m", input="hi", max_output_tokens=20) as rstream:
                kinds = [e.type async for e in rstream]
            assert kinds[-1] == "response.failed" and "response.completed" not in kinds

        # engine down before any output: an HTTP error in each format's shape
        gw.engine.down = True
        with pytest.raises(anthropic.APIStatusError) as err:
            await client.messages.create(model="m", max_tokens=5, messages=msgs, stream=True)
        assert err.value.status_code == 503
        assert err.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        with pytest.raises(anthropic.APIStatusError):
            await client.messages.create(model="m", max_tokens=5, messages=msgs)
        with pytest.raises(openai.InternalServerError) as oerr:
            await oai.responses.create(model="m", input="hi", stream=True)
        assert oerr.value.status_code == 503 and oerr.value.body["code"] == "engine_unavailable"  # type: ignore[index]
        assert await gw.store.session_interactions(session_id=sess["session_id"]) == []
