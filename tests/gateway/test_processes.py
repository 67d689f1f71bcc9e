"""Real processes over real HTTP: the tiny engine, gateway processes, the ``openai`` SDK as client.

Recorded rows are read back from the gateway's own database (SQLite file, or PostgreSQL) with a second
``Store`` opened by the test.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import httpx
import openai
import pytest
import redis

from agentrl.procs import Processes
from tests.conftest import REDIS_URL, free_port
from tests.engine_hooks import held_decoding, wait_for, wait_held
from tests.gateway.conftest import GatewayProc, full_sequences, read_turns
from tests.standin import COMMAND as STANDIN

CALL = '<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{}"}}}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def sdk(gw: GatewayProc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.mark.slow
def test_real_engine_turns_streaming_and_pause_resume(gateway: GatewayProc) -> None:
    sess = gateway.create_session(group_id="g")
    client = sdk(gateway, sess["api_key"])
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = []
    for turn in range(3):
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, seed=turn,
                                           temperature=1.0)
        ids.append(r.id)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"more {turn}"}]
    turns = read_turns(gateway.db, ids)
    fulls = full_sequences(gateway.db, ids)
    assert [t.parent_id for t in turns] == [None, ids[0], ids[1]]
    for k in (1, 2):  # each child's prompt starts with exactly its parent's prompt + output tokens
        assert fulls[k][: len(fulls[k - 1])] == fulls[k - 1]
        assert fulls[k - 1][-len(turns[k - 1].output_ids):] == turns[k - 1].output_ids
        assert len(fulls[k]) == len(fulls[k - 1]) + len(turns[k].prompt_ids) + len(turns[k].output_ids)

    # streaming returns the same tokens and records the same row as non-streaming, same seed
    q = [{"role": "user", "content": "Tell me a story."}]
    plain = client.chat.completions.create(model="tiny", messages=q, max_tokens=12, seed=42, logprobs=True)
    stream = client.chat.completions.create(model="tiny", messages=q, max_tokens=12, seed=42, logprobs=True,
                                            stream=True, stream_options={"include_usage": True})
    text, sid, usage = "", None, None
    for chunk in stream:
        sid = chunk.id
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
    assert text == plain.choices[0].message.content
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens
    a, b = read_turns(gateway.db, [plain.id, sid])
    assert a.output_ids == b.output_ids and a.prompt_ids == b.prompt_ids
    assert a.response_message == b.response_message and a.finish_reason == b.finish_reason
    assert b.output_logprobs == pytest.approx(a.output_logprobs, abs=1e-4)

    # pause while a stream is generating, push version 7 (the same weights) and resume: the client sees
    # one stream, the row holds tokens of both versions (as the engine reports them), version 0 first. The
    # engine (--test-hooks) holds the story at 8 tokens until the push is in, so the pause provably lands
    # mid-story however fast the machine (a free-running story could end before the pause).
    admin = gateway.admin()
    engine = gateway.engine_urls[0]
    try:
        with held_decoding(engine, 8):
            stream = client.chat.completions.create(model="tiny", messages=q, max_tokens=150, seed=1, stream=True,
                                                    extra_body={"min_tokens": 16})
            chunks = iter(stream)
            first = next(chunks)
            wait_held(engine)
            assert admin.post("/admin/pause", json={}).status_code == 200
            model = httpx.get(engine + "/get_model_info", timeout=30).json()["model_path"]
            pushed = httpx.post(engine + "/update_weights_from_disk",
                                json={"model_path": model, "weight_version": "7"}, timeout=120)
            assert pushed.status_code == 200 and pushed.json()["success"], pushed.text
        assert admin.post("/admin/resume", json={"weight_version": 7}).status_code == 200
        pieces, rid = [], None
        for chunk in [first, *chunks]:
            rid = chunk.id
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
    finally:
        admin.post("/admin/resume", json={"weight_version": 7})
        admin.close()
        model = httpx.get(engine + "/get_model_info", timeout=30).json()["model_path"]
        httpx.post(engine + "/update_weights_from_disk", json={"model_path": model, "weight_version": "0"},
                   timeout=120)  # the engine is shared by later tests: back to version 0
    (row,) = read_turns(gateway.db, [rid])
    versions = row.output_versions
    assert versions[0] == 0 and versions[-1] == 7 and versions == sorted(versions), versions[:3]
    assert "".join(pieces) == row.response_message["content"]
    assert row.timings["segments"] >= 2


def _standin(procs: Processes, port: int, replies: list[str], tokenizer: str) -> Any:
    argv = [*STANDIN, "--port", str(port), "--tokenizer", tokenizer]
    for reply in replies:
        argv += ["--reply", reply]
    child = procs.start(f"standin-{port}-{time.monotonic_ns()}", argv)
    procs.wait_healthy(child, f"http://127.0.0.1:{port}/health", timeout_s=60)
    return child


@pytest.mark.slow
def test_parallel_tool_calls_and_dead_engine_via_standin_process(gateway_factory: Any, tiny_model_dir: Any,
                                                                 tmp_path: Any) -> None:
    port = free_port()
    with Processes(tmp_path / "standin-logs") as procs:
        engine = _standin(procs, port, [CALL.format("Paris") + "\n" + CALL.format("Rome")], str(tiny_model_dir))
        gw = gateway_factory(engine_urls=[f"http://127.0.0.1:{port}"])
        client = sdk(gw, gw.agent_key)
        msgs = [{"role": "user", "content": "Weather in Paris and Rome?"}]
        r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=100)
        calls = r.choices[0].message.tool_calls
        assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
        assert r.choices[0].finish_reason == "tool_calls"
        (row,) = read_turns(gw.db, [r.id])
        assert [c["id"] for c in row.response_message["tool_calls"]] == [c.id for c in calls]

        # the engine dies: 503 with a clear message, nothing recorded; it leaves the rotation
        os.killpg(engine.proc.pid, signal.SIGKILL)
        engine.proc.wait()
        with pytest.raises(openai.InternalServerError) as err:
            client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=100)
        assert err.value.status_code == 503 and "engine" in str(err.value)
        health = httpx.get(gw.base_url + "/health")
        assert health.status_code == 503
        # ... and comes back when healthy again
        _standin(procs, port, ["back"], str(tiny_model_dir))
        wait_for(lambda: httpx.get(gw.base_url + "/health").status_code == 200, "the gateway healthy again")
        back = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=10)
        assert back.choices[0].message.content == "back"
        metrics = httpx.get(gw.base_url + "/metrics").text
        assert 'agentrl_gateway_root_turns_total{reason="first_turn"} 2.0' in metrics


@pytest.mark.slow
@pytest.mark.services
def test_two_gateways_share_postgres_and_redis(gateway_factory: Any, pg_url: str, redis_prefix: str) -> None:
    gw_a = gateway_factory(db=pg_url, redis=REDIS_URL, redis_prefix=redis_prefix)
    gw_b = gateway_factory(db=pg_url, redis=REDIS_URL, redis_prefix=redis_prefix)
    sess = gw_a.create_session(group_id="shared")
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    ids = []
    for turn, gw in enumerate((gw_a, gw_b, gw_a, gw_b)):  # alternate turns of one session
        r = sdk(gw, sess["api_key"]).chat.completions.create(model="tiny", messages=msgs, max_tokens=4,
                                                            seed=turn)
        ids.append(r.id)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": str(turn)}]
    turns = read_turns(pg_url, ids)
    assert [t.parent_id for t in turns] == [None, *ids[:-1]]
    assert {t.session_id for t in turns} == {sess["session_id"]}
    fulls = full_sequences(pg_url, ids)
    for k in range(1, 4):
        assert fulls[k][: len(fulls[k - 1])] == fulls[k - 1]
    # implicit mode across replicas: each follow-up, served by the other replica than the turn before (its
    # own caches hold only every other turn of the episode), joins the episode A started through the
    # episode lookup script, and leaves no in-flight marker behind on either
    imp: list[dict[str, Any]] = [{"role": "user", "content": "implicit"}]
    imp_ids = []
    for turn, gw in enumerate((gw_a, gw_b, gw_a, gw_b, gw_a)):
        r = sdk(gw, gw.agent_key).chat.completions.create(model="tiny", messages=imp, max_tokens=4, seed=turn)
        imp_ids.append(r.id)
        imp += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"again {turn}"}]
    imp_turns = read_turns(pg_url, imp_ids)
    assert [t.parent_id for t in imp_turns] == [None, *imp_ids[:-1]]
    assert len({t.session_id for t in imp_turns}) == 1
    imp_fulls = full_sequences(pg_url, imp_ids)
    for k in range(1, len(imp_ids)):
        assert imp_fulls[k][: len(imp_fulls[k - 1])] == imp_fulls[k - 1]
    assert imp_turns[0].root_reason == "first_turn"
    markers = redis.Redis.from_url(REDIS_URL)
    # a marker is removed in the background once its turn has ended (the wait is a hang guard)
    wait_for(lambda: not markers.keys(redis_prefix + "inflight:*"), "no in-flight marker left")
    # finishing through B is seen by A
    with gw_b.admin() as admin:
        assert admin.post(f"/v1/sessions/{sess['session_id']}/finish").status_code == 200
    with pytest.raises(openai.ConflictError):
        sdk(gw_a, sess["api_key"]).chat.completions.create(model="tiny", messages=msgs, max_tokens=4)
