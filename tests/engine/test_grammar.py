"""Grammar-constrained /generate (SGLang's json_schema / regex / ebnf / structural_tag) on the tiny model.

The tiny model has random weights, so unconstrained it writes noise: every output that parses here does so
because the grammar forced it. Logprobs are checked against a plain forward pass masked by an independent
xgrammar matcher replayed over the same tokens: the engine must report the masked, renormalised
distribution it sampled from.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.engine.test_generate import PROMPTS, generate

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "label": {"enum": ["cat", "dog"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "label", "n"], "additionalProperties": False}


def test_json_schema_output_parses_and_matches_the_schema(engine_url):
    for seed in range(3):
        out = generate(engine_url, PROMPTS[seed], json_schema=json.dumps(SCHEMA), max_new_tokens=64,
                       sampling_seed=seed)
        value = json.loads(out["text"])
        assert set(value) == {"ok", "label", "n"} and isinstance(value["ok"], bool)
        assert value["label"] in ("cat", "dog") and 0 <= value["n"] <= 9
        assert out["meta_info"]["finish_reason"]["type"] == "stop"  # the grammar ended on EOS


def test_regex_and_ebnf_outputs_match(engine_url):
    out = generate(engine_url, PROMPTS[1], regex=r"(yes|no), [0-9]{3}", max_new_tokens=32, sampling_seed=1)
    assert re.fullmatch(r"(yes|no), [0-9]{3}", out["text"]), out["text"]
    out = generate(engine_url, PROMPTS[2], ebnf='root ::= "x=" [0-9] ("+" [0-9])*', max_new_tokens=6,
                   sampling_seed=2)
    assert re.fullmatch(r"x=[0-9](\+[0-9])*\+?", out["text"]), out["text"]  # may be cut by max_new_tokens


def test_any_json_is_sglangs_dollar_any(engine_url):
    out = generate(engine_url, PROMPTS[3], json_schema="$$ANY$$", max_new_tokens=200, temperature=0)
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        json.loads(out["text"])
    else:  # cut by length: still a prefix of JSON the grammar accepts
        assert out["text"][:1] in "{[\"-0123456789tfn"


def test_logprobs_are_those_of_the_masked_renormalised_distribution(engine_url, tiny_model, tiny_model_dir):
    import torch
    import xgrammar
    from transformers import AutoTokenizer

    prompt = PROMPTS[0]
    out = generate(engine_url, prompt, json_schema=json.dumps(SCHEMA), max_new_tokens=64, sampling_seed=7,
                   temperature=0.8)
    ids = out["output_ids"]
    reported = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    # an independent matcher over the same tokens gives each step's allowed set
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    vocab = tiny_model.config.vocab_size
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[2])
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=[2])
    with torch.no_grad():
        logits = tiny_model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:].float()
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    masked_gap, plain_gap = 0.0, 0.0
    for k, token in enumerate(ids):
        matcher.fill_next_token_bitmask(bitmask)
        allowed = torch.tensor([bool((int(bitmask[0, t // 32]) >> (t % 32)) & 1) for t in range(vocab)])
        assert allowed[token], f"token {k} was not allowed by the grammar"
        scaled = logits[k] / 0.8
        masked = torch.log_softmax(scaled.masked_fill(~allowed, float("-inf")), -1)[token].item()
        plain = torch.log_softmax(scaled, -1)[token].item()
        masked_gap = max(masked_gap, abs(masked - reported[k]))
        plain_gap = max(plain_gap, abs(plain - reported[k]))
        assert matcher.accept_token(token)
    assert masked_gap < 1e-4, masked_gap
    assert plain_gap > 0.1  # the grammar really changed the distribution (else this test proves nothing)
    # the alternatives offered are allowed tokens only: none at -inf, all at or below the sampled mass
    assert all(e[0] > float("-inf") for row in out["meta_info"].get("output_top_logprobs", []) for e in row)


def test_unconstrained_rows_are_unchanged_by_a_constrained_neighbour(engine_url):
    solo = generate(engine_url, PROMPTS[4], max_new_tokens=24, sampling_seed=11)
    with ThreadPoolExecutor(4) as pool:
        constrained = [pool.submit(generate, engine_url, PROMPTS[i], json_schema=json.dumps(SCHEMA),
                                   max_new_tokens=64, sampling_seed=i) for i in range(3)]
        free = pool.submit(generate, engine_url, PROMPTS[4], max_new_tokens=24, sampling_seed=11)
        results = [c.result() for c in constrained]
        together = free.result()
    assert together["output_ids"] == solo["output_ids"]
    for r in results:
        json.loads(r["text"])
    assert [e[0] for e in together["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [e[0] for e in solo["meta_info"]["output_token_logprobs"]], abs=1e-4)


def test_streamed_constrained_output(engine_url):
    body = {"input_ids": PROMPTS[5], "stream": True, "return_logprob": True,
            "sampling_params": {"regex": "[a-c]{4}", "max_new_tokens": 16, "sampling_seed": 3}}
    with httpx.stream("POST", engine_url + "/generate", json=body, timeout=120) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert re.fullmatch("[a-c]{4}", last["text"]) and last["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("sampling, fragment", [
    ({"regex": "([a-z"}, "regex does not compile"),
    ({"json_schema": "{not json"}, "json_schema does not compile"),
    ({"json_schema": json.dumps({"type": "nope"})}, "json_schema does not compile"),
    ({"ebnf": "root ::= undefined_rule"}, "ebnf does not compile"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "only one of json_schema, regex, ebnf, or structural_tag"),
    ({"regex": 3}, "regex must be a string"),
])
def test_bad_grammar_is_a_400_and_the_engine_keeps_serving(engine_url, sampling, fragment):
    body = {"input_ids": PROMPTS[6], "sampling_params": {"max_new_tokens": 4, **sampling}}
    response = httpx.post(engine_url + "/generate", json=body, timeout=60)
    assert response.status_code == 400 and fragment in response.json()["error"]["message"], response.text
    assert generate(engine_url, PROMPTS[6], max_new_tokens=2)["meta_info"]["completion_tokens"] == 2
