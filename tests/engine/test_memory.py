"""Releasing and resuming the engine's memory (SGLang's /release_memory_occupation, /resume_memory_occupation).

Over HTTP against the real tiny engine process (CPU): refusals while released, the weights back bit for bit
after a resume, busy engines and bad tags refused. The freed GPU bytes are measured on a GPU by
``bench/memory_occupation.py`` (docs/engine.md); the GPU test at the end runs only where CUDA is.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from engine.memory import KV_CACHE, MEMORY_TAGS, WEIGHTS, MemoryOccupation, MemoryStateError, parse_tags
from tests.engine.conftest import running_generation


def post(url: str, path: str, body=None) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def greedy(url: str) -> dict:
    resp = post(url, "/generate", {"input_ids": [1, 2, 3, 4], "return_logprob": True,
                                   "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}})
    assert resp.status_code == 200, resp.text
    return resp.json()


def released(url: str) -> list[str]:
    return httpx.get(url + "/get_server_info", timeout=10).json()["internal_states"][0]["memory_released"]


def test_parse_tags_follows_sglang() -> None:
    assert parse_tags(None) == parse_tags([]) == list(MEMORY_TAGS)
    assert parse_tags(["weights", "kv_cache", "weights"]) == ["weights", "kv_cache"]
    with pytest.raises(MemoryStateError, match="unknown memory tags"):
        parse_tags(["kv", "weights"])


def test_weights_leave_and_come_back_unchanged() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    memory = MemoryOccupation(model)
    with pytest.raises(MemoryStateError, match="idle"):
        memory.release([WEIGHTS], idle=False)
    assert memory.release([WEIGHTS, KV_CACHE], idle=True) == [KV_CACHE, WEIGHTS]
    assert all(p.numel() == 0 for p in model.parameters()), "released parameters keep no storage"
    assert memory.resume([KV_CACHE]) == [WEIGHTS]
    assert all(p.numel() == 0 for p in model.parameters())
    with pytest.raises(MemoryStateError, match="not released"):
        memory.resume([KV_CACHE])
    assert memory.resume(None) == []
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    with pytest.raises(MemoryStateError, match="nothing is released"):
        memory.resume(None)


def test_released_engine_refuses_generation_and_serves_the_same_after(engine_url) -> None:
    first = greedy(engine_url)
    resp = post(engine_url, "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert resp.status_code == 200 and resp.json() is None, resp.text  # SGLang's route returns None
    try:
        assert released(engine_url) == ["kv_cache"]
        refused = post(engine_url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        assert refused.status_code == 503
        assert "resume_memory_occupation" in refused.json()["error"]["message"]
        stream = post(engine_url, "/generate", {"input_ids": [1, 2], "stream": True,
                                                "sampling_params": {"max_new_tokens": 2}})
        assert stream.status_code == 503
        assert httpx.get(engine_url + "/health", timeout=30).status_code == 503
        assert httpx.get(engine_url + "/get_model_info", timeout=10).status_code == 200  # liveness still answers
    finally:
        resp = post(engine_url, "/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert resp.status_code == 200 and resp.json() is None, resp.text
    assert released(engine_url) == []
    assert httpx.get(engine_url + "/health", timeout=30).status_code == 200
    again = greedy(engine_url)
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["output_token_logprobs"] == first["meta_info"]["output_token_logprobs"]


def test_released_weights_refuse_updates_and_come_back(engine_url, tiny_model_dir) -> None:
    first = greedy(engine_url)
    version = httpx.get(engine_url + "/get_weight_version", timeout=10).json()["weight_version"]
    assert post(engine_url, "/release_memory_occupation", {}).status_code == 200  # no tags: all of them
    try:
        assert released(engine_url) == sorted(MEMORY_TAGS)
        refused = post(engine_url, "/update_weights_from_disk", {"model_path": str(tiny_model_dir)})
        assert refused.status_code == 400 and refused.json()["success"] is False
        assert "resume_memory_occupation" in refused.json()["message"]
        # resuming the KV cache alone leaves generation refused (the weights are still on the host)
        assert post(engine_url, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}).status_code == 200
        assert released(engine_url) == ["weights"]
        assert post(engine_url, "/generate", {"input_ids": [1], "sampling_params": {}}).status_code == 503
    finally:
        resp = post(engine_url, "/resume_memory_occupation", None)  # no body: everything still released
    assert resp.status_code == 200, resp.text
    assert released(engine_url) == []
    assert httpx.get(engine_url + "/get_weight_version", timeout=10).json()["weight_version"] == version
    again = greedy(engine_url)
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["output_token_logprobs"] == first["meta_info"]["output_token_logprobs"]


def test_bad_tags_busy_engine_and_double_resume_are_400s(engine_url) -> None:
    bad = post(engine_url, "/release_memory_occupation", {"tags": ["kv"]})
    assert bad.status_code == 400 and "unknown memory tags" in bad.json()["error"]["message"]
    wrong_type = post(engine_url, "/release_memory_occupation", {"tags": "kv_cache"})
    assert wrong_type.status_code == 400 and wrong_type.json()["type"] == "Bad Request"
    assert post(engine_url, "/resume_memory_occupation", {"tags": ["weights"]}).status_code == 400
    assert released(engine_url) == []

    # a running request: refused (SGLang asserts the server is idle), nothing released
    try:
        with running_generation(engine_url):
            busy = post(engine_url, "/release_memory_occupation", {"tags": ["kv_cache"]})
            assert busy.status_code == 400 and "idle" in busy.json()["error"]["message"]
            assert released(engine_url) == []
    finally:
        if released(engine_url):  # a failed assertion above must not leave the shared engine asleep
            post(engine_url, "/resume_memory_occupation", None)
    assert greedy(engine_url)["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_release_frees_gpu_memory() -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
    x = torch.randn(512, 2048, device="cuda")
    with torch.no_grad():
        before = model(x)  # the allocator keeps the activations' blocks cached
    memory = MemoryOccupation(model)
    held = torch.cuda.memory_reserved()
    memory.release([KV_CACHE, WEIGHTS], idle=True)
    assert torch.cuda.memory_reserved() <= held - 8 * 2048 * 2048 * 4
    memory.resume(None)
    with torch.no_grad():
        assert torch.equal(model(x), before)
