"""The SGLang-native engine client and router, against fakes at the protocol boundary (httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from gateway.engine_client import EngineClient, EngineRouter, SamplingParams, parse_output
from gateway.errors import EngineError, EngineUnavailable, InvalidRequest

EOT = 2


def body(ids: list[int], finish: dict[str, Any] | None, version: str = "default") -> dict[str, Any]:
    # "default": SGLang's weight_version when none was given, so tokens carry the gateway's version
    return {"text": "", "output_ids": ids, "meta_info": {
        "id": "r", "finish_reason": finish, "prompt_tokens": 3, "completion_tokens": len(ids),
        "weight_version": version, "output_token_logprobs": [[-0.5, t, None] for t in ids]}}


class FakeEngine:
    """Speaks /generate (stream and not), /health and pause/continue; aborts in-flight streams on pause."""

    def __init__(self, name: str, reply: list[int]) -> None:
        self.name, self.reply = name, reply
        self.healthy, self.paused = True, asyncio.Event()
        self.requests: list[dict[str, Any]] = []
        self.step = asyncio.Event()  # set once a stream has sent two tokens
        # set: the next stream that reaches ``step`` waits there until paused, so that a pause provably
        # lands mid-stream (its seven tokens at 10 ms each could all be out before a slow test pauses)
        self.hold_at_step = False

    async def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200 if self.healthy else 503)
        if not self.healthy:
            raise httpx.ConnectError("refused", request=request)
        if path == "/pause_generation":
            self.paused.set()
            return httpx.Response(200, json={"status": "ok"})
        if path == "/continue_generation":
            self.paused.clear()
            return httpx.Response(200, json={"status": "ok"})
        req = json.loads(request.content)
        self.requests.append(req)
        if req["input_ids"] == [666]:
            return httpx.Response(400, json={"error": {"message": "prompt too long"}})
        max_new = req["sampling_params"]["max_new_tokens"]
        first = self.requests[0]["input_ids"]
        resumed = req["input_ids"][: len(first)] == first  # prompt + partial output: continue the reply
        reply = self.reply[len(req["input_ids"]) - len(first):] if resumed else self.reply
        out = reply[:max_new]
        done = {"type": "stop", "matched": EOT} if len(out) == len(reply) else {"type": "length"}
        if not req["stream"]:
            return httpx.Response(200, json=body(out, done))

        async def events() -> Any:
            for k in range(1, len(out) + 1):
                if self.paused.is_set():
                    yield f"data: {json.dumps(body(out[:k - 1], {'type': 'abort', 'message': 'paused'}))}\n\n".encode()
                    break
                yield f"data: {json.dumps(body(out[:k], done if k == len(out) else None))}\n\n".encode()
                await asyncio.sleep(0.01)
                if k == 2:
                    self.step.set()
                    if self.hold_at_step:
                        self.hold_at_step = False
                        await self.paused.wait()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})


def make_router(*engines: FakeEngine) -> tuple[EngineRouter, list[httpx.AsyncClient]]:
    clients = [httpx.AsyncClient(transport=httpx.MockTransport(e.handler)) for e in engines]
    return EngineRouter([EngineClient(f"http://{e.name}", c) for e, c in zip(engines, clients)]), clients


async def until_held(router: EngineRouter) -> None:
    """Wait until the router holds a generation (a pause's abort reached it); the bound is a hang guard."""
    async with asyncio.timeout(120):
        while not router.held:
            await asyncio.sleep(0.005)


async def collect(router: EngineRouter, ids: list[int], params: SamplingParams, **kw: Any) -> Any:
    last = None
    async for gen in router.generate(ids, params, **kw):
        last = gen
    return last


def test_parse_output_reads_sglang_shapes() -> None:
    out = parse_output(body([5, 6, EOT], {"type": "stop", "matched": EOT}, version="3"))
    assert out.output_ids == [5, 6, EOT] and out.logprobs == [-0.5] * 3
    assert (out.finish, out.matched, out.weight_version) == ("stop", EOT, 3)
    assert parse_output(body([1], None, version="default")).weight_version is None
    with pytest.raises(EngineError):
        parse_output({"error": {"message": "boom"}})
    bad = body([1, 2], None)
    bad["meta_info"]["output_token_logprobs"] = []
    with pytest.raises(EngineError, match="logprobs"):
        parse_output(bad)


async def test_generate_translates_http_errors() -> None:
    engine = FakeEngine("a", [5, 6, EOT])
    router, clients = make_router(engine)
    params = SamplingParams(max_new_tokens=10, seed=4, stop=["x"], stop_token_ids=[EOT])
    gen = await collect(router, [1, 2, 3], params, affinity_key=None, stream=False)
    assert gen.output_ids == [5, 6, EOT] and gen.finish == "stop" and gen.versions == [0, 0, 0]
    sent = engine.requests[-1]
    assert sent["return_logprob"] is True and sent["input_ids"] == [1, 2, 3]
    assert sent["sampling_params"] == {"max_new_tokens": 10, "temperature": 1.0, "top_p": 1.0,
                                       "skip_special_tokens": False, "sampling_seed": 4, "stop": ["x"],
                                       "stop_token_ids": [EOT]}
    with pytest.raises(InvalidRequest, match="prompt too long") as err:
        await collect(router, [666], params, affinity_key=None, stream=False)
    assert err.value.code == "context_length_exceeded"
    engine.healthy = False
    with pytest.raises(EngineUnavailable):
        await collect(router, [1], params, affinity_key=None, stream=False)
    assert not router.engines[0].healthy  # out of rotation after the failure
    for c in clients:
        await c.aclose()


async def test_routing_least_loaded_affinity_and_health() -> None:
    a, b = FakeEngine("a", [5, EOT]), FakeEngine("b", [7, EOT])
    router, clients = make_router(a, b)
    router.engines[0].in_flight = 3
    assert router.pick("s1") == 1  # least loaded
    router.engines[0].in_flight = 0
    router.engines[1].in_flight = 5
    assert router.pick("s1") == 1  # affinity wins while its engine is healthy
    assert router.pick("s2") == 0
    b.healthy = False
    await router.check_health()
    assert router.pick("s1") == 0  # dead engine out of rotation
    # a request that finds its engine dead moves to another one
    router.engines[1].healthy = True
    params = SamplingParams(max_new_tokens=5)
    gen = await collect(router, [1], params, affinity_key="s1", stream=False)
    assert gen.output_ids in ([5, EOT], [7, EOT])
    b.healthy = True
    await router.check_health()
    assert all(e.healthy for e in router.engines)
    a.healthy = b.healthy = False
    await router.check_health()
    with pytest.raises(EngineUnavailable, match="no healthy engine"):
        router.pick("s3")
    for c in clients:
        await c.aclose()


async def test_pause_holds_and_resume_continues_with_new_version() -> None:
    engine = FakeEngine("a", [10, 11, 12, 13, 14, 15, EOT])
    router, clients = make_router(engine)
    params = SamplingParams(max_new_tokens=50, penalties={"min_new_tokens": 40})
    seen: list[list[int]] = []

    async def consume() -> Any:
        last = None
        async for gen in router.generate([1, 2], params, affinity_key="s", stream=True):
            seen.append(list(gen.output_ids))
            last = gen
        return last

    engine.hold_at_step = True
    task = asyncio.create_task(consume())
    await asyncio.wait_for(engine.step.wait(), 120)  # a hang guard
    await router.pause()
    await until_held(router)
    assert router.held == 1 and not task.done()
    await router.resume(5)
    gen = await asyncio.wait_for(task, 120)
    assert gen.output_ids == [10, 11, 12, 13, 14, 15, EOT] and gen.finish == "stop"
    cut = gen.versions.index(5)
    assert gen.versions == [0] * cut + [5] * (7 - cut) and 1 <= cut < 7
    assert gen.segments == 2
    resent = engine.requests[-1]
    assert resent["input_ids"] == [1, 2] + gen.output_ids[:cut]  # prompt + partial output
    assert resent["sampling_params"]["max_new_tokens"] == 50 - cut
    # the minimum counts only what is still owed (vLLM refused min_tokens 600 > max_tokens 589 here)
    assert engine.requests[0]["sampling_params"]["min_new_tokens"] == 40
    assert resent["sampling_params"]["min_new_tokens"] == 40 - cut
    assert all(  # the caller only ever saw the output grow
        seen[i] == seen[i + 1][: len(seen[i])] for i in range(len(seen) - 1))
    for c in clients:
        await c.aclose()


async def test_stream_error_event_is_a_400_like_the_same_error_unstreamed() -> None:
    """SGLang refuses a streamed request it cannot serve with status 200, an error event, then [DONE]
    (tests/fixtures/sglang/generate_stream_error.json holds its bytes): that is bad input (400), not a
    broken engine (502)."""
    from tests.conftest import REPO

    recorded = json.loads((REPO / "tests/fixtures/sglang/generate_stream_error.json").read_text())
    answers = {
        "context": recorded["body_text"],
        "other": 'data: {"error": {"message": "top_p must be in (0, 1]"}}\n\ndata: [DONE]\n\n',
        "down": 'data: {"error": {"message": "overloaded", "code": 503}}\n\ndata: [DONE]\n\n',
    }
    current = {"answer": ""}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=current["answer"], headers={"content-type": "text/event-stream"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        client = EngineClient("http://e", http)
        params = SamplingParams(max_new_tokens=4)

        async def first_error(kind: str) -> Exception:
            current["answer"] = answers[kind]
            with pytest.raises(Exception) as err:
                async for _ in client.generate_stream([1, 2], params, 4):
                    pass
            return err.value

        context = await first_error("context")
        assert isinstance(context, InvalidRequest) and context.status == 400
        assert context.code == "context_length_exceeded" and "context length" in context.message
        other = await first_error("other")
        assert type(other) is InvalidRequest and other.code == "invalid_value" and "top_p" in other.message
        assert isinstance(await first_error("down"), EngineUnavailable)


class SGLangPauseEngine(FakeEngine):
    """/health as SGLang answers it: a one-token generation that waits behind a pause, so while paused
    the probe times out (the gateway's 5 s client timeout fires before SGLang's own 20 s); its
    /get_model_info answers at once, paused or not."""

    def __init__(self, name: str, reply: list[int]) -> None:
        super().__init__(name, reply)
        self.continued = 0

    async def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health" and self.paused.is_set():
            raise httpx.ReadTimeout("health generation waits behind the pause", request=request)
        if path == "/get_model_info" and self.healthy:
            return httpx.Response(200, json={"model_path": "/m", "weight_version": "0"})
        if path == "/continue_generation" and self.healthy:
            self.continued += 1
        return await super().handler(request)


async def test_resume_reaches_an_engine_whose_health_probe_failed_while_paused() -> None:
    """A disk push that pauses longer than one health interval must not leave SGLang paused for good."""
    engine = SGLangPauseEngine("a", [5, EOT])
    router, clients = make_router(engine)
    await router.pause()
    await router.check_health()  # the health loop runs during the push
    assert router.engines[0].healthy  # alive: a paused engine is probed with /get_model_info
    engine.healthy = False  # even an engine that really looks unhealthy now is sent continue_generation
    await router.check_health()
    assert not router.engines[0].healthy
    engine.healthy = True
    await router.resume(1)
    assert engine.continued == 1 and not engine.paused.is_set()
    await router.check_health()
    assert router.engines[0].healthy
    gen = await collect(router, [1], SamplingParams(max_new_tokens=5), affinity_key=None, stream=False)
    assert gen.output_ids == [5, EOT] and gen.versions == [1, 1]
    for c in clients:
        await c.aclose()


async def test_continue_that_fails_is_sent_again_by_the_health_loop() -> None:
    engine = SGLangPauseEngine("a", [5, EOT])
    router, clients = make_router(engine)
    await router.pause()
    engine.healthy = False  # unreachable when resume comes
    await router.resume(2)
    assert engine.paused.is_set() and not router.engines[0].healthy and not router.paused
    engine.healthy = True
    await router.check_health()  # retries continue_generation, then probes /health
    assert engine.continued == 1 and not engine.paused.is_set() and router.engines[0].healthy
    for c in clients:
        await c.aclose()


async def test_stream_abort_chunk_with_status_code_is_the_refusal_it_carries() -> None:
    """SGLang (tokenizer_manager._handle_abort_finish_reason) streams a refusal as an ordinary chunk whose
    finish_reason is {"type": "abort", "status_code": 400 | 500 | 503, "message", "err_type"}."""
    def chunk(status: int, message: str) -> str:
        out = body([], {"type": "abort", "message": message, "status_code": status, "err_type": None})
        return f"data: {json.dumps(out)}\n\ndata: [DONE]\n\n"

    current = {"answer": ""}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=current["answer"], headers={"content-type": "text/event-stream"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        router = EngineRouter([EngineClient("http://e", http)])

        async def refusal(status: int, message: str) -> Exception:
            current["answer"] = chunk(status, message)
            with pytest.raises(Exception) as err:
                await collect(router, [1, 2], SamplingParams(max_new_tokens=4), affinity_key=None, stream=True)
            return err.value

        bad = await refusal(400, "The input (9000 tokens) is longer than the model's context length")
        assert type(bad).__name__ == "ContextLengthExceeded" and bad.status == 400
        other = await refusal(400, "json schema is invalid")
        assert type(other) is InvalidRequest
        assert isinstance(await refusal(503, "server is shutting down"), EngineUnavailable)
        assert type(await refusal(500, "internal")) is EngineError
        assert router.engines[0].healthy  # a refusal says nothing about the engine's health


def test_retracted_then_aborted_chunk_recovers_ids_from_logprob_entries() -> None:
    """SGLang 0.5.19 ends a stream whose request was retracted, then aborted, with output_ids=[last] but
    the cumulative output_token_logprobs; the entries name their tokens."""
    chunk = body([7], {"type": "abort", "message": "paused"})
    chunk["meta_info"]["output_token_logprobs"] = [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None]]
    out = parse_output(chunk)
    assert out.output_ids == [5, 6, 7] and out.logprobs == [-0.1, -0.2, -0.3] and out.finish == "abort"
    chunk["output_ids"] = [9]  # not their tail: still an error
    with pytest.raises(EngineError, match="logprobs"):
        parse_output(chunk)


async def test_weight_version_is_read_from_get_model_info() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_model_info":
            return httpx.Response(200, json={"model_path": "/m", "weight_version": "7"})
        return httpx.Response(404, json={"detail": "Not Found"})  # /get_weight_version in SGLang 0.5.19

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        assert await EngineClient("http://e", http).weight_version() == 7


def test_model_name_survives_a_disk_push() -> None:
    """After /update_weights_from_disk SGLang reports the push directory as model_path and served_model_name
    (TokenizerManager._update_model_path_info, 0.5.19); a gateway restarted then still names the model."""
    from gateway.app import model_name
    from gateway.engines import EngineInfo

    after_push = EngineInfo(model_path="/sync/push-000003", tokenizer_path="/models/smollm2", weight_version=3,
                            context_length=0)
    assert model_name(after_push) == "smollm2"
    assert model_name(EngineInfo("/models/Qwen2.5-1.5B", None, None, 0)) == "Qwen2.5-1.5B"


async def test_router_records_per_token_versions_from_weight_version_spans() -> None:
    """A request the engine held across a push (retract / in_place pause without the gateway) finishes with
    SGLang 0.5.19's weight_versions spans: each token is recorded with its own version, not the last one."""
    answer = body([5, 6, 7, 8, EOT], {"type": "stop", "matched": EOT}, version="4")
    answer["meta_info"]["weight_versions"] = [{"version": "3", "start": 0, "end": 2},
                                              {"version": "4", "start": 2, "end": 5}]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=answer)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        router = EngineRouter([EngineClient("http://e", http)])
        gen = await collect(router, [1, 2], SamplingParams(max_new_tokens=8), affinity_key=None, stream=False)
    assert gen.versions == [3, 3, 4, 4, 4] and gen.finish == "stop"
    from gateway.engine_client import span_versions

    assert span_versions([{"version": "3", "start": 0, "end": 2}], 3) is None  # spans not covering: unused
    assert span_versions([{"version": "default", "start": 0, "end": 3}], 3) is None


async def test_a_constrained_generation_starts_over_after_a_pause_instead_of_continuing() -> None:
    """A grammar cannot continue from prompt + partial output (the engine would restart it inside the
    output): unstreamed, the partial output is dropped and the request re-sent as it was; streamed, once
    tokens went out, the stream fails instead of producing output the grammar never checked."""
    grammar = {"regex": "[a-z]+"}
    calls: list[dict[str, Any]] = []
    router_box: list[EngineRouter] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/pause_generation", "/continue_generation"):
            return httpx.Response(200, json={"status": "ok"})
        req = json.loads(request.content)
        calls.append(req)
        if len(calls) == 1:  # a weight sync pauses the engines while this one runs: aborted with 2 tokens
            await router_box[0].pause()
            return httpx.Response(200, json=body([10, 11], {"type": "abort", "message": "paused"}))
        return httpx.Response(200, json=body([20, 21, 22, EOT], {"type": "stop", "matched": EOT}))

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        router = EngineRouter([EngineClient("http://a", http)])
        router_box.append(router)
        params = SamplingParams(max_new_tokens=20, grammar=grammar)
        task = asyncio.create_task(collect(router, [1, 2], params, affinity_key=None, stream=False))
        await until_held(router)
        assert router.held == 1
        await router.resume(3)
        gen = await asyncio.wait_for(task, 120)
    assert gen.output_ids == [20, 21, 22, EOT] and gen.versions == [3] * 4  # all of it from the new weights
    assert calls[1]["input_ids"] == [1, 2] and calls[1]["sampling_params"]["max_new_tokens"] == 20
    assert calls[1]["sampling_params"]["regex"] == "[a-z]+"

    engine = FakeEngine("a", [10, 11, 12, 13, 14, 15, EOT])
    engine.hold_at_step = True
    router, clients = make_router(engine)

    async def consume() -> None:
        async for _ in router.generate([1, 2], SamplingParams(max_new_tokens=50, grammar=grammar),
                                       affinity_key=None, stream=True):
            pass

    task = asyncio.create_task(consume())
    await asyncio.wait_for(engine.step.wait(), 120)  # a hang guard
    await router.pause()
    with pytest.raises(EngineError, match="grammar-constrained stream was interrupted"):
        await asyncio.wait_for(task, 120)
    assert len(engine.requests) == 1  # never re-sent as prompt + partial output
    await router.resume(1)
    for c in clients:
        await c.aclose()


class BusyEngine(FakeEngine):
    """SGLang's /health queued behind a large running batch: the probe outlasts the gateway's 5 s."""

    def __init__(self, name: str, reply: list[int]) -> None:
        super().__init__(name, reply)
        self.probe_times_out = True

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health" and self.probe_times_out:
            raise httpx.ReadTimeout("health generation queued behind the batch", request=request)
        return await super().handler(request)


async def test_busy_engine_that_misses_a_health_probe_while_producing_output_stays_in_rotation() -> None:
    """Seen on the H200 run: 128 concurrent episodes, the probe timed out, the engine left the rotation
    and requests got 503s while it was serving them."""
    engine = BusyEngine("a", [5, EOT])
    router, clients = make_router(engine)
    state = router.engines[0]
    gen = await collect(router, [1], SamplingParams(max_new_tokens=5), affinity_key=None, stream=True)
    assert gen.output_ids == [5, EOT] and state.last_output > 0  # output received: progress recorded
    state.in_flight = 3  # requests still running on it
    await router.check_health()
    assert state.healthy  # missed probe, but busy and producing output
    state.last_output -= router.busy_window_s + 1  # no output for longer than the window: a hung engine
    await router.check_health()
    assert not state.healthy
    state.in_flight = 0
    engine.probe_times_out = False
    await router.check_health()
    assert state.healthy
    idle = BusyEngine("b", [5, EOT])  # an idle engine that fails its probe is out, as before
    router2, clients2 = make_router(idle)
    await router2.check_health()
    assert not router2.engines[0].healthy
    for c in clients + clients2:
        await c.aclose()


def test_a_continued_segment_asks_only_for_the_minimum_still_owed() -> None:
    params = SamplingParams(max_new_tokens=50, penalties={"min_new_tokens": 10, "repetition_penalty": 1.1})
    assert params.continued(0) is params
    assert params.continued(4).penalties == {"min_new_tokens": 6, "repetition_penalty": 1.1}
    assert params.continued(10).penalties == {"repetition_penalty": 1.1}  # met: no minimum left
    assert params.penalties["min_new_tokens"] == 10  # the request's own parameters are untouched
    plain = SamplingParams(max_new_tokens=5)
    assert plain.continued(3) is plain


class LoadingEngine(FakeEngine):
    """An engine loading weights: alive (it accepts connections) but answering no probe in time, its
    /health nor its liveness route, until ``loaded`` is set; ``probes`` counts the probes it missed."""

    def __init__(self, name: str, reply: list[int]) -> None:
        super().__init__(name, reply)
        self.loaded = asyncio.Event()
        self.loaded.set()
        self.missed = 0
        self.probed = asyncio.Event()

    async def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path in ("/health", "/get_model_info", "/model_info"):
            if not self.loaded.is_set():
                self.missed += 1
                self.probed.set()
                raise httpx.ReadTimeout("busy loading weights", request=request)
            if path != "/health":
                return httpx.Response(200, json={"model_path": "/m", "weight_version": "0"})
        return await super().handler(request)


async def test_the_engine_a_push_loads_into_stays_in_rotation_and_serves_right_after_resume() -> None:
    """issue 32: with one engine, every push gave ~5 s of 503 "no healthy engine": the probe during the load
    took it out, and it came back only at the next probe after resume."""
    engine = LoadingEngine("a", [5, EOT])
    router, clients = make_router(engine)
    await router.pause()
    engine.loaded.clear()  # the push: the engine loads weights and answers no probe
    await router.check_health()  # the health loop runs during the push
    assert engine.missed == 1 and router.engines[0].healthy  # paused by the router for a push: kept
    engine.loaded.set()
    await router.resume(1)
    gen = await collect(router, [1], SamplingParams(max_new_tokens=5), affinity_key=None, stream=False)
    assert gen.output_ids == [5, EOT] and gen.versions == [1, 1]
    for c in clients:
        await c.aclose()


async def test_a_request_waits_for_the_only_engine_while_it_misses_probes_and_is_served_after() -> None:
    """Pushed to without the gateway (DirectControl), the only engine misses its /health probe while it loads
    and leaves the rotation; a request then waits for it (bounded) instead of getting 503 at once."""
    engine = LoadingEngine("a", [5, EOT])
    router, clients = make_router(engine)
    engine.loaded.clear()
    await router.check_health()
    assert not router.engines[0].healthy and router.engines[0].busy
    engine.probed.clear()
    request = asyncio.create_task(collect(router, [1], SamplingParams(max_new_tokens=5), affinity_key=None,
                                          stream=False))
    await asyncio.wait_for(engine.probed.wait(), 60)  # the waiting request probes the engine again
    assert not request.done() and engine.requests == []  # waiting, nothing sent, no 503
    engine.loaded.set()
    gen = await asyncio.wait_for(request, 60)
    assert gen.output_ids == [5, EOT] and router.engines[0].healthy
    for c in clients:
        await c.aclose()


async def test_the_wait_for_a_busy_engine_is_bounded_and_a_refusing_one_is_not_waited_for() -> None:
    engine = LoadingEngine("a", [5, EOT])
    router, clients = make_router(engine)
    router.busy_wait_s = 0.0  # bounded: one more probe, then 503
    engine.loaded.clear()
    await router.check_health()
    before = engine.missed
    with pytest.raises(EngineUnavailable, match="no healthy engine"):
        await collect(router, [1], SamplingParams(max_new_tokens=5), affinity_key=None, stream=False)
    assert engine.missed == before + 1
    dead = FakeEngine("b", [5, EOT])
    router2, clients2 = make_router(dead)
    router2.busy_wait_s = 1e9  # a wait would hang the test: a refused connection is 503 at once
    dead.healthy = False
    await router2.check_health()
    assert not router2.engines[0].busy
    with pytest.raises(EngineUnavailable):
        await asyncio.wait_for(collect(router2, [1], SamplingParams(max_new_tokens=5), affinity_key=None,
                                       stream=False), 60)
    for c in clients + clients2:
        await c.aclose()


class SchedulerFake:
    """SGLang's scheduler as pause modes and the update's flush see it (``Scheduler.pause_generation``,
    ``flush_cache``, ``flush_cache_after_weight_update``; 0.5.19 and 0.5.23 read): ``in_place`` leaves
    running requests in the batch (the scheduler stops; an abort reaches them only when it runs again),
    ``retract`` moves them to the waiting queue, ``abort`` ends them. An update with ``flush_cache`` (the
    default) that finds a request running or waiting kills 0.5.19 (an assertion in the scheduler) and is a
    400 on 0.5.23 (which ignores the waiting queue while paused)."""

    def __init__(self, version: str, reply: list[int]) -> None:
        self.version, self.reply = version, reply
        self.stopped = False  # the scheduler is paused (in_place / retract)
        self.running: set[str] = set()
        self.waiting: set[str] = set()
        self.aborted: set[str] = set()
        self.changed = asyncio.Condition()
        self.started = asyncio.Event()
        self.allow = asyncio.Event()  # the test lets tokens after the first flow (a story still running)
        self.dead = False
        self.requests: list[dict[str, Any]] = []

    def idle(self) -> bool:
        return not self.running and (not self.waiting or (self.version == "0.5.23" and self.stopped))

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if self.dead:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        payload = json.loads(request.content) if request.content else {}
        if path == "/pause_generation":
            mode = payload.get("mode", "abort")
            if mode == "abort":
                if not self.stopped:  # the scheduler runs: it processes the aborts of running requests
                    self.aborted |= self.running
                    self.running.clear()
                self.aborted |= self.waiting  # aborted in the waiting queue at once
                self.waiting.clear()
            else:
                self.stopped = True
                if mode == "retract":
                    self.waiting |= self.running
                    self.running.clear()
            async with self.changed:
                self.changed.notify_all()
            return httpx.Response(200, json={"status": "ok"})
        if path == "/continue_generation":
            self.stopped = False
            self.running |= self.waiting
            self.waiting.clear()
            async with self.changed:
                self.changed.notify_all()
            return httpx.Response(200, json={"status": "ok"})
        if path == "/update_weights_from_disk":
            if payload.get("flush_cache", True) and not self.idle():
                if self.version == "0.5.19":
                    self.dead = True  # AssertionError: Cache flush failed after updating weights
                    raise httpx.RemoteProtocolError("server disconnected", request=request)
                return httpx.Response(400, json={"success": False, "message": "Weights were updated, but the cache "
                                                 "was not flushed because requests are still running or queued."})
            self.version_tag = payload.get("weight_version")
            return httpx.Response(200, json={"success": True, "message": "ok", "num_paused_requests": 0})
        self.requests.append(payload)
        rid = payload["rid"]
        self.running.add(rid)
        out = self.reply if len(self.requests) == 1 else self.reply[len(payload["input_ids"]) - 1:]
        tag = getattr(self, "version_tag", "0")

        async def events() -> Any:
            for k in range(1, len(out) + 1):
                if k == 2:
                    self.started.set()
                async with self.changed:
                    await self.changed.wait_for(lambda: rid in self.aborted or (
                        not self.stopped and rid in self.running and (k == 1 or self.allow.is_set())))
                if rid in self.aborted:
                    yield f"data: {json.dumps(body(out[:k - 1], {'type': 'abort', 'message': 'paused'}, tag))}\n\n".encode()
                    break
                done = {"type": "stop", "matched": EOT} if k == len(out) else None
                yield f"data: {json.dumps(body(out[:k], done, tag))}\n\n".encode()
            self.running.discard(rid)
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})


@pytest.mark.parametrize("version", ["0.5.19", "0.5.23"])
@pytest.mark.parametrize("operator_mode", ["in_place", "retract"])
async def test_a_push_after_an_operators_in_place_or_retract_pause_keeps_sglang_alive(version, operator_mode) -> None:
    """issue 35: /admin/pause accepts in_place and retract, but a push through the gateway updates with
    flush_cache; over an in_place pause the running batch was still there: 0.5.19 died, 0.5.23 refused.
    The push's abort pause now continues the engines first, so the abort empties them."""
    engine = SchedulerFake(version, [5, 6, 7, EOT])
    http = httpx.AsyncClient(transport=httpx.MockTransport(engine.handler))
    client = EngineClient("http://sglang", http)
    router = EngineRouter([client])
    request = asyncio.create_task(collect(router, [1], SamplingParams(max_new_tokens=8), affinity_key=None,
                                          stream=True))
    await asyncio.wait_for(engine.started.wait(), 60)
    await router.pause(operator_mode)  # the operator's pause
    await router.pause("abort")  # the push's pause (GatewayControl: /admin/pause {})
    assert engine.idle() and not engine.stopped
    result = await client.update_weights_from_disk("/sync/v1", weight_version=1)  # flush_cache: SGLang's default
    assert result["success"] and not engine.dead
    await router.resume(1)
    engine.allow.set()
    async with engine.changed:
        engine.changed.notify_all()
    gen = await asyncio.wait_for(request, 60)
    assert gen.output_ids == [5, 6, 7, EOT] and gen.finish == "stop"
    assert gen.versions == [0, 1, 1, 1] and gen.segments == 2  # held across the push, finished under v1
    await http.aclose()


@pytest.mark.parametrize("release", ["0.5.19", "0.5.23", None])
async def test_the_client_learns_the_servers_info_routes_and_probes_a_paused_engine_with_them(release) -> None:
    """SGLang (both releases) has /server_info and /model_info and logs a deprecation warning on every call of
    the get_ names, which the paused-engine probe used to call every 5 s; the embedded engine (None) has only
    the get_ names."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        seen.append(path)
        modern = release is not None
        if path == ("/server_info" if modern else "/get_server_info"):
            return httpx.Response(200, json={"version": release or "agentrl-embedded-0.1", "tp_size": 1,
                                             "context_length": 4096})
        if path == ("/model_info" if modern else "/get_model_info"):
            return httpx.Response(200, json={"model_path": "/m", "tokenizer_path": "/m", "weight_version": "3"})
        return httpx.Response(404, json={"detail": "Not Found"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        client = EngineClient("http://e", http)
        info = await client.describe()
        assert info.weight_version == 3 and info.context_length == 4096 and info.model_path == "/m"
        assert await client.health(paused=True) is True
        assert await client.weight_version() == 3
    route = "/model_info" if release else "/get_model_info"
    assert seen.count(route) == 3
    assert ("/get_model_info" in seen) is (release is None) and "/get_server_info" not in seen[:1]


def test_every_kind_has_a_gateway_client_and_trainer_calls_in_its_own_module() -> None:
    """engines.kinds is the one place that knows the kinds: each named kind has its module's client (which
    implements the Engine protocol without subclassing another kind's) and its control calls."""
    import inspect

    from engines import ENGINE_KINDS
    from engines.base import Engine
    from engines.caller import EngineCaller
    from engines.kinds import CLIENTS, OPS
    from engines.transport import HTTPXTransport

    assert ["auto", *CLIENTS] == list(ENGINE_KINDS) and set(OPS) == set(CLIENTS)
    http = httpx.AsyncClient()
    for kind, cls in CLIENTS.items():
        assert cls.__module__ == f"engines.{kind}" == OPS[kind].__module__
        # its own class over the one shared caller (engines.caller), never another kind's client
        assert [c for c in inspect.getmro(cls) if c.__module__.startswith("engines.")] == [cls, EngineCaller]
        client = cls("http://e", HTTPXTransport(http))
        assert isinstance(client, Engine) and client.kind == kind
