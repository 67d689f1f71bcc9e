"""The gateway in-process (``httpx.ASGITransport``), driven by the real ``openai`` SDK.

The upstream is ``tests/standin.py`` reached through ``httpx.ASGITransport``: it speaks SGLang's native wire
format and returns the real tokenizer's ids of scripted replies (a protocol-boundary fake: a random tiny
model cannot be made to emit tool calls). Recording goes to a real SQLite store.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.app import SERVING_GC_THRESHOLDS, create_app, load_tokenizer
from gateway.store.errors import StoreUnavailable
from gateway.metrics import cache_gauges
from gateway.settings import GatewaySettings
from tests.standin import build_app
from gateway.store import Store
from tests.conftest import REDIS_URL
from tests.inprocess import inprocess_gateway, tokenizer  # noqa: F401 (fixture, imported from here by other modules)

ADMIN, AGENT, OTHER = "admin-k", "agent-k", "other-agent-k"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_ROME = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


class Gw:
    def __init__(self, app: Any, http: httpx.AsyncClient, store: Store, engine: "FlakyTransport") -> None:
        self.app, self.http, self.store, self.engine = app, http, store, engine

    @property
    def svc(self) -> Any:
        return self.app.state.services

    def sdk(self, key: str = AGENT, base: str = "/v1") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"http://gw{base}", api_key=key, http_client=self.http, max_retries=0)

    async def post(self, path: str, body: Any = None, key: str | None = AGENT, raw: bytes | None = None,
                   ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if raw is not None:
            return await self.http.post(path, content=raw, headers={**headers, "Content-Type": "application/json"})
        return await self.http.post(path, json=body, headers=headers)

    async def session(self, **body: Any) -> dict[str, Any]:
        resp = await self.post("/v1/sessions", body, key=ADMIN)
        assert resp.status_code == 200, resp.text
        return resp.json()  # type: ignore[no-any-return]


class FlakyTransport(httpx.AsyncBaseTransport):
    """The stand-in engine over ASGI, with a switch that makes it unreachable (connection refused)."""

    def __init__(self, app: Any) -> None:
        self.inner = httpx.ASGITransport(app=app)
        self.down = False
        self.generate_calls = 0
        self.sampling: list[dict[str, Any]] = []  # sampling_params of every /generate, in order
        self.gate: asyncio.Event | None = None  # set: /generate answers only once it is set (a slow reply)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            self.generate_calls += 1
            self.sampling.append(json.loads(request.content).get("sampling_params") or {})
            if self.gate is not None:
                await self.gate.wait()
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        return await self.inner.handle_async_request(request)


@pytest.fixture
def make_gw(tmp_path: Path, tiny_model_dir: Path, tokenizer: Any) -> Callable[..., Any]:
    @asynccontextmanager
    async def make(replies: list[str], tok: Any = None, **overrides: Any) -> AsyncIterator[Gw]:
        engine = FlakyTransport(build_app(str(tiny_model_dir), replies, tokenizer=tokenizer))
        async with inprocess_gateway(engine, tokenizer=tok or tokenizer, **{
                "db": f"sqlite+aiosqlite:///{tmp_path}/gw.db", "admin_key": ADMIN, "agent_key": [AGENT],
                **overrides}) as (app, http):
            yield Gw(app, http, app.state.services.store, engine)
    return make


def assistant(msg: Any) -> dict[str, Any]:
    return msg.model_dump(exclude_none=True)  # what an SDK user sends back


async def interactions(gw: Gw, session_id: str) -> list[Any]:
    return await gw.store.session_interactions(session_id=session_id)


# --------------------------------------------------------------------------------------------- recording


async def test_three_turns_with_tool_call_are_stitched_token_exact(make_gw: Any) -> None:
    async with make_gw([CALL_PARIS, "It is sunny in Paris.", "You are welcome!"]) as gw:
        sess = await gw.session(group_id="g1")
        client = gw.sdk(key=sess["api_key"])
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are helpful."},
                                      {"role": "user", "content": "Weather in Paris?"}]
        r1 = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=64)
        call = r1.choices[0].message.tool_calls[0]
        assert r1.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        msgs += [assistant(r1.choices[0].message), {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        r2 = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=64)
        assert r2.choices[0].message.content == "It is sunny in Paris."
        msgs += [assistant(r2.choices[0].message), {"role": "user", "content": "Thanks!"}]
        r3 = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=64)
        assert r3.choices[0].finish_reason == "stop"

        turns = {t.id: t for t in await interactions(gw, sess["session_id"])}
        t1, t2, t3 = turns[r1.id], turns[r2.id], turns[r3.id]
        assert (t1.parent_id, t2.parent_id, t3.parent_id) == (None, t1.id, t2.id)
        assert t1.root_reason == "first_turn" and t2.root_reason is None and t3.root_reason is None
        template = gw.svc.template
        for parent, child, upto in ((t1, t2, 4), (t2, t3, 6)):
            parent_full = await gw.store.full_sequence(interaction_id=parent.id)
            child_prompt = parent_full + child.prompt_ids
            # the child's prompt starts with exactly the parent's prompt + output tokens
            parent_prompt = parent_full[: len(parent_full) - len(parent.output_ids)]
            assert child_prompt[: len(parent_full)] == parent_prompt + parent.output_ids
            assert child.bridge_len == 0
            # and, for this template (renders history stably), equals a full re-render
            assert child_prompt == template.render(msgs[:upto], TOOLS)
        assert t1.prompt_ids == template.render(msgs[:2], TOOLS)
        # only the new messages are stored with a child
        assert [m["role"] for m in t2.request["messages"]] == ["tool"]
        assert [m["role"] for m in t3.request["messages"]] == ["user"]
        assert t1.output_versions == [0] * len(t1.output_ids)
        assert t1.output_logprobs == pytest.approx([-0.25] * len(t1.output_ids))


# ChatML that drops earlier <think> blocks from assistant messages (as reasoning models' templates do)
THINK_STRIPPING = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{%- set content = message.content or '' -%}"
    "{%- if not loop.last and '</think>' in content -%}{%- set content = content.split('</think>')[-1] -%}{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


async def test_think_stripping_template_keeps_the_parents_real_tokens(make_gw: Any, tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = THINK_STRIPPING
    async with make_gw(["<think>2+2 is 4</think>It is 4.", "Yes."], tok=tok) as gw:
        client = gw.sdk()
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "2+2?"}]
        r1 = await client.chat.completions.create(model="m", messages=msgs, max_tokens=50)
        msgs += [assistant(r1.choices[0].message), {"role": "user", "content": "Sure?"}]
        r2 = await client.chat.completions.create(model="m", messages=msgs, max_tokens=50)
        t1, t2 = [await gw.store.get_interaction(interaction_id=r.id) for r in (r1, r2)]
        assert t2.parent_id == t1.id and t2.root_reason is None
        parent_full = await gw.store.full_sequence(interaction_id=t1.id)
        stitched = parent_full + t2.prompt_ids
        assert "<think>2+2 is 4</think>" in tok.decode(stitched)  # the model's real tokens are kept
        rerendered = gw.svc.template.render(msgs, None)
        assert "<think>" not in tok.decode(rerendered) and rerendered != stitched
        metrics = (await gw.http.get("/metrics")).text
        assert 'agentrl_gateway_template_drift_total{reason="rerender_differs"} 1.0' in metrics
        assert "agentrl_gateway_template_drift_checks_total 1.0" in metrics


@pytest.mark.parametrize("stream", [False, True])
async def test_the_drift_check_runs_while_the_engine_generates(make_gw: Any, stream: bool) -> None:
    """The sampled drift check does not change the prompt, so it runs once the engine call is sent (its CPU
    overlaps the engine's work), and still counts a re-render that differs, streamed or not."""
    async with make_gw(["Hi there.", "Fine."]) as gw:
        client = gw.sdk()
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        r1 = await client.chat.completions.create(model="m", messages=msgs, max_tokens=20)
        msgs += [assistant(r1.choices[0].message), {"role": "user", "content": "and you?"}]
        order: list[str] = []
        engine, template = gw.engine.handle_async_request, gw.svc.template
        drift = template.drift

        async def generate(request: httpx.Request) -> httpx.Response:
            order.append("engine")
            return await engine(request)

        def differs(*args: Any) -> bool:
            order.append("drift")
            drift(*args)
            return True  # counted as a re-render that differs

        gw.engine.handle_async_request = generate
        template.drift = differs  # type: ignore[method-assign]
        if stream:
            chunks = [c async for c in await client.chat.completions.create(
                model="m", messages=msgs, max_tokens=20, stream=True)]
            second = chunks[0].id
        else:
            second = (await client.chat.completions.create(model="m", messages=msgs, max_tokens=20)).id
        assert order == ["engine", "drift"]
        t2 = await gw.store.get_interaction(interaction_id=second)
        assert t2.parent_id == r1.id
        metrics = (await gw.http.get("/metrics")).text
        assert 'agentrl_gateway_template_drift_total{reason="rerender_differs"} 1.0' in metrics


async def test_two_parallel_tool_calls_come_back_streamed_and_not(make_gw: Any) -> None:
    async with make_gw([CALL_PARIS + "\n" + CALL_ROME]) as gw:
        client = gw.sdk()
        msgs = [{"role": "user", "content": "Weather in Paris and Rome?"}]
        r = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=100)
        calls = r.choices[0].message.tool_calls
        assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Rome"]
        assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"

        stream = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=100,
                                                      stream=True)
        got: dict[int, Any] = {}
        finish = None
        async for chunk in stream:
            for choice in chunk.choices:
                for tc in choice.delta.tool_calls or []:
                    got[tc.index] = tc
                finish = choice.finish_reason or finish
        assert [json.loads(got[i].function.arguments)["city"] for i in sorted(got)] == ["Paris", "Rome"]
        assert finish == "tool_calls"
        turn = await gw.store.get_interaction(interaction_id=r.id)
        assert len(turn.response_message["tool_calls"]) == 2


async def test_streaming_records_the_same_as_non_streaming(make_gw: Any) -> None:
    async with make_gw(["Hello there, how are you?"]) as gw:
        client = gw.sdk()
        msgs = [{"role": "user", "content": "hi"}]
        plain = await client.chat.completions.create(model="m", messages=msgs, max_tokens=50, logprobs=True)
        stream = await client.chat.completions.create(model="m", messages=msgs, max_tokens=50, logprobs=True,
                                                      stream=True, stream_options={"include_usage": True})
        text, ids, usage, lps = "", set(), None, []
        async for chunk in stream:
            ids.add(chunk.id)
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                lps += [e.logprob for e in (choice.logprobs.content if choice.logprobs else [])]
        assert text == plain.choices[0].message.content == "Hello there, how are you?"
        assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens
        assert lps == [e.logprob for e in plain.choices[0].logprobs.content]
        (sid,) = ids
        a = await gw.store.get_interaction(interaction_id=plain.id)
        b = await gw.store.get_interaction(interaction_id=sid)
        for attr in ("prompt_ids", "output_ids", "output_logprobs", "output_versions", "finish_reason",
                     "response_message", "chain_hash", "request_hash"):
            assert getattr(a, attr) == getattr(b, attr), attr


async def test_n4_makes_four_siblings_and_retry_makes_two(make_gw: Any) -> None:
    async with make_gw(["first answer", "second answer", "third", "fourth", "A", "B", "C"]) as gw:
        sess = await gw.session()
        client = gw.sdk(key=sess["api_key"])
        base = [{"role": "user", "content": "q"}]
        r = await client.chat.completions.create(model="m", messages=base, n=4, max_tokens=20, seed=3)
        ids = [c.model_extra["response_id"] for c in r.choices]
        assert r.id == ids[0] and len(set(ids)) == 4
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        turns = {t.id: t for t in await interactions(gw, sess["session_id"])}
        assert set(turns) == set(ids)
        assert all(turns[i].parent_id is None for i in ids)
        assert [turns[i].request["params"]["seed"] for i in ids] == [3, 4, 5, 6]
        # continue choice 2: its turn is the parent
        follow = base + [assistant(r.choices[2].message), {"role": "user", "content": "more"}]
        a = await client.chat.completions.create(model="m", messages=follow, max_tokens=20)
        b = await client.chat.completions.create(model="m", messages=follow, max_tokens=20)  # a retry
        ta, tb = [await gw.store.get_interaction(interaction_id=x.id) for x in (a, b)]
        assert ta.parent_id == tb.parent_id == ids[2]
        assert ta.request_hash == tb.request_hash and ta.id != tb.id
        # continuing the retried one extends only it
        c = await client.chat.completions.create(
            model="m", messages=follow + [assistant(b.choices[0].message), {"role": "user", "content": "ok"}],
            max_tokens=20)
        tc = await gw.store.get_interaction(interaction_id=c.id)
        assert tc.parent_id == tb.id
        # Export: the unchosen choices 0, 1, 3 are samples of the same request, kept with the continued
        # branch; only `a`, a separate request with the same messages that was not continued, is dropped.
        from agentrl.trajectory import export_concat, turn_from_interaction

        rows = export_concat([turn_from_interaction(t) for t in await interactions(gw, sess["session_id"])],
                             gamma=1.0)
        assert sorted(r.leaf_id for r in rows) == sorted([ids[0], ids[1], ids[3], c.id])


async def test_stop_string_cuts_text_and_child_gets_bridge(make_gw: Any) -> None:
    async with make_gw(["Hello! How can I help you today?", "Fine."]) as gw:
        client = gw.sdk()
        msgs = [{"role": "user", "content": "hi"}]
        r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=50, stop=["help"])
        assert r.choices[0].message.content == "Hello! How can I "
        assert r.choices[0].finish_reason == "stop"
        t = await gw.store.get_interaction(interaction_id=r.id)
        tok = gw.svc.tokenizer
        assert "help" in tok.decode(t.output_ids) and "help" not in tok.decode(t.output_ids[:-1])
        r2 = await client.chat.completions.create(
            model="m", messages=msgs + [assistant(r.choices[0].message), {"role": "user", "content": "?"}],
            max_tokens=50)
        t2 = await gw.store.get_interaction(interaction_id=r2.id)
        assert t2.parent_id == t.id and t2.bridge_len == 1
        assert t2.prompt_ids[0] == gw.svc.template.end_of_turn_ids[0]


async def test_length_cut_parent_gets_bridge_and_streamed_stop(make_gw: Any) -> None:
    async with make_gw(["one two three four five six", "x"]) as gw:
        client = gw.sdk()
        msgs = [{"role": "user", "content": "count"}]
        r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=3)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
        r2 = await client.chat.completions.create(
            model="m", messages=msgs + [assistant(r.choices[0].message), {"role": "user", "content": "go on"}],
            max_tokens=5)
        t2 = await gw.store.get_interaction(interaction_id=r2.id)
        assert t2.bridge_len == 1 and t2.parent_id == r.id
        # a stop string found while streaming ends the stream with finish "stop"
        stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "s"}],
                                                      max_tokens=50, stop=["four"], stream=True)
        text, finish = "", None
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        assert text == "one two three " and finish == "stop"  # the third call gets the first reply again


async def test_completions_prompt_text_and_ids_recorded_as_roots(make_gw: Any) -> None:
    async with make_gw(["Paris"]) as gw:
        sess = await gw.session()
        client = gw.sdk(key=sess["api_key"])
        r = await client.completions.create(model="m", prompt="The capital of France is", max_tokens=10)
        assert r.choices[0].text == "Paris" and r.object == "text_completion"
        ids = gw.svc.tokenizer.encode(" hello", add_special_tokens=False)
        r2 = await client.completions.create(model="m", prompt=ids, max_tokens=10, logprobs=1)
        assert r2.choices[0].logprobs.token_logprobs[0] == pytest.approx(-0.25)
        turns = {t.id: t for t in await interactions(gw, sess["session_id"])}
        assert turns[r2.id].prompt_ids == ids and turns[r2.id].parent_id is None
        assert {t.root_reason for t in turns.values()} == {"completion"}
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        stream = await client.completions.create(model="m", prompt="Capital?", max_tokens=10, stream=True)
        text, sid, finish = "", None, None
        async for chunk in stream:
            sid = chunk.id
            text += "".join(c.text for c in chunk.choices)
            finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
        assert text == "Paris" and finish == "stop"
        assert (await gw.store.get_interaction(interaction_id=sid)).root_reason == "completion"
        other = await gw.session()
        tree = await gw.http.get(f"/v1/sessions/{sess['session_id']}",
                                 headers={"Authorization": f"Bearer {other['api_key']}"})
        assert tree.status_code == 403
        unknown = await gw.http.get("/v1/sessions/nope", headers={"Authorization": f"Bearer {ADMIN}"})
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "session_id"


# --------------------------------------------------------------------------------------------- sessions


async def test_session_binding_by_key_by_url_and_implicit(make_gw: Any) -> None:
    async with make_gw(["a", "b", "c", "d", "e", "f"]) as gw:
        s1, s2 = await gw.session(task_id="t"), await gw.session()
        assert s1["base_url"].endswith(f"/sessions/{s1['session_id']}/v1")
        msgs = [{"role": "user", "content": "hi"}]
        by_url = gw.sdk(key=ADMIN, base=f"/sessions/{s1['session_id']}/v1")  # agent keys: own implicit ones only
        r = await by_url.chat.completions.create(model="m", messages=msgs, max_tokens=5)
        assert (await gw.store.get_interaction(interaction_id=r.id)).session_id == s1["session_id"]
        # a session key on another session's URL: 403
        foreign = gw.sdk(key=s2["api_key"], base=f"/sessions/{s1['session_id']}/v1")
        with pytest.raises(openai.PermissionDeniedError):
            await foreign.chat.completions.create(model="m", messages=msgs, max_tokens=5)
        with pytest.raises(openai.AuthenticationError):
            await gw.sdk(key="nope").chat.completions.create(model="m", messages=msgs, max_tokens=5)
        # implicit: two roots with the same prompt are two episodes in one group; a follow-up joins its own
        imp = gw.sdk(key=AGENT)
        a = await imp.chat.completions.create(model="m", messages=msgs, max_tokens=5)
        b = await imp.chat.completions.create(model="m", messages=msgs, max_tokens=5)
        ta, tb = [await gw.store.get_interaction(interaction_id=x.id) for x in (a, b)]
        assert ta.session_id != tb.session_id
        sa, sb = [await gw.store.get_session(session_id=t.session_id) for t in (ta, tb)]
        assert sa.group_id == sb.group_id
        c = await imp.chat.completions.create(
            model="m", messages=msgs + [assistant(b.choices[0].message), {"role": "user", "content": "go"}],
            max_tokens=5)
        tc = await gw.store.get_interaction(interaction_id=c.id)
        assert tc.parent_id == tb.id and tc.session_id == tb.session_id
        # finish: no more turns (409); the tree is served
        resp = await gw.post(f"/v1/sessions/{s1['session_id']}/finish", {}, key=ADMIN)
        assert resp.status_code == 200 and resp.json()["status"] == "finished"
        with pytest.raises(openai.ConflictError):
            await gw.sdk(key=s1["api_key"]).chat.completions.create(model="m", messages=msgs, max_tokens=5)
        tree = (await gw.http.get(f"/v1/sessions/{s1['session_id']}",
                                  headers={"Authorization": f"Bearer {ADMIN}"})).json()
        assert tree["num_interactions"] == 1 and tree["roots"][0]["id"] == r.id
        # only the admin creates sessions
        assert (await gw.post("/v1/sessions", {}, key=AGENT)).status_code == 403


async def test_an_implicit_conversation_outlives_a_restart_without_redis(make_gw: Any) -> None:
    """Without Redis the implicit-episode index lives in the process. After a restart a follow-up finds its
    episode through the stored turns (SQL) and links to its parent; the same conversation sent with another
    agent key is still a new root, and so is one whose assistant message the gateway never answered."""
    msgs = [{"role": "user", "content": "hi"}]
    async with make_gw(["a"], agent_key=[AGENT, OTHER]) as gw:
        first = await gw.sdk().chat.completions.create(model="m", messages=msgs, max_tokens=5)
    follow = msgs + [assistant(first.choices[0].message), {"role": "user", "content": "go"}]
    async with make_gw(["b", "c", "d"], agent_key=[AGENT, OTHER]) as gw:  # the same database file
        t1 = await gw.store.get_interaction(interaction_id=first.id)
        second = await gw.sdk().chat.completions.create(model="m", messages=follow, max_tokens=5)
        t2 = await gw.store.get_interaction(interaction_id=second.id)
        assert t2.parent_id == t1.id and t2.session_id == t1.session_id and t2.root_reason is None
        full1 = await gw.store.full_sequence(interaction_id=t1.id)
        assert (await gw.store.full_sequence(interaction_id=t2.id))[:len(full1)] == full1
        other = await gw.sdk(key=OTHER).chat.completions.create(model="m", messages=follow, max_tokens=5)
        t3 = await gw.store.get_interaction(interaction_id=other.id)
        assert t3.parent_id is None and t3.session_id != t1.session_id and t3.root_reason == "no_prefix_match"
        unseen = msgs + [{"role": "assistant", "content": "words the gateway never sent"},
                         {"role": "user", "content": "go"}]
        r = await gw.sdk().chat.completions.create(model="m", messages=unseen, max_tokens=5)
        t4 = await gw.store.get_interaction(interaction_id=r.id)
        assert t4.parent_id is None and t4.root_reason == "no_prefix_match"
        assert t4.session_id not in (t1.session_id, t3.session_id)


def record_redis_and_engine(gw: Gw) -> list[str]:
    """From now on, the commands the gateway's lean Redis client sends (a pipeline as ``A+B``) and its engine
    generation calls (``engine``), in order. The lifecycle's ``busy()`` check (``ZCOUNT``s), which a tick may run
    alongside a turn, is left out."""
    sent: list[str] = []
    hot, engine = gw.store.redis_hot, gw.engine.handle_async_request

    async def one(*args: Any) -> Any:
        sent.append(str(args[0]))
        return await type(hot).execute_command(hot, *args)

    async def many(commands: Any, raise_on_error: bool = True) -> Any:
        names = "+".join(str(c[0]) for c in commands)
        if not names.startswith("ZCOUNT"):
            sent.append(names)
        return await type(hot).execute_many(hot, commands, raise_on_error=raise_on_error)

    async def generate(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/generate"):  # not the router's health and version checks
            sent.append("engine")
        return await engine(request)

    hot.execute_command, hot.execute_many, gw.engine.handle_async_request = one, many, generate
    return sent


async def test_an_implicit_follow_up_finds_its_episode_in_one_redis_round_trip(make_gw: Any,
                                                                                redis_prefix: str) -> None:
    """With Redis, a follow-up's episode, session record, parent and in-flight marker come from one script
    call before the engine is asked; after it, one publish, which also removes the marker (no Redis command
    of its own). An identical conversation under another agent key is a new root, and the marker that
    lookup set is gone."""
    async with make_gw(["a", "b", "c"], redis=REDIS_URL, redis_prefix=redis_prefix, agent_key=[AGENT, OTHER],
                       tick_s=3600) as gw:
        msgs = [{"role": "user", "content": "hi"}]
        first = await gw.sdk().chat.completions.create(model="m", messages=msgs, max_tokens=5)
        follow = msgs + [assistant(first.choices[0].message), {"role": "user", "content": "go"}]
        sent = record_redis_and_engine(gw)
        second = await gw.sdk().chat.completions.create(model="m", messages=follow, max_tokens=5)
        await gw.app.state.services.inflight.settle()
        assert sent == ["EVALSHA", "engine", "HSET+EXPIRE+SET+SET+ZREM"]  # the marker goes with the publish
        t1, t2 = [await gw.store.get_interaction(interaction_id=r.id) for r in (first, second)]
        assert t2.parent_id == t1.id and t2.session_id == t1.session_id
        assert not await gw.app.state.services.inflight.busy([t1.session_id])

        sent.clear()
        third = await gw.sdk(key=OTHER).chat.completions.create(model="m", messages=follow, max_tokens=5)
        await gw.app.state.services.inflight.settle()
        t3 = await gw.store.get_interaction(interaction_id=third.id)
        assert t3.parent_id is None and t3.session_id != t1.session_id and t3.root_reason == "no_prefix_match"
        assert sent[0] == "EVALSHA" and "ZREM" in sent  # the marker set by the lookup, taken back
        assert not await gw.app.state.services.inflight.busy([t1.session_id])
        assert [k for k in await gw.store.redis.keys(f"{redis_prefix}inflight:*")
                if await gw.store.redis.zcard(k)] == []


async def test_the_continuation_is_rendered_while_the_parent_lookup_is_out(make_gw: Any, redis_prefix: str) -> None:
    """With Redis, a follow-up's continuation for its likeliest parent (the last assistant message) is
    computed after the lookup's script call is sent and before its answer is used, and is the one recorded.
    When the lookup finds an earlier parent (the last assistant message was never sent by the gateway), the
    continuation is that parent's, as without the head start."""
    async with make_gw(["a", "b", "c"], redis=REDIS_URL, redis_prefix=redis_prefix, agent_key=[AGENT],
                       tick_s=3600) as gw:
        template = gw.svc.template
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        first = await gw.sdk().chat.completions.create(model="m", messages=msgs, max_tokens=5)
        msgs += [assistant(first.choices[0].message), {"role": "user", "content": "go"}]
        sent = record_redis_and_engine(gw)
        delta = template.delta

        def traced(*args: Any) -> Any:
            sent.append("delta")
            return delta(*args)

        template.delta = traced  # type: ignore[method-assign]
        second = await gw.sdk().chat.completions.create(model="m", messages=msgs, max_tokens=5)
        assert sent[:3] == ["EVALSHA", "delta", "engine"]
        assert sent.count("delta") == 1  # not rendered again after the lookup
        t1, t2 = [await gw.store.get_interaction(interaction_id=r.id) for r in (first, second)]
        assert t2.parent_id == t1.id
        expected = delta(msgs[:2], msgs[2:], None)
        assert t2.prompt_ids == template.continuation(msgs[:2], msgs[2:], None, t1.output_ids,
                                                      delta=expected).prompt_ids

        edited = msgs + [{"role": "assistant", "content": "never generated"}, {"role": "user", "content": "so?"}]
        sent.clear()
        third = await gw.sdk().chat.completions.create(model="m", messages=edited, max_tokens=5)
        assert sent[:2] == ["EVALSHA", "delta"] and sent.count("delta") == 2  # the guess, then the real parent
        t3 = await gw.store.get_interaction(interaction_id=third.id)
        assert t3.parent_id == t1.id  # the last assistant message is not a recorded answer; the first is
        assert t3.prompt_ids == template.continuation(edited[:2], edited[2:], None, t1.output_ids).prompt_ids


async def test_a_follow_up_the_store_refuses_still_takes_its_marker_back(make_gw: Any, redis_prefix: str,
                                                                       monkeypatch: Any) -> None:
    """The marker's removal rides on the publish after a commit; a turn whose commit fails (the database
    unavailable) has none, so the turn removes its marker itself when it ends (a 503 for the client)."""
    async with make_gw(["a", "b"], redis=REDIS_URL, redis_prefix=redis_prefix, agent_key=[AGENT],
                       tick_s=3600) as gw:
        msgs = [{"role": "user", "content": "hi"}]
        first = await gw.sdk().chat.completions.create(model="m", messages=msgs, max_tokens=5)
        follow = msgs + [assistant(first.choices[0].message), {"role": "user", "content": "go"}]
        t1 = await gw.store.get_interaction(interaction_id=first.id)

        async def unavailable(*args: Any, **kwargs: Any) -> None:
            raise StoreUnavailable("the database is down (test)")

        monkeypatch.setattr(gw.store._writer, "submit", unavailable)
        sent = record_redis_and_engine(gw)
        with pytest.raises(openai.InternalServerError) as refused:
            await gw.sdk().with_options(max_retries=0).chat.completions.create(model="m", messages=follow,
                                                                               max_tokens=5)
        assert refused.value.status_code == 503
        await gw.app.state.services.inflight.settle()
        assert sent == ["EVALSHA", "engine", "ZREM"]  # no publish: the marker's own removal after the turn
        assert await gw.store.redis.zcard(f"{redis_prefix}inflight:{t1.session_id}") == 0
        assert not await gw.app.state.services.inflight.busy([t1.session_id])


async def test_a_named_sessions_turn_reads_its_session_marks_and_finds_its_parent_in_one_redis_round_trip(
        make_gw: Any, redis_prefix: str) -> None:
    """A session key this gateway has seen: a turn's session record, its in-flight marker and (for a
    follow-up) its parent index entry come in one pipeline before the engine call (they were two round
    trips: the key's record, then the rest); a key it has not seen is looked up first, as before. A
    finished session's turn is refused and leaves no marker."""
    async with make_gw(["a", "b", "c", "d"], redis=REDIS_URL, redis_prefix=redis_prefix, tick_s=3600) as gw:
        sess = await gw.session()
        client = gw.sdk(key=sess["api_key"])
        msgs = [{"role": "user", "content": "hi"}]
        sent = record_redis_and_engine(gw)
        first = await client.chat.completions.create(model="m", messages=msgs, max_tokens=5)
        await gw.app.state.services.inflight.settle()
        assert sent[:2] == ["HGET+ZADD+EXPIRE", "engine"]  # a first turn: no parent to look up
        assert len(sent) == 3 and sent[-1].endswith("+ZREM")  # the publish takes the marker with it
        follow = msgs + [assistant(first.choices[0].message), {"role": "user", "content": "go"}]
        sent.clear()
        second = await client.chat.completions.create(model="m", messages=follow, max_tokens=5)
        await gw.app.state.services.inflight.settle()
        assert sent[:2] == ["HGET+ZADD+EXPIRE+HGET", "engine"] and len(sent) == 3 and sent[-1].endswith("+ZREM")
        t1, t2 = [await gw.store.get_interaction(interaction_id=r.id) for r in (first, second)]
        assert t2.parent_id == t1.id and t2.session_id == sess["session_id"]
        assert not await gw.app.state.services.inflight.busy([sess["session_id"]])

        gw.store._key_sessions.clear()  # as in another replica, or after a restart: the key is looked up first
        sent.clear()
        third = await client.chat.completions.create(model="m", messages=follow, max_tokens=5)
        await gw.app.state.services.inflight.settle()
        assert sent[:2] == ["HGET", "ZADD+EXPIRE+HGET"] and "engine" in sent  # the record from the key's lookup
        assert (await gw.store.get_interaction(interaction_id=third.id)).parent_id == t1.id

        assert (await gw.post(f"/v1/sessions/{sess['session_id']}/finish", {}, key=ADMIN)).status_code == 200
        for _ in range(2):  # read with the marker (the key is known again), and after the record left Redis
            with pytest.raises(openai.ConflictError):
                await client.chat.completions.create(model="m", messages=follow, max_tokens=5)
            await gw.app.state.services.inflight.settle()
            assert await gw.store.redis.zcard(f"{redis_prefix}inflight:{sess['session_id']}") == 0
            await gw.store.redis.delete(f"{redis_prefix}sid:{sess['session_id']}",
                                        *await gw.store.redis.keys(f"{redis_prefix}skey:*"))


async def test_a_known_session_key_whose_record_left_redis_is_read_from_sql(make_gw: Any, redis_prefix: str) -> None:
    """The record of a session key this gateway has seen is read with the turn's marker; when Redis no longer
    has it (expired, evicted, a Redis restart) the key is looked up in SQL, the turn goes on and the record is
    cached again. A wrong key is still a 401, and a session key on another session's URL a 403, whatever
    this gateway has seen."""
    async with make_gw(["a", "b"], redis=REDIS_URL, redis_prefix=redis_prefix, tick_s=3600) as gw:
        sess, other = await gw.session(), await gw.session()
        client = gw.sdk(key=sess["api_key"])
        msgs = [{"role": "user", "content": "hi"}]
        first = await client.chat.completions.create(model="m", messages=msgs, max_tokens=5)
        await gw.store.redis.delete(f"{redis_prefix}sid:{sess['session_id']}",
                                    *await gw.store.redis.keys(f"{redis_prefix}skey:*"))
        follow = msgs + [assistant(first.choices[0].message), {"role": "user", "content": "go"}]
        second = await client.chat.completions.create(model="m", messages=follow, max_tokens=5)
        t2 = await gw.store.get_interaction(interaction_id=second.id)
        assert t2.parent_id == first.id and t2.session_id == sess["session_id"]
        assert await gw.store.redis.hget(f"{redis_prefix}sid:{sess['session_id']}", "d") is not None
        await gw.app.state.services.inflight.settle()
        assert await gw.store.redis.zcard(f"{redis_prefix}inflight:{sess['session_id']}") == 0

        with pytest.raises(openai.AuthenticationError):
            await gw.sdk(key=sess["api_key"] + "x").chat.completions.create(model="m", messages=msgs, max_tokens=5)
        foreign = await gw.post(f"/sessions/{other['session_id']}/v1/chat/completions",
                                {"model": "m", "messages": msgs, "max_tokens": 5}, key=sess["api_key"])
        assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "foreign_session"
        assert await gw.store.redis.zcard(f"{redis_prefix}inflight:{other['session_id']}") == 0
        assert [t.id for t in await gw.store.session_interactions(session_id=sess["session_id"])] == \
            [first.id, second.id]


async def test_rewards(make_gw: Any) -> None:
    async with make_gw(["a"]) as gw:
        sess = await gw.session()

        async def post(path: str, body: Any = None, raw: bytes | None = None) -> Any:
            return await gw.post(path, body, key=sess["api_key"], raw=raw)  # the session's own key
        r = await gw.sdk(key=sess["api_key"]).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        ok = await post("/reward", {"response_id": r.id, "reward": 1.5})
        assert ok.status_code == 200 and ok.json()["reward"] == 1.5
        assert (await gw.store.get_interaction(interaction_id=r.id)).reward == 1.5
        assert (await post("/reward", {"session_id": sess["session_id"], "reward": 0})).status_code == 200
        for raw in (b'{"response_id": "%s", "reward": NaN}', b'{"response_id": "%s", "reward": Infinity}',
                    b'{"response_id": "%s", "reward": -Infinity}', b'{"response_id": "%s", "reward": "1.0"}',
                    b'{"response_id": "%s", "reward": true}', b'{"response_id": "%s"}'):
            resp = await post("/reward", raw=raw % r.id.encode())
            assert resp.status_code == 400, raw
            assert resp.json()["error"]["type"] == "invalid_request_error"
        resp = await post("/reward", {"response_id": "chatcmpl-unknown", "reward": 1})
        assert resp.status_code == 404 and resp.json()["error"]["param"] == "response_id"
        assert (await post("/reward", {"session_id": "nope", "reward": 1})).status_code == 404
        await gw.store.set_session_status(session_id=sess["session_id"], status="consumed")
        assert (await post("/reward", {"response_id": r.id, "reward": 2})).status_code == 409
        assert (await gw.store.get_interaction(interaction_id=r.id)).reward == 1.5


# --------------------------------------------------------------------------------------------- bad input


async def test_bad_inputs_get_openai_errors_and_record_nothing(make_gw: Any, caplog: Any) -> None:
    async with make_gw(["a"], max_body_bytes=20_000) as gw:
        sess = await gw.session()
        key = sess["api_key"]
        ok_msgs = [{"role": "user", "content": "hi"}]
        cases: list[tuple[Any, int, str | None]] = [
            (b'{"messages": [', 400, "invalid_json"),
            (b'[1, 2]', 400, "invalid_type"),
            ({"messages": "hello"}, 400, None),
            ({"messages": []}, 400, None),
            ({"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
            ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c1",
                                                                "content": "r"}]}, 400, None),
            ({"messages": ok_msgs, "max_tokens": "ten"}, 400, "invalid_type"),
            ({"messages": ok_msgs, "temperature": 7}, 400, None),
            ({"messages": ok_msgs, "n": 0}, 400, None),
            ({"messages": ok_msgs, "n": 1000}, 400, None),
            ({"messages": [{"role": "user", "content": "word " * 3000}]}, 400, "context_length_exceeded"),
            ({"messages": [{"role": "user", "content": "x" * 30_000}]}, 413, "payload_too_large"),
        ]
        for body, status, code in cases:
            if isinstance(body, bytes):
                resp = await gw.post("/v1/chat/completions", key=key, raw=body)
            else:
                resp = await gw.post("/v1/chat/completions", {"model": "m", **body}, key=key)
            assert resp.status_code == status, (body if isinstance(body, bytes) else str(body)[:80], resp.text)
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
            if code:
                assert err["code"] == code, err
        bad_role = await gw.post("/v1/chat/completions",
                                 {"messages": [{"role": "wizard", "content": "x"}]}, key=key)
        assert bad_role.json()["error"]["param"] == "messages[0].role"
        # an unknown OpenAI field is accepted (and counted)
        ok = await gw.post("/v1/chat/completions", {"messages": ok_msgs, "max_tokens": 3,
                                                    "some_future_field": {"x": 1}}, key=key)
        assert ok.status_code == 200, ok.text
        metrics = (await gw.http.get("/metrics")).text
        assert 'agentrl_gateway_unknown_fields_total{field="some_future_field"} 1.0' in metrics
        assert (await gw.post("/v1/chat/completions", {"messages": ok_msgs}, key=None)).status_code == 401
        # engine down: 503, nothing recorded
        gw.engine.down = True
        down = await gw.post("/v1/chat/completions", {"messages": ok_msgs, "max_tokens": 3}, key=key)
        assert down.status_code == 503 and down.json()["error"]["code"] == "engine_unavailable"
        logged = [r.getMessage() for r in caplog.records if r.name == "agentrl.gateway"]
        assert any(m.startswith("POST /v1/chat/completions: 503 ") for m in logged), logged  # 5xx are logged
        assert not any(": 400 " in m or ": 413 " in m for m in logged)  # the 4xx above are not
        down_stream = await gw.post("/v1/chat/completions", {"messages": ok_msgs, "max_tokens": 3,
                                                             "stream": True}, key=key)
        assert down_stream.status_code == 503
        assert len(await interactions(gw, sess["session_id"])) == 1  # only the good request


async def test_direct_routes_answer_as_the_fastapi_routes_do(make_gw: Any, monkeypatch: Any) -> None:
    """The generation routes are served from the app's ASGI entry (``GatewayApp``); the same route under
    ``/sessions/{id}`` goes through FastAPI. Errors (handled, and unexpected: 500), headers and the request
    metrics must come out the same either way."""
    async with make_gw(["a", "b", "c", "d"]) as gw:
        assert {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
                ("POST", "/v1/messages")} <= set(gw.app.direct_routes)
        assert not any("{" in path for _, path in gw.app.direct_routes)
        sess = await gw.session()
        key, via_fastapi = sess["api_key"], f"/sessions/{sess['session_id']}/v1/chat/completions"
        for body in ({"messages": []}, {"messages": [{"role": "user", "content": "x"}], "temperature": 7}):
            direct, routed = [await gw.post(path, {"model": "m", **body}, key=key)
                              for path in ("/v1/chat/completions", via_fastapi)]
            assert (direct.status_code, direct.json()) == (routed.status_code, routed.json())
            assert direct.headers["content-type"] == routed.headers["content-type"]
        anthropic = await gw.post("/v1/messages", {"model": "m", "max_tokens": 5, "messages": []}, key=key)
        assert anthropic.status_code == 400 and anthropic.json()["type"] == "error"  # Anthropic's shape
        ok = await gw.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 3}, key=key)
        assert ok.status_code == 200 and ok.headers["content-type"] == "application/json"

        from gateway.service import GenerationService

        async def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("a bug")

        monkeypatch.setattr(GenerationService, "run_turn", broken)
        # a bug: answered 500 and logged, not raised on to the server (uvicorn would close the client's
        # kept connection after the answer), on either path
        direct, routed = [await gw.post(path, {"messages": [{"role": "user", "content": "hi"}]}, key=key)
                          for path in ("/v1/chat/completions", via_fastapi)]
        for path in ("/v1/chat/completions", via_fastapi):
            again = await gw.post(path, {"messages": [{"role": "user", "content": "hi"}]}, key=key)
            assert again.status_code == 500
        assert direct.status_code == routed.status_code == 500
        assert direct.json() == routed.json() and "internal error" in direct.json()["error"]["message"]
        metrics = (await gw.http.get("/metrics")).text
        # both paths count under the route's own template (as FastAPI's included routers report it)
        assert 'agentrl_gateway_requests_total{route="/v1/chat/completions",status="400"} 4.0' in metrics
        assert 'agentrl_gateway_requests_total{route="/v1/chat/completions",status="200"} 1.0' in metrics
        assert 'agentrl_gateway_requests_total{route="/v1/chat/completions",status="500"} 4.0' in metrics


async def test_a_500_over_real_http_keeps_the_clients_connection(make_gw: Any, monkeypatch: Any) -> None:
    """Served by uvicorn, an unexpected error is answered 500 and the client's kept connection stays open,
    on the direct routes and through FastAPI alike: the next request (here the SDK's, at once) goes over the
    same connection and is answered. Raising the error on to the server after the answer made uvicorn close
    the connection; the PostgreSQL restart test's agent then lost its next request ('no answer')."""
    import uvicorn

    from gateway.service import GenerationService

    async with make_gw(["a", "b", "c", "d", "e", "f"]) as gw:
        sess = await gw.session()
        key = sess["api_key"]
        server = uvicorn.Server(uvicorn.Config(gw.app, host="127.0.0.1", port=0, log_level="critical",
                                               lifespan="off"))
        serving = asyncio.ensure_future(server.serve())
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            opened = 0
            state = server.server_state

            class Counted(set):  # type: ignore[type-arg]
                def add(self, item: Any) -> None:
                    nonlocal opened
                    opened += 1
                    super().add(item)

            state.connections = Counted(state.connections)
            base = "http://127.0.0.1:%d" % server.servers[0].sockets[0].getsockname()[1]
            real = GenerationService.run_turn

            async def broken(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("a bug")

            async with httpx.AsyncClient(base_url=base, limits=httpx.Limits(max_connections=1)) as http:
                client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, http_client=http, max_retries=0)
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                for path in ("/v1/chat/completions", f"/sessions/{sess['session_id']}/v1/chat/completions"):
                    monkeypatch.setattr(GenerationService, "run_turn", broken)
                    bad = await http.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
                    assert bad.status_code == 500 and "internal error" in bad.json()["error"]["message"]
                    monkeypatch.setattr(GenerationService, "run_turn", real)
                    done = await client.chat.completions.create(**body)  # at once, on the kept connection
                    assert done.choices[0].message.content
            assert opened == 1, opened
        finally:
            server.should_exit = True
            await serving


async def test_admin_api_and_metrics(make_gw: Any) -> None:
    async with make_gw(["a"]) as gw:
        headers = {"Authorization": f"Bearer {ADMIN}"}
        engines = (await gw.http.get("/admin/engines", headers=headers)).json()
        assert engines["engines"][0]["url"] == "http://engine" and engines["engines"][0]["healthy"]
        assert (await gw.http.get("/admin/engines", headers={"Authorization": f"Bearer {AGENT}"})).status_code == 403
        assert (await gw.post("/admin/pause", {}, key=ADMIN)).json()["paused"] is True
        async with httpx.AsyncClient(transport=gw.engine, base_url="http://engine") as engine:
            pushed = await engine.post("/update_weights_from_disk", json={"model_path": "x", "weight_version": "3"})
            assert pushed.status_code == 200
        assert (await gw.post("/admin/resume", {"weight_version": 3}, key=ADMIN)).json()["weight_version"] == 3
        assert (await gw.http.get("/admin/weight_version", headers=headers)).json() == {"weight_version": 3}
        assert (await gw.post("/admin/resume", {"weight_version": "x"}, key=ADMIN)).status_code == 400
        r = await gw.sdk().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=5)
        turn = await gw.store.get_interaction(interaction_id=r.id)
        assert set(turn.output_versions) == {3}
        # a version announced without a push: tokens keep the version the engine reports (the weights
        # that sampled them); the disagreement is counted
        assert (await gw.post("/admin/resume", {"weight_version": 4}, key=ADMIN)).status_code == 200
        r = await gw.sdk().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=5)
        assert set((await gw.store.get_interaction(interaction_id=r.id)).output_versions) == {3}
        assert gw.svc.router.version_mismatches >= 1
        assert (await gw.post("/admin/resume", {"weight_version": 3}, key=ADMIN)).status_code == 200
        status = await gw.http.get("/admin/trainer", headers=headers)
        assert status.status_code == 200 and "policy" in status.json()
        bad = await gw.post("/admin/trainer", {"version": -1, "batch_size": 4, "staleness_bound": 1}, key=ADMIN)
        assert bad.status_code == 400
        ok = await gw.post("/admin/trainer", {"version": 3, "batch_size": 4, "staleness_bound": 1}, key=ADMIN)
        assert ok.status_code == 200 and ok.json()["trainer"]["version"] == 3
        health = await gw.http.get("/health")
        assert health.status_code == 200 and health.json()["weight_version"] == 3
        metrics = (await gw.http.get("/metrics")).text
        assert 'agentrl_gateway_root_turns_total{reason="first_turn"} 2.0' in metrics
        assert "agentrl_gateway_template_drift_total" in metrics
        missing = await gw.http.get("/v1/nothing")
        assert missing.status_code == 404 and "error" in missing.json()


async def test_metrics_show_how_full_each_in_process_cache_is(make_gw: Any) -> None:
    """Two implicit turns on SQLite: the store's caches hold both, the caches kept here only without Redis
    (sessions, chain index, episode index) are shown, and every fill is a share of its bound."""
    async with make_gw(["a", "b"]) as gw:
        before = cache_gauges((await gw.http.get("/metrics")).text)
        assert before["turns"] == {"entries": 0.0, "fill": 0.0}
        messages: list[dict[str, Any]] = [{"role": "user", "content": "fill the caches"}]
        for _ in range(2):
            r = await gw.sdk().chat.completions.create(model="m", messages=messages, max_tokens=5)
            messages += [assistant(r.choices[0].message), {"role": "user", "content": "more"}]
        caches = cache_gauges((await gw.http.get("/metrics")).text)
        assert set(caches) == {"turns", "sequences", "sessions", "chain_index", "implicit_episodes",
                               "engine_affinity", "template_segments", "template_renders", "chain_links",
                               "chain_links_long"}
        assert caches["turns"]["entries"] == 2 and caches["turns"]["fill"] == 2 / gw.store._turns.max_items
        assert caches["sequences"]["entries"] == 2 and 0 < caches["sequences"]["fill"] < 1
        assert caches["implicit_episodes"]["entries"] >= 2 and caches["sessions"]["entries"] == 1
        assert caches["chain_links"]["entries"] >= 3  # user, assistant, user (shared by the process)
        assert all(0 <= c["fill"] <= 1 for c in caches.values()), caches


async def test_metrics_leave_out_the_caches_redis_holds(make_gw: Any, redis_prefix: str) -> None:
    async with make_gw(["a"], redis=REDIS_URL, redis_prefix=redis_prefix) as gw:
        await gw.sdk().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        caches = cache_gauges((await gw.http.get("/metrics")).text)
        assert {"sessions", "chain_index", "implicit_episodes"}.isdisjoint(caches)
        assert caches["turns"]["entries"] == 1


async def test_shutdown_right_after_a_trainer_update_completes(make_gw: Any) -> None:
    """POST /admin/trainer wakes the lifecycle loop; leaving the app's lifespan right after it must stop
    that loop (it used to keep running, its cancellation swallowed, and shutdown hung)."""
    gw_cm = make_gw(["a"])
    gw = await gw_cm.__aenter__()
    try:
        await gw.sdk().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5)
        ok = await gw.post("/admin/trainer", {"version": 0, "batch_size": 4, "staleness_bound": 1}, key=ADMIN)
        assert ok.status_code == 200
        loop_task = gw.app.state.services.trajectories._task
    except BaseException:
        await gw_cm.__aexit__(None, None, None)
        raise
    exiting = asyncio.ensure_future(gw_cm.__aexit__(None, None, None))
    done, _ = await asyncio.wait({exiting}, timeout=120)  # a hang check: asyncio.wait never cancels it
    if not done:
        exiting.cancel()
        await asyncio.gather(exiting, return_exceptions=True)
    assert done, "the gateway's shutdown hung after POST /admin/trainer"
    assert loop_task.done()


async def _status(gw: Gw, session_id: str) -> str:
    return (await gw.store.get_session(session_id=session_id)).status


async def _loop_ticks(gw: Gw, n: int = 3) -> None:
    """Wait until the running lifecycle loop has begun ``n`` more ticks (so ``n - 1`` whole ticks ran from
    now on), counted by the service itself; the bound is only a hang guard."""
    service = gw.app.state.services.trajectories
    start = service.stats.ticks
    async with asyncio.timeout(120):
        while service.stats.ticks < start + n:
            await asyncio.sleep(0.01)


async def test_turn_in_flight_keeps_its_session_from_idle_finish(make_gw: Any) -> None:
    """A rewarded session idle far beyond the timeout is not finished while one of its turns is generating
    (a slow engine reply), neither by the running loop nor by an explicit tick; the turn then records fine
    and only then the session finishes."""
    async with make_gw(["slow answer"], idle_timeout_s=0.05, tick_s=0.05) as gw:
        sess = await gw.session(group_id="g-slow")
        gw.engine.gate = asyncio.Event()
        turn = asyncio.ensure_future(gw.sdk(key=sess["api_key"]).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8))
        while gw.engine.generate_calls == 0:
            await asyncio.sleep(0.01)
        # Rewarded once its turn is in flight (before, the 0.05 s idle timeout may finish it first).
        await gw.store.set_reward(reward=1.0, source="test", session_id=sess["session_id"])
        await _loop_ticks(gw)  # several loop ticks with the session idle past the timeout
        await gw.app.state.services.trajectories.tick(now=time.time() + 3600)
        assert await _status(gw, sess["session_id"]) == "active"
        gw.engine.gate.set()
        reply = await turn
        assert reply.choices[0].message.content == "slow answer"
        assert [i.id for i in await interactions(gw, sess["session_id"])] == [reply.id]
        await gw.app.state.services.trajectories.tick(now=time.time() + 3600)
        assert await _status(gw, sess["session_id"]) != "active"  # finished (and maybe already exported)


async def test_streamed_turn_held_by_a_pause_keeps_its_session_in_flight(make_gw: Any) -> None:
    async with make_gw(["held answer"], idle_timeout_s=0.05, tick_s=0.05) as gw:
        sess = await gw.session(group_id="g-held")
        assert (await gw.post("/admin/pause", {}, key=ADMIN)).json()["paused"] is True

        async def consume() -> str:
            stream = await gw.sdk(key=sess["api_key"]).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        turn = asyncio.ensure_future(consume())
        try:
            async with asyncio.timeout(120):  # a hang guard
                while not await gw.app.state.services.inflight.busy([sess["session_id"]]):
                    assert not turn.done(), turn.result()
                    await asyncio.sleep(0.01)
            # Rewarded only now: before its turn was in flight, the 0.05 s idle timeout could finish it
            # first (a race that decided the test by how long the lifecycle's first tick took).
            await gw.store.set_reward(reward=1.0, source="test", session_id=sess["session_id"])
            await _loop_ticks(gw)  # several loop ticks with the session idle past the timeout
            await gw.app.state.services.trajectories.tick(now=time.time() + 3600)
            assert await _status(gw, sess["session_id"]) == "active"
        finally:
            async with httpx.AsyncClient(transport=gw.engine, base_url="http://engine") as engine:
                await engine.post("/update_weights_from_disk", json={"model_path": "x", "weight_version": "1"})
            assert (await gw.post("/admin/resume", {"weight_version": 1}, key=ADMIN)).status_code == 200
        assert await turn == "held answer"
        recorded = await interactions(gw, sess["session_id"])
        assert len(recorded) == 1 and set(recorded[0].output_versions) == {1}
        assert not await gw.app.state.services.inflight.busy([sess["session_id"]])
        await gw.app.state.services.trajectories.tick(now=time.time() + 3600)
        assert await _status(gw, sess["session_id"]) != "active"


async def test_a_served_gateway_freezes_its_start_up_objects_out_of_the_collector(
        tmp_path: Path, tiny_model_dir: Path, tokenizer: Any) -> None:
    """``agentrl gateway`` (freeze_gc): what the start-up loaded leaves the collector's generations, so a full
    collection under load walks only what requests made; an app embedded elsewhere (the default) leaves the
    host process's collector alone."""
    import gc

    settings = GatewaySettings(engine_url=["http://engine"], db=f"sqlite+aiosqlite:///{tmp_path}/gw.db",
                               admin_key=ADMIN, agent_key=[AGENT], health_interval_s=3600)
    settings.validate()
    engine = FlakyTransport(build_app(str(tiny_model_dir), ["hi"], tokenizer=tokenizer))
    assert gc.get_freeze_count() == 0
    thresholds = gc.get_threshold()
    assert thresholds != SERVING_GC_THRESHOLDS
    try:
        async with httpx.AsyncClient(transport=engine) as engine_http:
            plain = create_app(settings, http=engine_http, tokenizer=tokenizer)
            async with plain.router.lifespan_context(plain):
                assert gc.get_freeze_count() == 0
                assert gc.get_threshold() == thresholds
            served = create_app(settings, http=engine_http, tokenizer=tokenizer, freeze_gc=True)
            async with served.router.lifespan_context(served):
                assert gc.get_freeze_count() > 10_000  # modules, tokenizer, template, clients
                assert gc.get_threshold() == SERVING_GC_THRESHOLDS  # full collections rare (p99)
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=served), base_url="http://gw") as http:
                    resp = await http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {AGENT}"},
                                           json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
                    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "hi"
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
