"""The grammar mask (``engine.grammar.mask_rows``) and a constrained sampling step, on every device present.

A small synthetic vocabulary (no model, no tokenizer files), so it runs where only torch and xgrammar are
installed (the GPU machine). On CUDA the mask must equal the CPU's bit for bit, only the constrained rows may
change, and every token sampled under the mask must be one the grammar allows until the JSON is complete.
"""

from __future__ import annotations

import json

import pytest
import torch

xgrammar = pytest.importorskip("xgrammar")

from engine.grammar import advance, mask_rows  # noqa: E402
from engine.sampling import SamplingParams, sample  # noqa: E402

VOCAB = ["<eos>", *[chr(c) for c in range(32, 127)], "true", "false", '{"', '":', '"}', "ok", "label", "cat",
         "dog", ", "]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "label": {"enum": ["cat", "dog"]}},
          "required": ["ok", "label"], "additionalProperties": False}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _matcher():
    info = xgrammar.TokenizerInfo(VOCAB, stop_token_ids=[0])
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    return xgrammar.GrammarMatcher(compiled, override_stop_tokens=[0])


@pytest.mark.parametrize("device", DEVICES)
def test_mask_rows_masks_only_constrained_rows_and_matches_the_cpu(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, len(VOCAB), generator=gen)
    rows = [1, 3]
    cpu = mask_rows(logits, rows, [_matcher(), _matcher()])
    out = mask_rows(logits.to(device), rows, [_matcher(), _matcher()])
    assert out.device.type == device
    assert torch.equal(out.cpu(), cpu)
    assert torch.equal(out[0].cpu(), logits[0]) and torch.equal(out[2].cpu(), logits[2])  # untouched
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert allowed and all(VOCAB[t].startswith("{") for t in allowed)  # a JSON object must open first


@pytest.mark.parametrize("device", DEVICES)
def test_constrained_sampling_on_device_yields_the_schema(device: str) -> None:
    for seed in range(3):
        matcher = _matcher()
        params = SamplingParams.parse({"sampling_seed": seed}, vocab_size=len(VOCAB))
        generator = params.generator(device)
        text, token, lps = "", None, []
        gen = torch.Generator().manual_seed(seed)
        for _ in range(60):
            logits = torch.randn(2, len(VOCAB), generator=gen).to(device)
            masked = mask_rows(logits, [0], [matcher])
            tokens, logprobs, _ = sample(masked, [params, params], [generator, params.generator(device)])
            token = int(tokens[0])
            assert torch.isfinite(masked[0, token])
            lps.append(float(logprobs[0]))
            assert advance(matcher, token)
            if token == 0:
                break
            text += VOCAB[token]
        assert token == 0, text
        value = json.loads(text)
        assert isinstance(value["ok"], bool) and value["label"] in ("cat", "dog")
        assert all(lp <= 1e-6 for lp in lps) and any(lp > -1e-6 for lp in lps)  # forced tokens: logprob 0
