"""Contract tests that run SGLang's own code, of the pinned 0.5.19 and of the newest 0.5.23 (each test runs
against both wheels; see tests/sglang/own_code.py).

1. Every request body the gateway and the trainer send is validated by that release's own request classes,
   the way its HTTP server does (pydantic over ``GenerateReqInput`` / the msgspec request structs), then by
   what SGLang does next with it (``normalize_batch_and_arguments``, ``SamplingParams(**...)``, ``verify``,
   ``normalize`` with the real tokenizer). Fields SGLang would silently ignore fail the test too. The
   trainer speaks each release's dialect, learned from ``/server_info``: weight-update sessions around
   tensor and broadcast pushes on 0.5.23, none on 0.5.19.
2. Weight pushes into engines whose receiving side is that release's own code
   (``tests/sglang/weight_receiver.py``, gloo on CPU, TP 2 and TP 1): the broadcast group
   (``init_custom_process_group``, ``WeightUpdater``) and tensor pushes (each rank opens its own
   ``serialized_named_tensors`` entry); on 0.5.23 through the scheduler's session checks, which refuse a
   push outside ``/begin_weight_update`` ... ``/end_weight_update``.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import msgspec
import pydantic
import pytest

from tests.conftest import REPO, free_port
from tests.sglang import own_code


VERSIONS = pytest.mark.parametrize("version", own_code.VERSIONS)


class Recorder:
    """An httpx transport that records each request body and answers like SGLang's success responses."""

    def __init__(self, version: str = own_code.PINNED, tp_size: int = 1) -> None:
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        self.version, self.tp_size = version, tp_size

    def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        self.bodies.append((path, body))
        if path == "/generate":
            out = {"text": "", "output_ids": [5], "meta_info": {
                "id": "r", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 3,
                "completion_tokens": 1, "weight_version": "default", "output_token_logprobs": [[-0.5, 5, None]]}}
            if body.get("stream"):
                running = {**out, "meta_info": {**out["meta_info"], "finish_reason": None}}
                return httpx.Response(200, text=f"data: {json.dumps(running)}\n\ndata: {json.dumps(out)}\n\n"
                                      "data: [DONE]\n\n", headers={"content-type": "text/event-stream"})
            return httpx.Response(200, json=out)
        if path in ("/server_info", "/get_server_info"):  # both releases have both (the get_ name deprecated)
            return httpx.Response(200, json={"tp_size": self.tp_size, "version": self.version})
        if path in ("/begin_weight_update", "/end_weight_update") and self.version == own_code.PINNED:
            return httpx.Response(404, json={"detail": "Not Found"})
        if path == "/flush_cache":
            return httpx.Response(200, text="Cache flushed.\n")
        return httpx.Response(200, json={"success": True, "message": "ok", "status": "ok"})


ROUTE_CLASSES = {
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/abort_request": "AbortReq",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",  # 0.5.23
    "/end_weight_update": "EndWeightUpdateReqInput",  # 0.5.23
}


def check_with_sglang(path: str, body: dict[str, Any], tokenizer: Any, version: str = own_code.PINNED) -> Any:
    """Parse ``body`` as SGLang ``version``'s HTTP server does for ``path``; return the parsed object."""
    io = own_code.io_struct(version)
    if path == "/generate":
        cls = io.GenerateReqInput
        known = {f.name for f in dataclasses.fields(cls)}
        assert set(body) <= known, f"/generate fields SGLang ignores: {sorted(set(body) - known)}"
        obj = pydantic.TypeAdapter(cls).validate_python(body)
        obj.normalize_batch_and_arguments()
        params = own_code.sampling_params(version).SamplingParams(**obj.sampling_params)  # unknown key: TypeError
        params.verify(len(tokenizer))
        params.normalize(tokenizer)
        return obj
    cls = getattr(io, ROUTE_CLASSES[path])
    known = {f.name for f in msgspec.structs.fields(cls)}
    assert set(body) <= known, f"{path} fields SGLang ignores: {sorted(set(body) - known)}"
    return pydantic.TypeAdapter(cls).validate_python(body)


@pytest.fixture(scope="module")
def dist_info():
    from trainer.model import init_distributed

    return init_distributed("cpu")  # idempotent: joins the one-process default group once


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@VERSIONS
async def test_every_gateway_request_is_one_sglang_accepts(tokenizer, version) -> None:
    from gateway.engine_client import EngineClient, EngineRouter, SamplingParams

    rec = Recorder(version)
    async with httpx.AsyncClient(transport=httpx.MockTransport(rec.handler)) as http:
        client = EngineClient("http://sglang", http)
        full = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=3, stop=["\n\n", "Q:"],
                              stop_token_ids=[2], top_logprobs=5)
        for params in (SamplingParams(max_new_tokens=4), full):
            await client.generate([1, 2, 3], params, params.max_new_tokens)
            async for _ in client.generate_stream([1, 2, 3], params, params.max_new_tokens):
                pass
        dropped = client.generate_stream([1, 2, 3], full, 8)
        assert (await anext(dropped)).finish is None
        await dropped.aclose()  # the reader went away before the end: the request is aborted by its rid
        router = EngineRouter([client])
        await router.pause("abort")
        await router.resume(1)
        await client.update_weights_from_disk("/sync/v1", weight_version=1)
    paths = [p for p, _ in rec.bodies]
    assert paths.count("/generate") == 5 and "/pause_generation" in paths and "/continue_generation" in paths
    assert paths.count("/abort_request") == 1  # only the dropped stream
    assert dict(rec.bodies)["/abort_request"] == {"rid": rec.bodies[paths.index("/abort_request") - 1][1]["rid"]}
    for path, body in rec.bodies:
        obj = check_with_sglang(path, body, tokenizer, version)
        if path == "/generate":
            assert obj.return_logprob is True and obj.input_ids == [1, 2, 3]
            if body["sampling_params"].get("sampling_seed") is not None:
                assert obj.sampling_params["sampling_seed"] == 3 and obj.top_logprobs_num == 5
    disk = dict(rec.bodies)["/update_weights_from_disk"]
    assert check_with_sglang("/update_weights_from_disk", disk, tokenizer, version).weight_version == "1"


@VERSIONS
async def test_every_grammar_the_gateway_sends_is_one_sglang_accepts(tokenizer, version) -> None:
    """json_object, json_schema, regex, ebnf and the forced-tool-call EBNF, built by gateway.constraints and
    sent by the engine client, parse as SGLang's GenerateReqInput + SamplingParams (one constraint each)."""
    from gateway.constraints import check_grammar, grammar_of
    from gateway.engine_client import EngineClient, SamplingParams
    from gateway.wire import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
    requests = [{"response_format": {"type": "json_object"}},
                {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
                    "type": "object", "properties": {"a": {"type": "string"}}}}}},
                {"regex": "[0-9]+"}, {"ebnf": 'root ::= "yes" | "no"'},
                {"tools": tools, "tool_choice": "required"},
                {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}},
                 "parallel_tool_calls": False}]
    rec = Recorder()
    async with httpx.AsyncClient(transport=httpx.MockTransport(rec.handler)) as http:
        client = EngineClient("http://sglang", http)
        for fields in requests:
            grammar = grammar_of(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields))
            assert grammar is not None
            params = SamplingParams(max_new_tokens=8, grammar=check_grammar(grammar).sampling())
            await client.generate([1, 2, 3], params, 8)
    assert len(rec.bodies) == len(requests)
    for (path, body), kind in zip(rec.bodies, ["json_schema", "json_schema", "regex", "ebnf", "ebnf", "ebnf"]):
        obj = check_with_sglang(path, body, tokenizer, version)
        assert isinstance(obj.sampling_params[kind], str) and obj.sampling_params[kind]


@VERSIONS
def test_every_trainer_request_is_one_sglang_accepts(tokenizer, tiny_model_dir, dist_info, tmp_path, version) -> None:
    import torch

    from trainer.model import load_model
    from trainer.config import RELEASE_MEMORY
    from trainer.weight_sync import (BroadcastSync, DirectControl, DiskSync, TensorSync, engines_released,
                                     push_weights, relabel_version)

    rec = Recorder(version, tp_size=2)
    client = httpx.Client(transport=httpx.MockTransport(rec.handler))
    model = load_model(tiny_model_dir)
    push_weights(model, 1, info=dist_info, control=DirectControl(["http://sglang"], client=client),
                 transport=DiskSync(sync_dir=tmp_path, source_dir=tiny_model_dir, client=client), retries=1)
    sync = BroadcastSync(client=client, bucket_bytes=1 << 20)
    bucket = [("model.embed_tokens.weight", torch.zeros(8, 4, dtype=torch.bfloat16)),
              ("model.norm.weight", torch.ones(4))]
    sync._send_bucket(bucket, ["http://sglang"], 2, lambda group, flat, src: None)
    sync._engines = ["http://sglang"]
    sync.disconnect()
    tensors = TensorSync(client=client)
    staged = tensors.stage(model, 4, dist_info)
    tensors.send(["http://sglang"], 4, staged, [])
    tensors.committed(staged)
    relabel_version(3, info=dist_info, control=DirectControl(["http://sglang"], client=client), client=client)
    with engines_released(RELEASE_MEMORY["all"], 3, info=dist_info, client=client, engine_kind="sglang",
                          control=DirectControl(["http://sglang"], client=client)):
        pass
    seen = {p for p, _ in rec.bodies}
    assert {"/pause_generation", "/update_weights_from_disk", "/continue_generation",
            "/update_weights_from_distributed", "/destroy_weights_update_group", "/update_weight_version",
            "/release_memory_occupation", "/resume_memory_occupation"} <= seen
    paths = [p for p, _ in rec.bodies]
    tensor_at = paths.index("/update_weights_from_tensor")
    if version == own_code.PINNED:  # no session routes in 0.5.19 (the dialect knows; none is tried)
        assert "/begin_weight_update" not in paths and "/end_weight_update" not in paths
    else:  # 0.5.23 refuses a tensor push outside a session
        assert paths[tensor_at - 1] == "/begin_weight_update" and paths[tensor_at + 1] == "/end_weight_update"
    for path, body in rec.bodies:
        if path in ROUTE_CLASSES:
            obj = check_with_sglang(path, body, tokenizer, version)
            if path == "/update_weights_from_tensor":  # one payload per TP rank: each opens its own entry
                assert len(obj.serialized_named_tensors) == 2 and obj.weight_version == "4"
            if path == "/update_weights_from_distributed":
                assert obj.load_format == "flattened_bucket" and obj.dtypes == ["bfloat16", "float32"]
                assert obj.shapes == [[8, 4], [4]] and obj.weight_version == "2"
            if path == "/pause_generation":
                assert obj.mode == "retract"
            if path == "/update_weight_version":
                assert obj.new_version == "3" and obj.abort_all_requests is False
            if path in ("/release_memory_occupation", "/resume_memory_occupation"):
                assert obj.tags == ["kv_cache", "weights", "cuda_graph"]
                assert set(obj.tags) <= set(own_code.constants(version).GPU_MEMORY_ALL_TYPES)


@VERSIONS
def test_sglang_ignores_unknown_top_level_fields_and_refuses_unknown_sampling_keys(version) -> None:
    """What the fixtures and the embedded engine mirror: GenerateReqInput (a dataclass validated by pydantic in
    SGLang's FastAPI route) drops unknown fields; SamplingParams(**sampling_params) raises on unknown keys."""
    io = own_code.io_struct(version)
    obj = pydantic.TypeAdapter(io.GenerateReqInput).validate_python({"input_ids": [1, 2], "not_a_field": 1})
    assert obj.input_ids == [1, 2] and not hasattr(obj, "not_a_field")
    with pytest.raises(TypeError):
        own_code.sampling_params(version).SamplingParams(max_new_tokens=4, not_a_key=1)


@contextmanager
def receiver(tp: int, version: str = own_code.PINNED) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.sglang.weight_receiver", "--port", str(port),
                             "--tp", str(tp), "--tp-port", str(free_port()), "--version", version], cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "the SGLang weight receiver exited"
            try:
                if httpx.get(url + "/get_server_info", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the SGLang weight receiver did not start"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # a request stuck on a dead TP worker holds uvicorn's shutdown
            proc.kill()
            proc.wait()


def expected_weights(model: Any) -> dict[str, tuple[str, list[int], float]]:
    from trainer.model import iter_full_tensors, served_dtype

    return {name: (str(t.dtype).removeprefix("torch."), list(t.shape), float(t.double().sum()))
            for name, t in iter_full_tensors(model, dtype=served_dtype(model))}


def assert_every_rank_loaded(url: str, tp: int, expected: dict[str, Any]) -> list[dict[str, Any]]:
    ranks = httpx.get(url + "/loaded", timeout=60).json()
    assert len(ranks) == tp
    for rank in ranks:
        loaded = rank["weights"]
        assert set(loaded) == set(expected)
        for name, (dtype, shape, total) in expected.items():
            assert loaded[name][:2] == [dtype, shape], name
            assert loaded[name][2] == pytest.approx(total, rel=1e-6, abs=1e-6), name
    return ranks


@pytest.mark.slow
@VERSIONS
def test_trainer_pushes_real_weights_into_sglangs_own_group(tiny_model_dir, dist_info, version) -> None:
    """Two engines, TP 2 and TP 1: world 4, ranks trainer 0, engine A 1-2 (rank_offset 1 + tp_rank),
    engine B 3; several flattened buckets; then a second push over the same group, and a fresh group after
    ``disconnect`` (SGLang refuses a second group of the same name until it is destroyed). On 0.5.23 every
    push runs in a weight-update session (the scheduler refuses the buckets otherwise): each rank ran the
    loader's restore hook at begin and its post-processing at end, once per push."""
    import torch

    from trainer.model import load_model
    from trainer.weight_sync import BroadcastSync

    model = load_model(tiny_model_dir)
    with receiver(2, version) as a, receiver(1, version) as b, httpx.Client(timeout=120) as http:
        sync = BroadcastSync(client=http, bucket_bytes=256 * 1024, backend="gloo", timeout_s=120)
        for step in (1, 2, 3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * step)
            if step == 3:
                sync.disconnect()
            assert sync.send_all(model, [a, b], step, dist_info) is None
            for url, tp in ((a, 2), (b, 1)):
                ranks = assert_every_rank_loaded(url, tp, expected_weights(model))
                sessions = ["restore", "postprocess"] * step if version != own_code.PINNED else []
                assert [r["hooks"] for r in ranks] == [sessions] * tp


@pytest.mark.slow
@VERSIONS
def test_tensor_push_reaches_every_tp_rank(tiny_model_dir, dist_info, version) -> None:
    """A tensor push to an engine with two TP ranks: each rank opens its own ``serialized_named_tensors``
    entry (``BaseTpWorker`` of that release) and loads every weight; on 0.5.23 inside a session. One entry,
    as the trainer sent before, is an IndexError on the second rank (in SGLang an exception in its scheduler
    loop, while the first rank waits at the TP barrier); on 0.5.23 a push without ``/begin_weight_update`` is
    refused by the scheduler (what made every push of the trainer fail there)."""
    import types

    from trainer.model import load_model
    from trainer.weight_sync import TensorSync

    model = load_model(tiny_model_dir)
    with receiver(2, version) as url, httpx.Client(timeout=120) as http:
        sync = TensorSync(client=http)
        staged = sync.stage(model, 1, dist_info)
        updater = own_code.weight_updater_methods(version)
        for rank, opens in ((0, True), (1, False)):  # the payload as the trainer sent it before: one entry
            worker = types.SimpleNamespace(ps=types.SimpleNamespace(tp_rank=rank))
            updater["worker_globals"]["get_parallel"] = lambda: worker.ps
            if opens:
                assert len(updater["deserialize_own_rank"](worker, [staged])) == len(expected_weights(model))
            else:
                with pytest.raises(IndexError):
                    updater["deserialize_own_rank"](worker, [staged])
        if version != own_code.PINNED:
            refused = http.post(url + "/update_weights_from_tensor", json={
                "serialized_named_tensors": [staged, staged], "load_format": None, "weight_version": "1"})
            assert refused.status_code == 400 and "begin_weight_update()" in refused.json()["message"]
        updated: list[str] = []
        sync.send([url], 1, staged, updated)
        assert updated == [url]
        ranks = assert_every_rank_loaded(url, 2, expected_weights(model))
        if version != own_code.PINNED:  # the trainer's session: the loader's hooks ran once on each rank
            assert [r["hooks"] for r in ranks] == [["restore", "postprocess"]] * 2
        sync.committed(staged)


def test_memory_tags_are_sglangs() -> None:
    from engine.memory import MEMORY_TAGS

    assert list(MEMORY_TAGS) == own_code.constants().GPU_MEMORY_ALL_TYPES
