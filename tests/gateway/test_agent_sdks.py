"""Agent frameworks against the Responses API: the openai-agents SDK (its default model is the Responses
model) and LangChain's ``ChatOpenAI(use_responses_api=True)``, each with a function tool round trip.

The openai-agents SDK's import name is ``agents``, the same as this repository's example-agent package, so
its client runs in its own process, outside the repository (``cwd`` elsewhere, no ``PYTHONPATH``), against
the in-process gateway served on a real socket by uvicorn.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any


from tests.gateway.test_openai_inprocess import AGENT, CALL_PARIS, make_gw, tokenizer  # noqa: F401
from tests.inprocess import serve

AGENT_SCRIPT = r'''
import asyncio, json, sys
from openai import AsyncOpenAI
from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled

set_tracing_disabled(True)
set_default_openai_client(AsyncOpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0),
                          use_for_tracing=False)
calls = []

@function_tool
def get_weather(city: str) -> str:
    """Weather of a city."""
    calls.append(city)
    return "sunny"

agent = Agent(name="weather", instructions="You are helpful.", tools=[get_weather], model="tiny")
result = asyncio.run(Runner.run(agent, "Weather in Paris?"))
print(json.dumps({"final": result.final_output, "calls": calls,
                  "ids": [r.response_id for r in result.raw_responses]}))
'''


async def test_openai_agents_sdk_function_tool_round_trip(make_gw: Any, tmp_path: Path) -> None:
    async with make_gw([CALL_PARIS, "It is sunny in Paris."]) as gw, serve(gw.app) as base:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", AGENT_SCRIPT, base + "/v1", AGENT, cwd=tmp_path, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 240)
        assert proc.returncode == 0, err.decode()[-3000:]
        result = json.loads(out.decode().strip().splitlines()[-1])
        assert result["calls"] == ["Paris"] and result["final"] == "It is sunny in Paris."
        first, second = [await gw.store.get_interaction(interaction_id=i) for i in result["ids"]]
        assert first.id.startswith("resp_") and second.parent_id == first.id and second.root_reason is None
        assert [m["role"] for m in second.request["messages"]] == ["tool"]
        assert first.request["format"] == second.request["format"] == "responses"


async def test_langchain_use_responses_api_tool_round_trip(make_gw: Any) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Weather of a city."""
        return "sunny"

    async with make_gw([CALL_PARIS, "It is sunny in Paris."]) as gw:
        llm = ChatOpenAI(model="tiny", base_url="http://gw/v1", api_key=AGENT, use_responses_api=True,
                         http_async_client=gw.http, max_retries=0, max_tokens=64)
        bound = llm.bind_tools([get_weather])
        history: list[Any] = [SystemMessage("You are helpful."), HumanMessage("Weather in Paris?")]
        first = await bound.ainvoke(history)
        (call,) = first.tool_calls
        assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"}
        history += [first, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
        second = await bound.ainvoke(history)
        assert second.text == "It is sunny in Paris."
        ids = [m.response_metadata["id"] for m in (first, second)]
        t1, t2 = [await gw.store.get_interaction(interaction_id=i) for i in ids]
        assert t2.parent_id == t1.id and t2.root_reason is None
