"""Structured outputs and forced tool calls, enforced: the real ``openai`` SDK (and LangChain, anthropic) ->
a gateway process -> the tiny embedded engine process, which samples under the grammar the gateway sends
(SGLang's native ``json_schema`` / ``structural_tag``). The tiny model has random weights: every reply that
parses here parses because the grammar forced it. Each turn records the grammar it was sampled under, and
export refuses such sessions for training (``docs/export.md``)."""

from __future__ import annotations

import json
from typing import Any, Literal

import openai
import pydantic
import pytest

from agentrl.trajectory import UntrainableSampling, export_session, turn_from_interaction
from tests.gateway.conftest import GatewayProc
from tests.gateway.test_processes import read_turns, sdk

pytestmark = pytest.mark.slow  # a gateway process per test over the shared tiny engine: ~30-90 s each here

MSGS: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                         "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "Time now", "parameters": {
        "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
        "additionalProperties": False}}},
]


class Verdict(pydantic.BaseModel):
    ok: bool
    label: Literal["cat", "dog"]


def test_parse_returns_a_parsed_object_and_the_turn_records_its_grammar(gateway: GatewayProc) -> None:
    sess = gateway.create_session()
    client = sdk(gateway, sess["api_key"])
    ids = []
    for seed in range(3):
        done = client.chat.completions.parse(model="tiny", messages=MSGS, response_format=Verdict, seed=seed,
                                             max_tokens=60)
        parsed = done.choices[0].message.parsed
        assert isinstance(parsed, Verdict), done.choices[0].message.content
        ids.append(done.id)
    plain = client.chat.completions.create(model="tiny", messages=MSGS, response_format={"type": "json_object"},
                                           seed=5, max_tokens=80, logprobs=True)
    assert plain.choices[0].finish_reason == "length" or isinstance(json.loads(plain.choices[0].message.content or ""), dict)
    turns = read_turns(gateway.db, [*ids, plain.id])
    grammar = turns[0].request["params"]["grammar"]
    assert grammar["kind"] == "json_schema" and grammar["origin"] == "response_format"
    assert json.loads(grammar["source"])["properties"]["label"]["enum"] == ["cat", "dog"]
    assert turns[-1].request["params"]["grammar"]["source"] == '{"type": "object"}'
    # the logprobs returned and recorded are the engine's (of the masked distribution), token for token
    assert [c.logprob for c in plain.choices[0].logprobs.content] == pytest.approx(  # type: ignore[union-attr]
        turns[-1].output_logprobs[: len(plain.choices[0].logprobs.content)], abs=1e-6)  # type: ignore[union-attr]
    with pytest.raises(UntrainableSampling, match="grammar"):
        export_session([turn_from_interaction(t) for t in turns[:1]])


def _calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_tool_choice_required_yields_a_parsed_call_on_every_turn(gateway: GatewayProc) -> None:
    sess = gateway.create_session()
    client = sdk(gateway, sess["api_key"])
    messages = list(MSGS)
    for turn in range(3):
        stream = turn % 2 == 1
        one = turn == 1  # parallel calls allowed: a random model may go on calling until max_tokens
        kwargs: dict[str, Any] = dict(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                      seed=turn, max_tokens=150, parallel_tool_calls=not one)
        if stream:
            calls: dict[int, Any] = {}
            finish = None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for delta in chunk.choices[0].delta.tool_calls or []:
                    calls.setdefault(delta.index, delta)
                finish = chunk.choices[0].finish_reason or finish
            found = [(c.function.name, json.loads(c.function.arguments)) for c in calls.values()]
            ids = [c.id for c in calls.values()]
        else:
            done = client.chat.completions.create(**kwargs)
            finish = done.choices[0].finish_reason
            found = _calls(done.choices[0].message)
            ids = [c.id for c in done.choices[0].message.tool_calls or []]
        assert found and finish in (("tool_calls",) if one else ("tool_calls", "length")), (turn, found, finish)
        assert len(found) == 1 or not one
        for name, args in found:
            assert name in ("get_weather", "get_time")
            assert set(args) == ({"city", "unit"} if name == "get_weather" else {"utc"})
        messages = messages + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                for i, (n, a) in zip(ids, found)]},
            *[{"role": "tool", "tool_call_id": i, "content": "sunny"} for i in ids]]
    # named function, one call only
    for stream in (False, True):
        kwargs = dict(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=80, seed=9, parallel_tool_calls=False,
                      tool_choice={"type": "function", "function": {"name": "get_time"}})
        if stream:
            names = [d.function.name for chunk in client.chat.completions.create(stream=True, **kwargs)
                     for d in chunk.choices[0].delta.tool_calls or [] if d.function and d.function.name]
        else:
            names = [n for n, _ in _calls(client.chat.completions.create(**kwargs).choices[0].message)]
        assert names == ["get_time"]


def test_langchain_with_structured_output(gateway: GatewayProc) -> None:
    from langchain_openai import ChatOpenAI

    sess = gateway.create_session()
    llm = ChatOpenAI(model="tiny", base_url=gateway.base_url + "/v1", api_key=sess["api_key"], max_tokens=60,
                     seed=3, max_retries=0, timeout=120)
    result = llm.with_structured_output(Verdict, method="json_schema").invoke("Is it a cat?")
    assert isinstance(result, Verdict)
    forced = llm.with_structured_output(Verdict, method="function_calling").invoke("Is it a dog?")
    assert isinstance(forced, Verdict)  # a named tool_choice: the call's arguments are the object


def test_responses_and_messages_enforce_their_fields(gateway: GatewayProc) -> None:
    import anthropic

    sess = gateway.create_session()
    client = sdk(gateway, sess["api_key"])
    parsed = client.responses.parse(model="tiny", input="Cat or dog?", text_format=Verdict, max_output_tokens=60)
    assert isinstance(parsed.output_parsed, Verdict)
    fn = {"type": "function", "name": "get_time", "parameters": TOOLS[1]["function"]["parameters"], "strict": True}
    forced = client.responses.create(model="tiny", input="time?", tools=[fn], tool_choice="required",  # type: ignore[list-item]
                                     parallel_tool_calls=False, max_output_tokens=80)
    assert [(item.type, getattr(item, "name", None)) for item in forced.output] == [("function_call", "get_time")]
    claude = anthropic.Anthropic(base_url=gateway.base_url, api_key=sess["api_key"], max_retries=0, timeout=120)
    tool = {"name": "get_time", "description": "Time now", "input_schema": TOOLS[1]["function"]["parameters"]}
    for choice in ({"type": "any", "disable_parallel_tool_use": True},
                   {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}):
        msg = claude.messages.create(model="tiny", max_tokens=60, tools=[tool], tool_choice=choice,  # type: ignore[arg-type]
                                     messages=[{"role": "user", "content": "time?"}])
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert uses and msg.stop_reason == "tool_use" and all(b.name == "get_time" for b in uses), msg.content
        assert isinstance(uses[0].input, dict) and set(uses[0].input) == {"utc"}


BAD: list[tuple[dict[str, Any], str]] = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"extra_body": {"regex": "([a-z"}}, "regex"),
    ({"extra_body": {"ebnf": "root ::= missing"}}, "ebnf"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "not_there"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "no-such-type"}}}}}], "tool_choice": "required"}, "tools[0].function.parameters"),
]


def test_bad_constraints_are_400s_with_param_and_record_nothing(gateway: GatewayProc) -> None:
    sess = gateway.create_session()
    client = sdk(gateway, sess["api_key"])
    for kwargs, param in BAD:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, stream=stream, **kwargs)
            body = info.value.body
            assert isinstance(body, dict) and body["param"] == param, (kwargs, body)
    tree = gateway.admin().get(f"/v1/sessions/{sess['session_id']}").json()
    assert tree["num_interactions"] == 0, tree
