"""The gateway's SGLang client and the embedded engine, both held to SGLang's real wire format.

The fixtures in ``tests/fixtures/sglang/`` reproduce real SGLang responses (shapes taken from SGLang's source;
see ``make_fixtures.py``). Two sides are checked against them:

1. ``gateway.engine_client`` (driven through ``respx`` at the HTTP boundary): what it sends is a request
   SGLang accepts (known ``GenerateReqInput`` fields and ``SamplingParams`` keys), and it reads every
   fixture (each finish reason, streams, aborts, errors, weight updates) into the right values.
2. The embedded engine (a real ``agentrl engine --model tiny`` process): its responses have every key of the
   fixtures, with the same JSON types and the same ``finish_reason`` shapes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "sglang"

# Top-level fields of SGLang's GenerateReqInput and keys of SamplingParams (io_struct.py, sampling_params.py,
# SGLang 0.5.x). SGLang ignores another top-level field (pydantic's default for its dataclass; checked with its
# own class in test_sglang_own_code.py), so sending one would silently lose its meaning; an unknown sampling
# key fails SamplingParams(**params).
GENERATE_FIELDS = {
    "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data", "sampling_params", "rid",
    "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs",
    "stream", "log_metrics", "return_hidden_states", "modalities", "session_params", "lora_path", "lora_id",
    "custom_logit_processor", "bootstrap_host", "bootstrap_port", "bootstrap_room", "data_parallel_rank",
    "background", "priority", "extra_key", "no_logs", "custom_labels", "return_bytes",
}
SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "custom_params", "stream_interval", "logit_bias", "sampling_seed",
}


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def response_of(fx: dict[str, Any]) -> httpx.Response:
    if "body" in fx:
        return httpx.Response(fx["status"], json=fx["body"])
    return httpx.Response(fx["status"], content=fx["body_text"].encode(), headers={"content-type": fx["content_type"]})


def sse_events(text: str) -> list[Any]:
    events = [block[len("data: "):] for block in text.split("\n\n") if block.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ------------------------------------------------------------------------------------------------------
# 1. the gateway's client against the fixtures
# ------------------------------------------------------------------------------------------------------

engine_client = pytest.importorskip("gateway.engine_client", reason="gateway/engine_client.py not there yet")
gateway_errors = pytest.importorskip("gateway.errors")
BASE = "http://sglang.test:30000"


@pytest.fixture
async def client():
    async with httpx.AsyncClient() as http:
        yield engine_client.EngineClient(BASE, http)


def check_request(request: httpx.Request) -> dict[str, Any]:
    body = json.loads(request.content)
    assert set(body) <= GENERATE_FIELDS, f"fields SGLang's GenerateReqInput lacks: {set(body) - GENERATE_FIELDS}"
    assert set(body["sampling_params"]) <= SAMPLING_KEYS, set(body["sampling_params"]) - SAMPLING_KEYS
    assert "text" not in body and all(isinstance(t, int) for t in body["input_ids"])  # token in
    assert body["return_logprob"] is True
    return body


NON_STREAM = ["generate_stop_eos", "generate_stop_token", "generate_stop_string", "generate_length",
              "generate_abort_running", "generate_abort_waiting", "generate_default_version"]


@pytest.mark.parametrize("name", NON_STREAM)
async def test_client_reads_every_non_stream_generate_response(client, name):
    fx = fixture(name)
    body, meta = fx["body"], fx["body"]["meta_info"]
    params = engine_client.SamplingParams(max_new_tokens=16, seed=7, stop=["\n\n"], stop_token_ids=[2])
    with respx.mock:
        route = respx.post(f"{BASE}/generate").mock(return_value=response_of(fx))
        out = await client.generate(fx["request"]["input_ids"], params, 16)
    sent = check_request(route.calls.last.request)
    assert sent["input_ids"] == fx["request"]["input_ids"] and sent["stream"] is False
    assert sent["sampling_params"]["max_new_tokens"] == 16
    # the exact tokens, including a matched stop token, and one logprob per token
    assert out.output_ids == body["output_ids"]
    assert out.logprobs == [entry[0] for entry in meta["output_token_logprobs"]]
    assert out.finish == meta["finish_reason"]["type"]
    assert out.matched == meta["finish_reason"].get("matched")
    version = meta["weight_version"]
    assert out.weight_version == (int(version) if version.isdigit() else None)
    assert out.prompt_tokens == meta.get("prompt_tokens", 0)


@pytest.mark.parametrize("name", ["generate_stream_stop", "generate_stream_length", "generate_stream_abort"])
async def test_client_reads_cumulative_streams(client, name):
    fx = fixture(name)
    chunks = sse_events(fx["body_text"])
    params = engine_client.SamplingParams(max_new_tokens=16)
    with respx.mock:
        route = respx.post(f"{BASE}/generate").mock(return_value=response_of(fx))
        outs = [o async for o in client.generate_stream(fx["request"]["input_ids"], params, 16)]
    assert check_request(route.calls.last.request)["stream"] is True
    assert len(outs) == len(chunks)
    ids: list[int] = []
    logprobs: list[float] = []
    for out, chunk in zip(outs, chunks):  # cumulative: each chunk holds everything so far, read past `start`
        assert 0 <= out.start <= len(ids)
        ids[out.start:], logprobs[out.start:] = out.output_ids, out.logprobs
        assert ids == chunk["output_ids"]
        assert logprobs == [e[0] for e in chunk["meta_info"]["output_token_logprobs"]]
    assert len(outs) < 3 or max(o.start for o in outs) > 0  # later chunks are read from their new tokens on
    assert [o.finish for o in outs[:-1]] == [None] * (len(outs) - 1)
    assert outs[-1].finish == chunks[-1]["meta_info"]["finish_reason"]["type"]


async def test_client_reads_a_retracted_then_aborted_stream_whole(client):
    """0.5.19's last chunk for a request aborted while waiting (a retract pause put it there) carries only the
    last output id, with cumulative logprobs (fixture produced by SGLang's own _handle_abort_req)."""
    fx = fixture("generate_stream_abort_retracted")
    chunks = sse_events(fx["body_text"])
    with respx.mock:
        respx.post(f"{BASE}/generate").mock(return_value=response_of(fx))
        outs = [o async for o in client.generate_stream(fx["request"]["input_ids"], engine_client.SamplingParams(max_new_tokens=16), 16)]
    before, last = chunks[-2], chunks[-1]  # the last cumulative chunk, then the abort answer
    entries = [e[1] for e in last["meta_info"]["output_token_logprobs"]]
    assert len(last["output_ids"]) == 1 and last["meta_info"]["completion_tokens"] == len(entries) == 3
    assert outs[-1].output_ids == before["output_ids"] + last["output_ids"] == entries
    assert outs[-1].logprobs == [e[0] for e in last["meta_info"]["output_token_logprobs"]]
    assert outs[-1].finish == "abort" and outs[-1].abort_status is None  # a pause: held, then re-sent
    assert outs[-1].versions == [0, 0, 0]


async def test_client_raises_the_error_event_of_a_stream(client):
    fx = fixture("generate_stream_error")
    with respx.mock:
        respx.post(f"{BASE}/generate").mock(return_value=response_of(fx))
        # bad input, as the same request unstreamed (a 400), not an engine failure (502)
        with pytest.raises(gateway_errors.ContextLengthExceeded, match="longer than the model's context length"):
            async for _ in client.generate_stream(fx["request"]["input_ids"],
                                                  engine_client.SamplingParams(max_new_tokens=16), 16):
                pass


@pytest.mark.parametrize("name,message", [
    ("generate_error_validation", "validation error"),
    ("generate_error_context", "longer than the model's context length"),
])
async def test_client_turns_sglang_400s_into_invalid_request(client, name, message):
    fx = fixture(name)
    with respx.mock:
        respx.post(f"{BASE}/generate").mock(return_value=response_of(fx))
        with pytest.raises(gateway_errors.InvalidRequest, match=message):
            await client.generate([1, 2, 3], engine_client.SamplingParams(max_new_tokens=4), 4)


async def test_client_sends_a_grammar_and_reads_the_constrained_output(client):
    fx = fixture("generate_json_schema")
    schema = fx["request"]["sampling_params"]["json_schema"]
    params = engine_client.SamplingParams(max_new_tokens=16, stop_token_ids=[2], grammar={"json_schema": schema})
    with respx.mock:
        route = respx.post(f"{BASE}/generate").mock(return_value=response_of(fx))
        out = await client.generate(fx["request"]["input_ids"], params, 16)
    sent = check_request(route.calls.last.request)
    assert sent["sampling_params"]["json_schema"] == schema  # SGLang's key, the schema as a string
    assert out.output_ids == fx["body"]["output_ids"] and out.finish == "stop"


async def test_client_turns_grammar_refusals_into_invalid_request(client):
    params = engine_client.SamplingParams(max_new_tokens=4, grammar={"regex": "a[b-c"})
    with respx.mock:
        respx.post(f"{BASE}/generate").mock(return_value=response_of(fixture("generate_error_grammar")))
        with pytest.raises(gateway_errors.InvalidRequest, match="Failed to compile regex grammar"):
            await client.generate([1, 2, 3], params, 4)
    with respx.mock:
        respx.post(f"{BASE}/generate").mock(return_value=response_of(fixture("generate_stream_error_grammar")))
        router = engine_client.EngineRouter([client])
        with pytest.raises(gateway_errors.InvalidRequest, match="Failed to compile regex grammar"):
            async for _ in router.generate([1, 2, 3], params, affinity_key=None, stream=True):
                pass


async def test_client_control_and_weight_routes(client):
    with respx.mock:
        respx.get(f"{BASE}/health").mock(return_value=response_of(fixture("health")))
        respx.get(f"{BASE}/get_model_info").mock(return_value=response_of(fixture("get_model_info")))
        pause = respx.post(f"{BASE}/pause_generation").mock(return_value=response_of(fixture("pause_generation")))
        cont = respx.post(f"{BASE}/continue_generation").mock(
            return_value=response_of(fixture("continue_generation")))
        update = respx.post(f"{BASE}/update_weights_from_disk").mock(
            return_value=response_of(fixture("update_weights_from_disk_ok")))
        assert await client.health() is True
        assert (await client.model_info())["model_path"].startswith("/models/")
        assert await client.weight_version() == 0
        await client.pause("abort")
        await client.continue_generation()
        result = await client.update_weights_from_disk("/weights/step-1", weight_version=1)
    assert json.loads(pause.calls.last.request.content) == {"mode": "abort"}
    assert json.loads(cont.calls.last.request.content) == {}
    sent = json.loads(update.calls.last.request.content)
    assert sent == {"model_path": "/weights/step-1", "weight_version": "1"}  # SGLang takes the version as a string
    assert result["success"] is True and result["num_paused_requests"] == 0


async def test_client_reports_a_failed_weight_update(client):
    fx = fixture("update_weights_from_disk_fail")
    with respx.mock:
        respx.post(f"{BASE}/update_weights_from_disk").mock(return_value=response_of(fx))
        with pytest.raises(gateway_errors.GatewayError, match="Failed to get weights iterator"):
            await client.update_weights_from_disk("/weights/missing", weight_version=1)


async def test_router_resumes_an_aborted_generation_with_the_new_version():
    """Pause (abort mode) mid-generation, resume with version 1: the second request is prompt + partial output,
    and the tokens carry the version of the segment that produced them."""
    aborted, finished = fixture("generate_abort_running"), fixture("generate_stop_eos")
    resumed_body = json.loads(json.dumps(finished["body"]))
    resumed_body["meta_info"]["weight_version"] = "1"
    resumed_body["meta_info"]["weight_versions"][0]["version"] = "1"  # SGLang's spans agree with it
    prompt = aborted["request"]["input_ids"]
    partial = aborted["body"]["output_ids"]
    paused = asyncio.Event()
    sent: list[dict[str, Any]] = []

    async def on_generate(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        if len(sent) == 1:
            await paused.wait()  # the engine answers the in-flight request once it has been paused
            return httpx.Response(200, json=aborted["body"])
        return httpx.Response(200, json=resumed_body)

    async with httpx.AsyncClient() as http:
        router = engine_client.EngineRouter([engine_client.EngineClient(BASE, http)])
        with respx.mock:
            respx.post(f"{BASE}/generate").mock(side_effect=on_generate)
            respx.post(f"{BASE}/pause_generation").mock(return_value=response_of(fixture("pause_generation")))
            respx.post(f"{BASE}/continue_generation").mock(return_value=response_of(fixture("continue_generation")))

            async def consume():
                return [g async for g in router.generate(prompt, engine_client.SamplingParams(max_new_tokens=16),
                                                         affinity_key="s", stream=False)]

            task = asyncio.create_task(consume())
            while not sent:
                await asyncio.sleep(0.01)
            await router.pause("abort")
            paused.set()
            while router.held == 0:
                await asyncio.sleep(0.01)
            await router.resume(1)
            gens = await asyncio.wait_for(task, 5)
    assert len(sent) == 2
    assert sent[1]["input_ids"] == prompt + partial
    assert sent[1]["sampling_params"]["max_new_tokens"] == 16 - len(partial)
    final = gens[-1]
    assert final.finish == "stop"
    assert final.output_ids == partial + finished["body"]["output_ids"]
    assert final.versions == [0] * len(partial) + [1] * len(finished["body"]["output_ids"])


# ------------------------------------------------------------------------------------------------------
# 1b. the trainer's weight-sync client against the fixtures
# ------------------------------------------------------------------------------------------------------

# request fields of SGLang's UpdateWeightFromDiskReqInput / UpdateWeightsFromDistributedReqInput /
# InitWeightsUpdateGroupReqInput (io_struct.py, 0.5.x)
DISK_FIELDS = {"model_path", "load_format", "abort_all_requests", "weight_version", "is_async",
               "keep_pause", "recapture_cuda_graph", "flush_cache"}
DISTRIBUTED_FIELDS = {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
                      "weight_version", "load_format"}
TORCH_DTYPE_NAMES = {"float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "bool"}


def test_trainer_disk_push_speaks_sglang(tmp_path):
    weight_sync = pytest.importorskip("trainer.weight_sync")
    with httpx.Client() as http, respx.mock:
        route = respx.post(f"{BASE}/update_weights_from_disk").mock(
            return_value=response_of(fixture("update_weights_from_disk_ok")))
        sync = weight_sync.DiskSync(sync_dir=tmp_path, source_dir=tmp_path, client=http)
        updated: list[str] = []
        sync.send([BASE], 3, tmp_path / "v3", updated)
        assert updated == [BASE]
        body = json.loads(route.calls.last.request.content)
        assert set(body) <= DISK_FIELDS
        assert body == {"model_path": str(tmp_path / "v3"), "weight_version": "3",  # the version as a string
                        "flush_cache": True}

        route.mock(return_value=response_of(fixture("update_weights_from_disk_fail")))
        with pytest.raises(weight_sync.WeightSyncError, match="400.*Failed to get weights iterator"):
            sync.send([BASE], 4, tmp_path / "v4", [])


def test_trainer_broadcast_bucket_speaks_sglang():
    weight_sync = pytest.importorskip("trainer.weight_sync")
    import torch

    bucket = [("model.embed_tokens.weight", torch.zeros(8, 4, dtype=torch.bfloat16)),
              ("model.norm.weight", torch.ones(4))]
    broadcasts: list[list[Any]] = []
    with httpx.Client() as http, respx.mock:
        route = respx.post(f"{BASE}/update_weights_from_distributed").mock(
            return_value=response_of(fixture("update_weights_from_distributed_ok")))
        sync = weight_sync.BroadcastSync(client=http, bucket_bytes=1 << 20)
        # the tensor side (NCCL/gloo broadcast) is recorded here; the HTTP side is SGLang's route
        error = sync._send_bucket(bucket, [BASE], 5, lambda group, tensors, src: broadcasts.append(tensors))
        assert error is None and len(broadcasts) == 1
        body = json.loads(route.calls.last.request.content)
        assert set(body) <= DISTRIBUTED_FIELDS
        assert body["names"] == ["model.embed_tokens.weight", "model.norm.weight"]
        assert body["dtypes"] == ["bfloat16", "float32"] and set(body["dtypes"]) <= TORCH_DTYPE_NAMES
        assert body["shapes"] == [[8, 4], [4]]
        assert body["weight_version"] == "5" and body["group_name"] == "weight_update_group"

        route.mock(return_value=response_of(fixture("update_weights_from_distributed_fail")))
        error = sync._send_bucket(bucket, [BASE], 6, lambda group, tensors, src: None)
        assert error is not None and "Failed to update parameter online" in error


def test_trainer_direct_pause_and_continue_speak_sglang():
    weight_sync = pytest.importorskip("trainer.weight_sync")
    with httpx.Client() as http, respx.mock:
        pause = respx.post(f"{BASE}/pause_generation").mock(return_value=response_of(fixture("pause_generation")))
        cont = respx.post(f"{BASE}/continue_generation").mock(
            return_value=response_of(fixture("continue_generation")))
        flush = respx.post(f"{BASE}/flush_cache").mock(return_value=response_of(fixture("flush_cache")))
        control = weight_sync.DirectControl([BASE], client=http)
        control.pause()
        control.resume(2)
    assert json.loads(pause.calls.last.request.content)["mode"] == "retract"
    assert flush.called and json.loads(cont.calls.last.request.content) == {}


def test_trainer_memory_release_speaks_sglang():
    from trainer.engine_ops import EngineOpsError, SGLangOps

    with httpx.Client() as http, respx.mock:
        release = respx.post(f"{BASE}/release_memory_occupation").mock(
            return_value=response_of(fixture("release_memory_occupation_ok")))
        resume = respx.post(f"{BASE}/resume_memory_occupation").mock(
            return_value=response_of(fixture("resume_memory_occupation_ok")))
        ops = SGLangOps(http, BASE)
        ops.release_memory(["kv_cache"])  # a null body is success
        ops.resume_memory(["kv_cache"])
        assert json.loads(release.calls.last.request.content) == fixture("release_memory_occupation_ok")["request"]
        assert json.loads(resume.calls.last.request.content) == fixture("resume_memory_occupation_ok")["request"]
        release.mock(return_value=response_of(fixture("release_memory_occupation_fail")))
        with pytest.raises(EngineOpsError, match="only when server is idle"):
            ops.release_memory(["kv_cache"])


# ------------------------------------------------------------------------------------------------------
# 2. the embedded engine's real responses against the fixtures
# ------------------------------------------------------------------------------------------------------

def shape(value: Any) -> Any:
    """JSON type tree: dicts keep their keys, lists the shape of their first element."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "int" if isinstance(value, int) else "float"
    return type(value).__name__


def assert_same_shape(real: Any, expected: Any, where: str = "body", *, lenient_numbers: bool = False) -> None:
    """Every key of the fixture is in the real response with the same JSON type (extra real keys are fine:
    SGLang adds keys between releases and clients ignore them)."""
    if isinstance(expected, dict):
        assert isinstance(real, dict), f"{where}: expected an object, got {real!r}"
        missing = set(expected) - set(real)
        assert not missing, f"{where}: keys SGLang sends that the embedded engine lacks: {sorted(missing)}"
        for key in expected:
            assert_same_shape(real[key], expected[key], f"{where}.{key}", lenient_numbers=lenient_numbers)
    elif isinstance(expected, list):
        assert isinstance(real, list), f"{where}: expected a list, got {real!r}"
        if expected and real:
            assert_same_shape(real[0], expected[0], f"{where}[0]", lenient_numbers=lenient_numbers)
    elif expected == "NoneType" or real == "NoneType":
        pass  # null-able fields (a logprob of the first prompt token, text in logprob entries)
    elif expected in ("int", "float") and real in ("int", "float"):
        assert real == expected or lenient_numbers or expected == "float", f"{where}: {real} instead of {expected}"
    else:
        assert real == expected, f"{where}: {real} instead of {expected}"


# keys only newer SGLang releases send; the embedded engine may leave them out (clients must not need them)
OPTIONAL_META = {"num_retractions", "reasoning_tokens"}
# FINISH_ABORT.to_json() adds status_code/err_type (null for pause/abort_request); an abort of a request still
# waiting in the queue has neither, so clients cannot rely on them. The embedded engine leaves them out.
OPTIONAL_ABORT = {"status_code", "err_type"}


def meta_shape(body: dict[str, Any]) -> dict[str, Any]:
    s = shape(body)
    for key in OPTIONAL_META:
        s["meta_info"].pop(key, None)
    if isinstance(s["meta_info"].get("finish_reason"), dict):
        for key in OPTIONAL_ABORT:
            s["meta_info"]["finish_reason"].pop(key, None)
    return s


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "agentrl", "engine", "--model", "tiny", "--port", str(port),
                                 "--device", "cpu", "--max-running-requests", "4", "--test-hooks"],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180  # a hang guard: the start imports torch, slow on a loaded machine
        while True:
            if proc.poll() is not None:
                pytest.fail(f"agentrl engine exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"agentrl engine not healthy after 180 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def greedy(request: dict[str, Any], **sampling: Any) -> dict[str, Any]:
    req = json.loads(json.dumps(request))
    req["sampling_params"].update({"temperature": 0.0, "stop_token_ids": [], **sampling})
    req["sampling_params"] = {k: v for k, v in req["sampling_params"].items() if v != []}
    return req


def test_engine_length_response_matches_sglang(engine_url):
    fx = fixture("generate_length")
    resp = post(engine_url, "/generate", greedy(fx["request"], max_new_tokens=8, ignore_eos=True))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert_same_shape(meta_shape(body), meta_shape(fx["body"]))
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert len(body["output_ids"]) == body["meta_info"]["completion_tokens"] == 8
    assert body["meta_info"]["prompt_tokens"] == len(fx["request"]["input_ids"])
    assert [e[1] for e in body["meta_info"]["output_token_logprobs"]] == body["output_ids"]
    assert body["meta_info"]["weight_version"].isdigit()


def test_engine_stop_token_and_stop_string_match_sglang(engine_url):
    request = fixture("generate_stop_token")["request"]
    free = post(engine_url, "/generate", greedy(request, max_new_tokens=6, ignore_eos=True)).json()
    first, ids = free["output_ids"][0], free["output_ids"]
    # greedy decoding is deterministic: stop at the token it produces first
    body = post(engine_url, "/generate", greedy(request, max_new_tokens=6, stop_token_ids=[first])).json()
    assert_same_shape(meta_shape(body), meta_shape(fixture("generate_stop_token")["body"]))
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    assert body["output_ids"] == [first], "SGLang keeps the matched stop token in output_ids"
    # stop string: the first characters of the same greedy text; the tokens that formed it stay in output_ids,
    # the text is cut before it
    stop = free["text"][:2]
    if not stop:
        pytest.skip(f"greedy output {ids} decodes to no text to use as a stop string")
    body = post(engine_url, "/generate", greedy(request, max_new_tokens=6, stop=[stop], ignore_eos=True)).json()
    assert_same_shape(meta_shape(body), meta_shape(fixture("generate_stop_string")["body"]))
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in body["text"]
    assert body["output_ids"] and body["output_ids"] == ids[: len(body["output_ids"])], \
        "the stop string's tokens stay in output_ids"


def test_engine_stream_and_abort_match_sglang(engine_url):
    fx = fixture("generate_stream_abort")
    request = greedy(fx["request"], max_new_tokens=2000, ignore_eos=True)
    events: list[str] = []

    def read_stream() -> None:
        with httpx.stream("POST", engine_url + "/generate", json=request, timeout=120) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])

    import threading

    from tests.engine_hooks import held_decoding, wait_for, wait_held

    reader = threading.Thread(target=read_stream)
    try:
        # the story is held at 3 tokens (--test-hooks) when the pause aborts it: a 2,000-token story can end
        # within seconds on a fast machine, so a pause after "3 events" could come too late
        with held_decoding(engine_url, 3):
            reader.start()
            wait_held(engine_url)
            # the engine streams cumulative snapshots and sends only the newest of those that queued up, so
            # three tokens may come as fewer than three events: wait for the event that holds all three
            wait_for(lambda: events and len(json.loads(events[-1])["output_ids"]) >= 3,
                     "the streamed event holding the three held tokens")
            paused = post(engine_url, "/pause_generation", {"mode": "abort"})
            assert paused.status_code == 200
            assert_same_shape(shape(paused.json()), shape(fixture("pause_generation")["body"]))
            reader.join(120)
    finally:
        cont = post(engine_url, "/continue_generation", {})
        reader.join(30)
    assert cont.status_code == 200
    assert_same_shape(shape(cont.json()), shape(fixture("continue_generation")["body"]))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    expected = sse_events(fx["body_text"])
    for chunk in chunks[:-1]:
        assert_same_shape(meta_shape(chunk), meta_shape(expected[0]))
        assert chunk["meta_info"]["finish_reason"] is None
    last = chunks[-1]
    assert_same_shape(meta_shape(last), meta_shape(expected[-1]))
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert isinstance(last["meta_info"]["finish_reason"].get("message"), str)
    assert 0 < len(last["output_ids"]) < 2000
    # cumulative: each chunk extends the one before
    for before, after in zip(chunks, chunks[1:]):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]


def test_engine_control_and_weight_update_responses_match_sglang(engine_url, tiny_model_dir):
    health = httpx.get(engine_url + "/health", timeout=10)
    assert health.status_code == 200
    info = httpx.get(engine_url + "/get_model_info", timeout=10).json()
    expected_info = fixture("get_model_info")["body"]
    for key in ("model_path", "tokenizer_path", "is_generation", "weight_version"):
        assert key in info, f"/get_model_info lacks {key}"
    assert isinstance(info["weight_version"], str) and isinstance(info["is_generation"], bool)
    assert set(expected_info) - set(info) <= {"preferred_sampling_params", "model_type", "architectures"}
    # the weight version is read where SGLang reports it, the model-info route (/get_weight_version is a 404
    # in SGLang 0.5.19 and gone in 0.5.23)
    before = int(info["weight_version"])
    ok = post(engine_url, "/update_weights_from_disk",
              {"model_path": str(tiny_model_dir), "weight_version": str(before + 1)})
    assert ok.status_code == 200, ok.text
    assert_same_shape(shape(ok.json()), shape(fixture("update_weights_from_disk_ok")["body"]))
    assert ok.json()["success"] is True
    assert httpx.get(engine_url + "/get_model_info", timeout=10).json()["weight_version"] == str(before + 1)

    bad = post(engine_url, "/update_weights_from_disk", {"model_path": "/nonexistent/weights", "weight_version": "9"})
    assert bad.status_code == 400
    assert_same_shape(shape(bad.json()), shape(fixture("update_weights_from_disk_fail")["body"]))
    assert bad.json()["success"] is False
    assert httpx.get(engine_url + "/get_model_info", timeout=10).json()["weight_version"] == str(before + 1)


def test_engine_errors_match_sglang(engine_url):
    bad = post(engine_url, "/generate", {"input_ids": "not a list", "sampling_params": {}})
    assert bad.status_code == 400
    assert_same_shape(shape(bad.json()), shape(fixture("generate_error_validation")["body"]))
    info = httpx.get(engine_url + "/get_server_info", timeout=10).json()
    too_long = list(range(1, int(info["context_length"]) + 10))
    resp = post(engine_url, "/generate", {"input_ids": too_long, "sampling_params": {"max_new_tokens": 1},
                                          "return_logprob": True})
    assert resp.status_code == 400
    assert_same_shape(shape(resp.json()), shape(fixture("generate_error_context")["body"]))


def test_engine_grammar_responses_match_sglang(engine_url):
    fx = fixture("generate_json_schema")
    resp = post(engine_url, "/generate", fx["request"])
    assert resp.status_code == 200, resp.text
    body = resp.json()
    finish = body["meta_info"]["finish_reason"]
    if finish["type"] == "stop":  # the random model's string may run to max_new_tokens instead
        assert isinstance(json.loads(body["text"])["city"], str)
    else:
        assert finish == {"type": "length", "length": 16} and body["text"].startswith('{"city": "')
        body["meta_info"]["finish_reason"] = fx["body"]["meta_info"]["finish_reason"]  # shape of the rest
    assert_same_shape(meta_shape(body), meta_shape(fx["body"]))
    bad = post(engine_url, "/generate", fixture("generate_error_grammar")["request"])
    assert bad.status_code == 400 and "regex" in bad.json()["error"]["message"]
    assert_same_shape(shape(bad.json()), shape(fixture("generate_error_grammar")["body"]))


def test_engine_stream_error_is_an_event_like_sglang(engine_url):
    info = httpx.get(engine_url + "/get_server_info", timeout=10).json()
    too_long = list(range(1, int(info["context_length"]) + 10))
    stream = post(engine_url, "/generate", {"input_ids": too_long, "sampling_params": {"max_new_tokens": 1},
                                            "stream": True})
    assert stream.status_code == 200, f"{stream.status_code} {stream.text[:200]}"
    events = sse_events(stream.text)
    assert len(events) == 1  # the error, then [DONE]
    assert_same_shape(shape(events[0]), shape(sse_events(fixture("generate_stream_error")["body_text"])[0]))


def test_engine_memory_release_responses_match_sglang(engine_url):
    for name in ("release_memory_occupation_ok", "resume_memory_occupation_ok"):
        fx = fixture(name)
        resp = post(engine_url, fx["route"], fx["request"])
        assert resp.status_code == fx["status"] and resp.json() is None, resp.text
    # busy: refused with SGLang's error shape (its scheduler asserts; ours answers 400)
    from tests.engine.conftest import running_generation

    with running_generation(engine_url):
        fx = fixture("release_memory_occupation_fail")
        busy = post(engine_url, fx["route"], fx["request"])
        assert busy.status_code == fx["status"]
        assert_same_shape(shape(busy.json()), shape(fx["body"]))
