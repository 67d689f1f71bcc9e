"""The adapter calls of ``engines.sglang.SGLangOps`` (what the trainer's adapter push sends to SGLang) against
SGLang's own code, 0.5.19 (pinned) and 0.5.23 (newest): every body parses with that release's request class
the way its HTTP server parses it (pydantic over the msgspec struct), with no field SGLang would ignore; a
tensor load carries one payload per TP rank, each opened by SGLang's own deserializer; an unload of a name the
engine lacks is told apart by the message SGLang's own registry gives."""

from __future__ import annotations

import base64
import io
import json
import re

import httpx
import msgspec
import pydantic
import pytest
import torch

from engines.control import EngineOpsError
from engines.sglang import SGLangOps
from tests.sglang import own_code

VERSIONS = pytest.mark.parametrize("version", own_code.VERSIONS)
ROUTES = {"/load_lora_adapter": "LoadLoRAAdapterReqInput", "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
          "/load_lora_adapter_from_tensors": "LoadLoRAAdapterFromTensorsReqInput"}


def parse_as_sglang(version: str, path: str, body: dict):
    cls = getattr(own_code.io_struct(version), ROUTES[path])
    known = {f.name for f in msgspec.structs.fields(cls)}
    assert set(body) <= known, f"{path} fields SGLang {version} ignores: {sorted(set(body) - known)}"
    return pydantic.TypeAdapter(cls).validate_python(body)


def unknown_name_message(version: str, name: str) -> str:
    """SGLang's own text for an unload of a name it does not have (``srt/lora/lora_registry.py``)."""
    source = (own_code.sglang_root(version) / "srt" / "lora" / "lora_registry.py").read_text()
    template = re.search(r'f"(LoRA with name \{lora_name\} does not exist\.[^"]*)"', source)
    assert template, f"SGLang {version}'s registry no longer says 'does not exist' for an unknown adapter"
    return template[1].replace("{lora_name}", name).replace("{self._registry.keys()}", "dict_keys([])")


class SGLangLike:
    """Answers as SGLang's server does: ``/server_info`` with ``tp_size``; the adapter routes parse their body with
    SGLang's class and answer its ``LoRAUpdateOutput`` (400 when refused), keeping the loaded names."""

    def __init__(self, version: str, tp_size: int = 1) -> None:
        self.version, self.tp_size = version, tp_size
        self.parsed: list[tuple[str, object]] = []
        self.loaded: dict[str, str] = {}

    def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path in ("/server_info", "/get_server_info"):
            return httpx.Response(200, json={"tp_size": self.tp_size, "version": self.version})
        parsed = parse_as_sglang(self.version, path, json.loads(request.content))
        self.parsed.append((path, parsed))
        io_struct = own_code.io_struct(self.version)
        name = parsed.lora_name
        if path == "/unload_lora_adapter":
            if name not in self.loaded:
                out = io_struct.LoRAUpdateOutput(success=False, error_message=unknown_name_message(self.version, name))
            else:
                del self.loaded[name]
                out = io_struct.LoRAUpdateOutput(success=True, error_message="", loaded_adapters=dict(self.loaded))
        elif name in self.loaded:
            out = io_struct.LoRAUpdateOutput(success=False, error_message=f"LoRA with name {name} already exists.")
        else:
            self.loaded[name] = getattr(parsed, "lora_path", "__tensor__")
            out = io_struct.LoRAUpdateOutput(success=True, error_message="", loaded_adapters=dict(self.loaded))
        body = {f.name: getattr(out, f.name) for f in msgspec.structs.fields(type(out))}
        return httpx.Response(200 if out.success else 400, json=body)


def ops_over(engine: SGLangLike) -> SGLangOps:
    return SGLangOps(httpx.Client(transport=httpx.MockTransport(engine.handler)), "http://sglang")


def payload(tensors: dict[str, torch.Tensor]) -> str:
    """What ``trainer.lora_push.AdapterSync`` sends: base64 of a ForkingPickler dump (shared memory on a CPU)."""
    from multiprocessing.reduction import ForkingPickler

    torch.multiprocessing.set_sharing_strategy("file_system")
    shared = {k: v.clone().share_memory_() for k, v in tensors.items()}
    buf = io.BytesIO()
    ForkingPickler(buf).dump(shared)
    payload.keep = shared  # alive until the test read it back
    return base64.b64encode(buf.getvalue()).decode("ascii")


@VERSIONS
def test_disk_reload_is_unload_then_load_with_sglangs_own_bodies(version):
    engine = SGLangLike(version)
    ops = ops_over(engine)
    ops.reload_adapter("policy", "/sync/policy-v1")  # the first push: nothing to unload
    ops.reload_adapter("policy", "/sync/policy-v2")
    assert [(p, o.lora_name) for p, o in engine.parsed] == [("/unload_lora_adapter", "policy"),
                                                            ("/load_lora_adapter", "policy")] * 2
    assert engine.parsed[-1][1].lora_path == "/sync/policy-v2" and engine.loaded == {"policy": "/sync/policy-v2"}
    assert ops.unload_adapter("policy") is True and ops.unload_adapter("policy") is False
    ops.load_adapter("other", "/a")
    with pytest.raises(EngineOpsError, match="already exists"):  # a refusal other than "unknown" is raised
        ops.load_adapter("other", "/a")


@VERSIONS
@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_tensor_load_carries_one_payload_per_rank_that_sglang_deserializes(version, tp_size):
    engine = SGLangLike(version, tp_size)
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 16),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(16, 4)}
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj"]}
    ops_over(engine).reload_adapter_tensors("policy", config, payload(tensors))
    (path, parsed), = [(p, o) for p, o in engine.parsed if p == "/load_lora_adapter_from_tensors"]
    assert parsed.config_dict == config and len(parsed.serialized_named_tensors) == tp_size
    for rank_payload in parsed.serialized_named_tensors:  # each TP rank opens its own entry
        got = own_code.serializer(version).deserialize(rank_payload)
        assert got.keys() == tensors.keys() and all(torch.equal(got[k], v) for k, v in tensors.items())
    assert engine.loaded == {"policy": "__tensor__"}
