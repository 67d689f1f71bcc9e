"""LoRA adapters on the embedded engine over HTTP (SGLang 0.5.19's routes and ``lora_path``): an adapter
changes outputs and its logprobs are peft's; several adapters and the base model in one batch give each row
what it gives alone; adapters from disk and from tensors; a new adapter version under a pause moves the
tokens' versions like a full weight push; refusals answer 400 and change nothing."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from collections.abc import Iterator
from contextlib import contextmanager

from tests.engine_hooks import hold, release, wait_for, wait_held

PROMPTS = [[1, 9690, 198, 2683, 359, 253, 5356, 30, 2, 198, 1, 4093], [1, 4093, 198, 42, 77, 1000, 5],
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def make_adapter(base_dir: Path, out: Path, seed: int, targets=("q_proj", "v_proj", "down_proj"), rank: int = 4) -> Path:
    """A peft LoRA adapter of the tiny model with random (non-zero) B, saved by peft itself."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                                  lora_dropout=0.0))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    peft_model.save_pretrained(out)
    return out


def peft_logprobs(base_dir: Path, adapter: Path, prompt: list[int], output: list[int]) -> list[float]:
    """log p(output[k] | ...) under base + adapter, by peft in this process (the reference)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), str(adapter))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return [logp[len(prompt) - 1 + k, tok].item() for k, tok in enumerate(output)]


def generate(url: str, prompt: list[int], lora: str | None = None, n: int = 8, **extra) -> dict:
    body = {"input_ids": prompt, "return_logprob": True, **extra,
            "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    if lora is not None:
        body["lora_path"] = lora
    resp = httpx.post(url + "/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def logprobs(out: dict) -> list[float]:
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def load(url: str, name: str, path: Path) -> httpx.Response:
    return httpx.post(url + "/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=120)


def unload(url: str, name: str) -> httpx.Response:
    return httpx.post(url + "/unload_lora_adapter", json={"lora_name": name}, timeout=120)


def info(url: str) -> dict:
    return httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]


def loaded(url: str) -> list[str]:
    """The adapters the engine lists in /v1/models (SGLang: each after the base model, its parent)."""
    return [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"] if m.get("parent")]


@contextmanager
def story(url: str, lora: str) -> Iterator[list[dict]]:
    """A streamed greedy generation under ``lora``, held by the engine at 5 tokens (one more after a re-prefill)
    and so running for the whole block; aborted afterwards. Yields its events so far, parsed."""
    room = int(httpx.get(url + "/get_server_info", timeout=10).json()["context_length"]) - 20
    events: list[dict] = []
    body = {"input_ids": PROMPTS[2], "stream": True, "lora_path": lora,
            "sampling_params": {"max_new_tokens": room, "ignore_eos": True, "temperature": 0.0}}

    def read() -> None:
        with httpx.stream("POST", url + "/generate", json=body, timeout=300) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line.removeprefix("data: ")))

    reader = threading.Thread(target=read)
    hold(url, 5)  # the engine (--test-hooks) holds the story at 5 tokens: it cannot end during the block
    try:
        reader.start()
        wait_held(url)
        wait_for(lambda: events, "the story's first event")
        assert events[0]["meta_info"]["finish_reason"] is None, events[0]
        yield events
    finally:
        httpx.post(url + "/abort_request", json={"abort_all": True}, timeout=60)
        release(url)
        reader.join(60)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"a": make_adapter(tiny_model_dir, root / "a", seed=1),
            "b": make_adapter(tiny_model_dir, root / "b", seed=2, targets=("k_proj", "o_proj", "gate_proj", "up_proj"),
                              rank=8),
            "a2": make_adapter(tiny_model_dir, root / "a2", seed=3)}


@pytest.fixture
def url(engine_url):
    """The shared engine; every adapter a test loaded is unloaded afterwards and the version is set back."""
    version = httpx.get(engine_url + "/get_weight_version").json()["weight_version"]
    yield engine_url
    for name in loaded(engine_url):
        assert unload(engine_url, name).status_code == 200
    httpx.post(engine_url + "/continue_generation", json={})
    httpx.post(engine_url + "/update_weight_version", json={"new_version": version, "abort_all_requests": False})


def test_an_adapter_changes_outputs_and_its_logprobs_are_pefts(url, adapters, tiny_model_dir):
    base = generate(url, PROMPTS[0])
    resp = load(url, "a", adapters["a"])
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"success": True, "error_message": "", "loaded_adapters": {"a": str(adapters["a"])}}
    adapted = generate(url, PROMPTS[0], "a")
    assert adapted["output_ids"] != base["output_ids"]
    reference = peft_logprobs(tiny_model_dir, adapters["a"], PROMPTS[0], adapted["output_ids"])
    assert max(abs(x - y) for x, y in zip(logprobs(adapted), reference)) < 1e-4
    assert generate(url, PROMPTS[0])["output_ids"] == base["output_ids"]  # a request naming no adapter: the base
    assert generate(url, PROMPTS[0], "")["output_ids"] == base["output_ids"]
    models = httpx.get(url + "/v1/models").json()["data"]
    assert [(m["id"], m.get("parent"), m["root"]) for m in models[1:]] == [("a", models[0]["id"], str(adapters["a"]))]
    assert unload(url, "a").json() == {"success": True, "error_message": "", "loaded_adapters": {}}
    refused = httpx.post(url + "/generate", json={"input_ids": PROMPTS[0], "lora_path": "a"})
    assert refused.status_code == 400 and "never been loaded: a" in refused.json()["error"]["message"]


def test_adapters_and_the_base_in_one_batch_give_what_each_gives_alone(url, adapters):
    for name in ("a", "b"):
        assert load(url, name, adapters[name]).status_code == 200
    plan = [("a", PROMPTS[0]), ("b", PROMPTS[0]), (None, PROMPTS[1]), ("b", PROMPTS[2]), ("a", PROMPTS[1])]
    alone = [generate(url, prompt, lora) for lora, prompt in plan]
    assert len({tuple(o["output_ids"]) for o in alone[:2]}) == 2  # the two adapters differ on the same prompt

    # all five wait behind a pause, so that they are admitted in one prefill and decoded in one batch
    assert httpx.post(url + "/pause_generation", json={"mode": "abort"}).status_code == 200
    before = info(url)
    together: list[dict | None] = [None] * len(plan)

    def send(i: int) -> None:
        together[i] = generate(url, plan[i][1], plan[i][0])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(plan))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60  # hang guard only: waits for a count
    while info(url)["num_waiting_reqs"] < len(plan):
        assert time.monotonic() < deadline, info(url)
        time.sleep(0.02)
    assert httpx.post(url + "/continue_generation", json={}).status_code == 200
    for t in threads:
        t.join(120)
    after = info(url)
    assert after["prefill_batches"] == before["prefill_batches"] + 1  # one admission for all five
    assert after["max_batch_size"] >= len(plan)
    for one, batched in zip(alone, together):
        assert batched["output_ids"] == one["output_ids"]
        assert max(abs(x - y) for x, y in zip(logprobs(batched), logprobs(one))) < 1e-4


def test_an_adapter_from_tensors_serves_as_the_same_adapter_from_disk(url, adapters):
    from multiprocessing.reduction import ForkingPickler

    from safetensors.torch import load_file

    assert load(url, "disk", adapters["a"]).status_code == 200
    tensors = load_file(str(adapters["a"] / "adapter_model.safetensors"))
    torch.multiprocessing.set_sharing_strategy("file_system")
    for t in tensors.values():
        t.share_memory_()
    buf = io.BytesIO()
    ForkingPickler(buf).dump(tensors)
    body = {"lora_name": "tensors", "config_dict": json.loads((adapters["a"] / "adapter_config.json").read_text()),
            "serialized_named_tensors": [base64.b64encode(buf.getvalue()).decode()], "load_format": None}
    resp = httpx.post(url + "/load_lora_adapter_from_tensors", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["loaded_adapters"] == {"disk": str(adapters["a"]), "tensors": "__tensor__"}
    assert generate(url, PROMPTS[1], "tensors")["output_ids"] == generate(url, PROMPTS[1], "disk")["output_ids"]


def test_refusals_answer_400_and_change_nothing(url, adapters, tmp_path, tiny_model_dir):
    assert load(url, "a", adapters["a"]).status_code == 200
    served = generate(url, PROMPTS[0], "a")["output_ids"]
    again = load(url, "a", adapters["a2"])  # SGLang: a loaded name is refused (a new version is unload + load)
    assert again.status_code == 400 and "already loaded" in again.json()["error_message"]
    assert load(url, "x", tmp_path / "missing").status_code == 400
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_model.safetensors").write_bytes((adapters["a"] / "adapter_model.safetensors").read_bytes())
    config = json.loads((adapters["a"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    assert "DoRA" in load(url, "x", dora).json()["error_message"]
    wrong_rank = tmp_path / "wrong_rank"
    wrong_rank.mkdir()
    (wrong_rank / "adapter_model.safetensors").write_bytes((adapters["a"] / "adapter_model.safetensors").read_bytes())
    (wrong_rank / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    assert "rank 4 in the tensors, 8 in the adapter config" in load(url, "x", wrong_rank).json()["error_message"]
    gone = unload(url, "nope")
    assert gone.status_code == 400 and "does not exist" in gone.json()["error_message"]
    schema = httpx.post(url + "/load_lora_adapter", json={"lora_name": "x"})
    assert schema.status_code == 400 and schema.json()["object"] == "error"
    batch = httpx.post(url + "/generate", json={"input_ids": PROMPTS[0], "lora_path": ["a", "a"]})
    assert batch.status_code == 400
    assert httpx.get(url + "/v1/models").json()["data"][1:] == [
        {"id": "a", "object": "model", "owned_by": "agentrl", "root": str(adapters["a"]), "parent": "tiny",
         "max_model_len": None}]
    assert generate(url, PROMPTS[0], "a")["output_ids"] == served


def test_a_new_adapter_version_under_a_pause_moves_token_versions_like_a_weight_push(url, adapters):
    """The trainer's adapter push: pause (retract) -> unload -> load the new version -> /update_weight_version
    -> continue. A story running across it keeps its tokens, each tagged with the version that sampled it,
    and goes on under the new adapter."""
    assert load(url, "policy", adapters["a"]).status_code == 200
    start = int(httpx.get(url + "/get_weight_version").json()["weight_version"])
    v1 = generate(url, PROMPTS[1], "policy")
    assert v1["meta_info"]["weight_version"] == str(start)
    with story(url, "policy") as events:
        assert httpx.post(url + "/pause_generation", json={"mode": "retract"}).status_code == 200
        assert unload(url, "policy").status_code == 200
        assert load(url, "policy", adapters["a2"]).status_code == 200
        resp = httpx.post(url + "/update_weight_version", json={"new_version": str(start + 1), "abort_all_requests": False})
        assert resp.status_code == 200, resp.text
        assert httpx.post(url + "/continue_generation", json={}).status_code == 200
        deadline = time.monotonic() + 60  # hang guard: wait for a token of the new version
        while events[-1]["meta_info"]["weight_version"] != str(start + 1):
            assert time.monotonic() < deadline and events[-1]["meta_info"]["finish_reason"] is None
            time.sleep(0.02)
    final = events[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    spans = final["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == [str(start), str(start + 1)]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == len(final["output_ids"])
    assert final["meta_info"]["num_retractions"] == 1
    v2 = generate(url, PROMPTS[1], "policy")
    assert v2["meta_info"]["weight_version"] == str(start + 1)
    assert v2["output_ids"] != v1["output_ids"]  # the new adapter serves


def test_adapters_loaded_at_start_and_served_by_default(adapters, tiny_model_dir):
    """``--lora-paths NAME=PATH`` loads adapters at start (SGLang's flag); ``--default-lora`` serves requests that
    name none with one of them: how a LoRA checkpoint is served for evaluation without merging."""
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.engine.conftest import engine_process

    flags = ("--lora-paths", f"a={adapters['a']},b={adapters['b']}", "--default-lora", "a")
    with engine_process(*flags) as url:
        assert loaded(url) == ["a", "b"]
        default = generate(url, PROMPTS[0])
        assert default["output_ids"] == generate(url, PROMPTS[0], "a")["output_ids"]
        reference = peft_logprobs(tiny_model_dir, adapters["a"], PROMPTS[0], default["output_ids"])
        assert max(abs(x - y) for x, y in zip(logprobs(default), reference)) < 1e-4
        assert generate(url, PROMPTS[0], "b")["output_ids"] != default["output_ids"]

        # a push of a new version of the default adapter: a request that arrives while it is unloaded (paused)
        # is served by the new version, not by the base model
        assert httpx.post(url + "/pause_generation", json={"mode": "abort"}).status_code == 200
        assert unload(url, "a").status_code == 200
        result: dict = {}
        waiting = threading.Thread(target=lambda: result.update(out=generate(url, PROMPTS[0])))
        waiting.start()
        deadline = time.monotonic() + 60  # hang guard: waits for a count
        while info(url)["num_waiting_reqs"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert load(url, "a", adapters["a2"]).status_code == 200
        assert httpx.post(url + "/continue_generation", json={}).status_code == 200
        waiting.join(120)
        new = generate(url, PROMPTS[0], "a")
        assert result["out"]["output_ids"] == new["output_ids"] != default["output_ids"]
    bad = subprocess.run([sys.executable, "-m", "agentrl", "engine", "--model", "tiny", "--lora-paths", "no-equals"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "NAME=PATH" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "agentrl", "engine", "--model", "tiny", "--lora-paths", "x=/nope"],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "--lora-paths x=/nope" in missing.stderr
