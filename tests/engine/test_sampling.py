"""The sampler and sampling-parameter validation, as pure functions (no server)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling import InvalidRequest, SamplingParams, penalise, sample

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def draw(params: SamplingParams, n: int, logits: torch.Tensor = LOGITS) -> tuple[torch.Tensor, dict[int, float]]:
    gen = params.generator()
    counts = torch.zeros(logits.shape[1])
    logprob_of = {}
    for _ in range(n):
        tokens, logprobs, _ = sample(logits, [params], [gen])
        counts[tokens[0]] += 1
        logprob_of[int(tokens[0])] = float(logprobs[0])
    return counts / n, logprob_of


def test_defaults_follow_sglang():
    p = SamplingParams.parse({}, vocab_size=10)
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert SamplingParams.parse({"temperature": None, "top_k": None}, vocab_size=10).temperature == 1.0
    assert SamplingParams.parse({"stop": "x"}, vocab_size=10).stop == ["x"]


@pytest.mark.parametrize("raw", [
    {"temperature": -1}, {"temperature": True}, {"temperature": float("nan")}, {"top_p": 1.5}, {"top_k": -2},
    {"min_p": 2}, {"max_new_tokens": "5"}, {"stop": [1]}, {"stop_token_ids": [10]}, {"ignore_eos": "yes"},
    {"sampling_seed": 1.5}, {"unknown": 1}, [1, 2],
])
def test_bad_params_are_refused_with_the_key_named(raw):
    with pytest.raises(InvalidRequest) as info:
        SamplingParams.parse(raw, vocab_size=10)
    key = next(iter(raw)) if isinstance(raw, dict) else "sampling_params"
    assert key in str(info.value)


# Each key's exact message (as before the parser became one table of keys in engine/sampling.py).
@pytest.mark.parametrize("raw, message", [
    ({"n": 2}, "sampling_params.n must be 1 (send one request per sample)"),
    ({"n": 1.0}, "sampling_params.n must be an integer, got 1.0"),
    ({"max_new_tokens": -1}, "sampling_params.max_new_tokens must be >= 0, got -1"),
    ({"max_new_tokens": True}, "sampling_params.max_new_tokens must be an integer, got True"),
    ({"temperature": -1}, "sampling_params.temperature must be >= 0, got -1.0"),
    ({"temperature": "hot"}, "sampling_params.temperature must be a number, got 'hot'"),
    ({"temperature": float("inf")}, "sampling_params.temperature must be finite, got inf"),
    ({"top_p": 0}, "sampling_params.top_p must be in (0, 1], got 0.0"),
    ({"top_p": 1.5}, "sampling_params.top_p must be in (0, 1], got 1.5"),
    ({"top_k": 0}, "sampling_params.top_k must be -1 (off) or >= 1, got 0"),
    ({"top_k": 1.0}, "sampling_params.top_k must be an integer, got 1.0"),
    ({"min_p": -0.1}, "sampling_params.min_p must be in [0, 1], got -0.1"),
    ({"min_p": 2}, "sampling_params.min_p must be in [0, 1], got 2.0"),
    ({"stop": ""}, "sampling_params.stop must be a non-empty string or a list of them"),
    ({"stop_token_ids": "2"}, "sampling_params.stop_token_ids must be a list of token ids"),
    ({"stop_token_ids": [-1]}, "sampling_params.stop_token_ids: -1 is outside the vocabulary [0, 10)"),
    ({"stop_token_ids": [1.0]}, "sampling_params.stop_token_ids[] must be an integer, got 1.0"),
    ({"no_stop_trim": 1}, "sampling_params.no_stop_trim must be true or false, got 1"),
    ({"skip_special_tokens": "no"}, "sampling_params.skip_special_tokens must be true or false, got 'no'"),
    ({"frequency_penalty": 3}, "sampling_params.frequency_penalty must be in [-2.0, 2.0], got 3.0"),
    ({"presence_penalty": -2.5}, "sampling_params.presence_penalty must be in [-2.0, 2.0], got -2.5"),
    ({"repetition_penalty": 0}, "sampling_params.repetition_penalty must be in (0, 2], got 0.0"),
    ({"repetition_penalty": 2.5}, "sampling_params.repetition_penalty must be in (0, 2], got 2.5"),
    ({"min_new_tokens": -1}, "sampling_params.min_new_tokens must be >= 0, got -1"),
    ({"min_new_tokens": 1.5}, "sampling_params.min_new_tokens must be an integer, got 1.5"),
    ({"logit_bias": {"a": 1}}, "sampling_params.logit_bias: key 'a' is not a token id in [0, 10)"),
    ({"logit_bias": {"1": float("nan")}}, "sampling_params.logit_bias[1] must be finite, got nan"),
    ({"structural_tag": 3}, "sampling_params.structural_tag must be a string, got int"),
    ({"json_schema": "{}", "regex": "a", "structural_tag": "x"},
     "only one of json_schema, regex, ebnf, or structural_tag can be set; got ['json_schema', 'regex', 'structural_tag']"),
    ({"sampling_seed": "1"}, "sampling_params.sampling_seed must be an integer, got '1'"),
    ("x", "sampling_params must be an object, got str"),
    # several bad keys: the first in the table's order is named
    ({"ignore_eos": "yes", "stop": [1]}, "sampling_params.stop must be a non-empty string or a list of them"),
    ({"min_new_tokens": -1, "sampling_seed": 1.5}, "sampling_params.min_new_tokens must be >= 0, got -1"),
    ({"regex": 3, "top_k": 0}, "sampling_params.top_k must be -1 (off) or >= 1, got 0"),
])
def test_each_key_is_refused_with_its_own_message(raw: object, message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams.parse(raw, vocab_size=10)
    assert str(info.value) == message


def test_every_key_at_the_edge_of_its_range_is_accepted() -> None:
    p = SamplingParams.parse({
        "n": 1, "max_new_tokens": 0, "temperature": 0, "top_p": 1, "top_k": 1, "min_p": 1, "stop": "x",
        "stop_token_ids": [0, 9], "ignore_eos": True, "no_stop_trim": True, "skip_special_tokens": False,
        "frequency_penalty": -2, "presence_penalty": 2, "repetition_penalty": 2, "min_new_tokens": 3,
        "logit_bias": {"9": -1}, "regex": "", "ebnf": "e", "sampling_seed": 7, "spaces_between_special_tokens": False,
    }, vocab_size=10)
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (0, 0.0, 1.0, 1, 1.0)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.no_stop_trim, p.skip_special_tokens) == (["x"], [0, 9], True, True, False)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty, p.min_new_tokens) == (-2.0, 2.0, 2.0, 3)
    assert p.logit_bias == {9: -1.0} and p.grammar == ("ebnf", "e") and p.regex is None and p.sampling_seed == 7
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)  # JSON integers become floats
    assert SamplingParams.parse({"stop": []}, vocab_size=10).stop == []
    assert SamplingParams.parse({"top_k": -1, "top_p": 1e-9}, vocab_size=10).top_k == -1
    assert SamplingParams.parse({"logit_bias": {}}, vocab_size=10).logit_bias is not SamplingParams().logit_bias


def test_temperature_one_logprobs_are_the_model_logsoftmax():
    freqs, logprob_of = draw(SamplingParams(temperature=1.0, sampling_seed=0), 800)
    expected = torch.log_softmax(LOGITS[0], -1)
    for token, lp in logprob_of.items():
        assert lp == pytest.approx(expected[token].item(), abs=1e-6)
    assert torch.allclose(freqs, expected.exp(), atol=0.06)


def test_top_k_and_top_p_logprobs_are_renormalised_over_the_support():
    freqs, logprob_of = draw(SamplingParams(temperature=0.5, top_k=2, sampling_seed=0), 300)
    support = torch.log_softmax(LOGITS[0, :2] / 0.5, -1)
    assert set(logprob_of) <= {0, 1}
    for token, lp in logprob_of.items():
        assert lp == pytest.approx(support[token].item(), abs=1e-6)
    # top_p: the smallest prefix whose mass reaches top_p; p = [.561, .206, .125, ...], so 0.7 keeps two
    probs = torch.softmax(LOGITS[0], -1)
    freqs, logprob_of = draw(SamplingParams(top_p=0.7, sampling_seed=1), 300)
    assert set(logprob_of) == {0, 1}
    kept = probs[:2] / probs[:2].sum()
    for token, lp in logprob_of.items():
        assert lp == pytest.approx(math.log(kept[token].item()), abs=1e-5)


def test_greedy_reports_the_temperature_one_logprob():
    tokens, logprobs, _ = sample(LOGITS, [SamplingParams(temperature=0)], [SamplingParams().generator()])
    assert int(tokens[0]) == 0
    assert float(logprobs[0]) == pytest.approx(torch.log_softmax(LOGITS[0], -1)[0].item(), abs=1e-6)


def test_rows_are_independent_and_seeded():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, sampling_seed=5), SamplingParams(temperature=0),
              SamplingParams(temperature=0.8, top_k=5, sampling_seed=9)]
    first = sample(logits, params, [p.generator() for p in params])[0]
    again = sample(logits, params, [p.generator() for p in params])[0]
    alone = sample(logits[:1], params[:1], [params[0].generator()])[0]
    assert first.tolist() == again.tolist()
    assert first[0] == alone[0]  # a row's draw does not depend on the other rows
    assert first[1] == logits[1].argmax()


# ------------------------------------------------------------------------------------------ penalties
def test_penalties_follow_sglang_by_hand() -> None:
    """Hand-computed values of SGLang's penalisers (repetition, frequency, presence, min_new_tokens, bias)."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    p = SamplingParams.parse({"repetition_penalty": 2.0, "frequency_penalty": 0.5, "presence_penalty": 0.25,
                              "logit_bias": {"3": 1.5}, "min_new_tokens": 4, "stop_token_ids": [2]},
                             vocab_size=4)
    out = penalise(logits, [p], [[0, 0, 1]], {3})
    # token 0: seen twice: 2/2 - 0.5*2 - 0.25 = -0.25; token 1: seen once: -1*2 - 0.5 - 0.25 = -2.75
    # token 2 is a stop token before 4 outputs: -inf; token 3 (EOS) likewise, its bias does not lift it
    assert out[0, :2].tolist() == [-0.25, -2.75]
    assert out[0, 2] == float("-inf") and out[0, 3] == float("-inf")
    assert logits.tolist() == [[2.0, -1.0, 0.5, 0.0]]  # the model's logits are not touched
    after = penalise(logits, [p], [[1, 1, 1, 1]], {3})
    assert after[0, 3] == 1.5 and after[0, 2] == 0.5  # 4 outputs: stop tokens allowed again, bias applies


def test_penalised_row_reports_the_penalised_distribution_and_others_are_untouched() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0], [2.0, 1.0, 0.5, 0.0]])
    plain = SamplingParams()
    biased = SamplingParams.parse({"logit_bias": {"3": 50}}, vocab_size=4)
    gens = [plain.generator(), biased.generator()]
    tokens, logprobs, dists = sample(logits, [plain, biased], gens, [[], []], set())
    assert int(tokens[1]) == 3 and float(logprobs[1]) == pytest.approx(0.0, abs=1e-6)
    expected = torch.log_softmax(torch.tensor([2.0, 1.0, 0.5, 50.0]), -1)
    assert torch.allclose(dists[1], expected)
    assert torch.allclose(dists[0], torch.log_softmax(logits[0], -1))  # the unpenalised row is as before
    assert float(logprobs[0]) == pytest.approx(float(torch.log_softmax(logits[0], -1)[int(tokens[0])]))


@pytest.mark.parametrize("raw", [{"presence_penalty": 3}, {"frequency_penalty": "x"}, {"repetition_penalty": 0},
                                 {"min_new_tokens": -1}, {"logit_bias": {"99": 1}}, {"logit_bias": [1]}])
def test_bad_penalties_are_refused(raw: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest):
        SamplingParams.parse(raw, vocab_size=10)
