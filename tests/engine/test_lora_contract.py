"""The LoRA wire contract against SGLang's own request classes (0.5.19, the pinned release, and 0.5.23): every
body the trainer's adapter push sends (disk and tensor modes) and a /generate body naming an adapter parse as
SGLang's HTTP server parses them, with no field SGLang would ignore; the answers the push reads are
SGLang's ``LoRAUpdateOutput``."""

from __future__ import annotations

import dataclasses
import json

import httpx
import msgspec
import pydantic
import pytest
import torch

from tests.sglang import own_code

ROUTES = {"/load_lora_adapter": "LoadLoRAAdapterReqInput", "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
          "/load_lora_adapter_from_tensors": "LoadLoRAAdapterFromTensorsReqInput",
          "/update_weight_version": "UpdateWeightVersionReqInput"}


def parse_as_sglang(version: str, path: str, body: dict):
    io = own_code.io_struct(version)
    cls = getattr(io, ROUTES[path])
    known = {f.name for f in msgspec.structs.fields(cls)}
    assert set(body) <= known, f"{path} fields SGLang {version} ignores: {sorted(set(body) - known)}"
    return pydantic.TypeAdapter(cls).validate_python(body)


def as_json(out) -> dict:
    """What SGLang's route answers: ``msgspec_to_builtins`` of the struct (every field by name)."""
    return {f.name: getattr(out, f.name) for f in msgspec.structs.fields(type(out))}


class SGLangLike:
    """Answers the adapter routes as SGLang does (``LoRAUpdateOutput``; an unknown name on unload: 400) and
    records every body."""

    def __init__(self, version: str) -> None:
        self.version, self.bodies, self.loaded = version, [], {}

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        self.bodies.append((request.url.path, body))
        if request.url.path in ("/pause_generation", "/continue_generation", "/flush_cache"):
            return httpx.Response(200, json={"status": "ok"})
        if request.url.path in ("/server_info", "/get_server_info"):  # the tensor payloads are one per TP rank
            return httpx.Response(200, json={"tp_size": 1, "version": self.version})
        parsed = parse_as_sglang(self.version, request.url.path, body)
        io = own_code.io_struct(self.version)
        if request.url.path == "/update_weight_version":
            return httpx.Response(200, json={"success": True, "message": "ok"})
        if request.url.path == "/unload_lora_adapter" and parsed.lora_name not in self.loaded:
            out = io.LoRAUpdateOutput(success=False, error_message=f"LoRA with name {parsed.lora_name} does not exist.")
        else:
            if request.url.path == "/unload_lora_adapter":
                del self.loaded[parsed.lora_name]
            else:
                self.loaded[parsed.lora_name] = getattr(parsed, "lora_path", "__tensor__")
            out = io.LoRAUpdateOutput(success=True, error_message="", loaded_adapters=dict(self.loaded))
        return httpx.Response(200 if out.success else 400, json=as_json(out))


@pytest.mark.parametrize("version", own_code.VERSIONS)
@pytest.mark.parametrize("mode", ["disk", "tensor"])
def test_the_adapter_push_sends_what_sglang_parses(version, mode, tiny_model_dir, tmp_path):
    from trainer import lora
    from trainer.lora_push import AdapterSync, push_adapter
    from trainer.model import init_distributed, load_model
    from trainer.weight_sync import DirectControl

    info = init_distributed("cpu")
    engine = SGLangLike(version)
    client = httpx.Client(transport=httpx.MockTransport(engine.handler))
    model = load_model(tiny_model_dir, lora=lora.LoraSpec(4, 8.0))
    transport = AdapterSync("policy", mode, tmp_path / "sync", client)
    control = DirectControl(["http://sglang"], client=client, engine_kind="sglang")
    for v in (1, 2):
        push_adapter(model, v, info=info, transport=transport, control=control)
    routes = [path for path, _ in engine.bodies if "lora" in path or "version" in path]
    load = "/load_lora_adapter" if mode == "disk" else "/load_lora_adapter_from_tensors"
    assert routes == ["/unload_lora_adapter", load, "/update_weight_version"] * 2
    assert engine.loaded == {"policy": str(tmp_path.resolve() / "sync" / "policy-v2") if mode == "disk" else "__tensor__"}
    if mode == "tensor":  # SGLang's own deserializer reads the payload: a dict of peft keys, the config as saved
        body = [b for p, b in engine.bodies if p == load][-1]
        parsed = parse_as_sglang(version, load, body)
        tensors = own_code.serializer(version).deserialize(parsed.serialized_named_tensors[0])
        assert tensors.keys() == dict(lora.adapter_tensors(model)).keys()
        assert parsed.config_dict["r"] == 4 and parsed.config_dict["peft_type"] == "LORA"
        assert all(torch.equal(tensors[k], v) for k, v in lora.adapter_tensors(model))


@pytest.mark.parametrize("version", own_code.VERSIONS)
def test_a_generate_body_naming_an_adapter_is_one_sglang_parses(version):
    io = own_code.io_struct(version)
    body = {"input_ids": [1, 2, 3], "lora_path": "policy", "sampling_params": {"max_new_tokens": 4}}
    assert set(body) <= {f.name for f in dataclasses.fields(io.GenerateReqInput)}
    obj = pydantic.TypeAdapter(io.GenerateReqInput).validate_python(body)
    obj.normalize_batch_and_arguments()
    assert obj.lora_path == "policy"


@pytest.mark.parametrize("version", own_code.VERSIONS)
def test_the_embedded_engines_lora_answers_are_sglangs_lora_update_output(version, engine_url, tiny_model_dir,
                                                                          tmp_path):
    from tests.engine.test_lora import make_adapter

    io = own_code.io_struct(version)
    adapter = make_adapter(tiny_model_dir, tmp_path / "a", seed=1)
    answers = [httpx.post(engine_url + "/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapter)}),
               httpx.post(engine_url + "/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapter)}),
               httpx.post(engine_url + "/unload_lora_adapter", json={"lora_name": "c"}),
               httpx.post(engine_url + "/unload_lora_adapter", json={"lora_name": "c"})]
    assert [a.status_code for a in answers] == [200, 400, 200, 400]
    fields = {f.name for f in msgspec.structs.fields(io.LoRAUpdateOutput)}
    expected = [(True, {"c": str(adapter)}), (False, {"c": str(adapter)}), (True, {}), (False, {})]
    for answer, (success, loaded) in zip(answers, expected):
        body = answer.json()
        assert set(body) == fields - {"rid", "http_worker_ipc"}  # SGLang's, less its internal routing fields
        out = pydantic.TypeAdapter(io.LoRAUpdateOutput).validate_python(body)
        assert (out.success, out.loaded_adapters) == (success, loaded)
        assert bool(out.error_message) != success
