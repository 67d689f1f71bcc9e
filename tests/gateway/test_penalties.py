"""Penalties through real processes: the ``openai`` SDK -> gateway -> the tiny embedded engine (SGLang's
native ``sampling_params``). The engine samples from the penalised distribution and reports its logprobs;
the turn records which penalties applied, and export refuses such sessions for training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from agentrl.trajectory import UntrainableSampling, export_session, turn_from_interaction
from gateway.app import load_tokenizer
from tests.gateway.conftest import GatewayProc
from tests.gateway.test_processes import read_turns, sdk

MSGS = [{"role": "user", "content": "Say something."}]


def test_logit_bias_and_min_tokens_are_sampled_from_and_recorded(gateway: GatewayProc, tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    target = tok.encode(" hello", add_special_tokens=False)[0]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    sess = gateway.create_session()
    client = sdk(gateway, sess["api_key"])
    plain = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, seed=7, logprobs=True)
    biased = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, seed=7, logprobs=True,
                                            logit_bias={str(target): 100})
    turns = read_turns(gateway.db, [plain.id, biased.id])
    assert turns[1].output_ids == [target] * 4
    # the reported logprobs are those of the biased distribution (~1 for the target), not the model's own
    assert biased.choices[0].logprobs is not None and plain.choices[0].logprobs is not None
    assert all(c.logprob > -1e-3 for c in biased.choices[0].logprobs.content)
    assert all(c.logprob < -1.0 for c in plain.choices[0].logprobs.content)  # random tiny weights: ~uniform
    assert turns[1].request["params"]["logit_bias"] == {str(target): 100}
    assert "logit_bias" not in turns[0].request["params"]
    # EOS pushed up by 100 ends every turn at once, unless min_tokens holds it off for 3 tokens
    early = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=10, seed=1,
                                           logit_bias={str(end): 100})
    held = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=10, seed=1,
                                          logit_bias={str(end): 100}, extra_body={"min_tokens": 3})
    early_t, held_t = read_turns(gateway.db, [early.id, held.id])
    assert early_t.output_ids == [end] and early.choices[0].finish_reason == "stop"
    assert len(held_t.output_ids) == 4 and held_t.output_ids[-1] == end and end not in held_t.output_ids[:3]
    assert held_t.request["params"]["min_tokens"] == 3
    # penalties are recorded; a session sampled under any of them is refused for training
    pen = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3, presence_penalty=1.5,
                                         frequency_penalty=0.5, extra_body={"repetition_penalty": 1.3})
    (pen_t,) = read_turns(gateway.db, [pen.id])
    assert {k: pen_t.request["params"][k] for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")} \
        == {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3}
    with pytest.raises(UntrainableSampling, match="penalised distribution"):
        export_session([turn_from_interaction(pen_t)], gamma=1.0)
    assert export_session([turn_from_interaction(turns[0])], gamma=1.0)  # the plain turn exports
    # bad values: 400 with param, nothing recorded
    for kwargs, param in [({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
                          ({"extra_body": {"min_tokens": -2}}, "min_tokens"),
                          ({"frequency_penalty": 2.5}, "frequency_penalty")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3, **kwargs)
        body: Any = info.value.body
        assert body["param"] == param, body


def test_penalties_travel_under_each_engines_own_names() -> None:
    """SGLang 0.5.19 ``SamplingParams``: min_new_tokens; vLLM ``SamplingParams``: min_tokens; the rest alike."""
    from gateway.engine_client import SamplingParams
    from engines.vllm import sampling_params

    pen = {"presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.2,
           "logit_bias": {"7": -100.0}, "min_new_tokens": 2}
    params = SamplingParams(max_new_tokens=8, penalties=pen)
    sglang = params.to_wire(8)
    assert {k: sglang[k] for k in pen} == pen
    vllm = sampling_params(params, 8)
    assert vllm["min_tokens"] == 2 and "min_new_tokens" not in vllm
    assert {k: vllm[k] for k in pen if k != "min_new_tokens"} == {k: v for k, v in pen.items() if k != "min_new_tokens"}
    assert "presence_penalty" not in SamplingParams(max_new_tokens=8).to_wire(8)  # defaults send nothing
