"""The model directories we ship are standard Hugging Face checkpoints that transformers, vLLM and SGLang load.

What the real engines need (issue 11): ``architectures`` in ``config.json`` (vLLM and SGLang pick the model
class by it), the tied embedding saved under ``model.embed_tokens.weight`` (SGLang's ``LlamaForCausalLM.
load_weights`` skips ``lm_head.weight`` when ``tie_word_embeddings`` is set: sglang 0.5.19,
``srt/models/llama.py``), ``generation_config.json``, the tokenizer with its chat template. And the embedded
engine's greedy output and logprobs equal plain transformers' on the same directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from tests.engine.conftest import engine_process, reference_logprobs


def assert_standard(path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((path / "config.json").read_text())
    assert config.get("architectures") == ["LlamaForCausalLM"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys
    if config.get("tie_word_embeddings"):
        assert "lm_head.weight" not in keys  # tied: saved once, under the input embedding's name
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template and tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    _, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_tiny_model_dir_is_standard(tiny_model_dir: Path) -> None:
    assert_standard(tiny_model_dir)


def test_save_standard_writes_the_embedding_a_lm_head_only_state_dict_names(tiny_model_dir: Path, tmp_path) -> None:
    """The old SmolLM2 conversion (safetensors' save_model) kept the tied tensor only as lm_head.weight."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.models import save_standard

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    state = {k: v for k, v in model.state_dict().items() if k != "model.embed_tokens.weight"}
    assert "lm_head.weight" in state
    save_standard(type(model), model.config, state, AutoTokenizer.from_pretrained(tiny_model_dir), tmp_path)
    assert_standard(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name


def test_trainer_checkpoint_dir_is_standard(tiny_model_dir: Path, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from trainer.model import iter_full_tensors
    from trainer.weight_sync import save_hf_dir

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config.architectures = None  # a source directory written without it (the old SmolLM2 cache)
    save_hf_dir(iter_full_tensors(model, to_cpu=True), model.config, tmp_path / "ckpt", tiny_model_dir)
    assert_standard(tmp_path / "ckpt")


def greedy_parity(url: str, path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "What is 7+5?"}], add_generation_prompt=True,
                                   tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    resp = httpx.post(url + "/generate", json={
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "skip_special_tokens": False}}, timeout=300)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    n = len(out["output_ids"])
    assert out["output_ids"] == expected[:n] and n >= 1
    logprobs = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    assert logprobs == pytest.approx(reference_logprobs(model, prompt, out["output_ids"]), abs=1e-4)


def test_embedded_engine_and_transformers_agree_on_the_tiny_model(engine_url: str, tiny_model_dir: Path) -> None:
    greedy_parity(engine_url, tiny_model_dir)


@pytest.mark.slow
def test_embedded_engine_and_transformers_agree_on_smollm2() -> None:
    from engine.models import smollm2_dir

    path = smollm2_dir()  # built once from the GGUF, then cached
    assert_standard(path)
    with engine_process("--model", str(path), startup_timeout=300) as url:
        greedy_parity(url, path)
