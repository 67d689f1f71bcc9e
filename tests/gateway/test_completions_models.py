"""``GET /v1/models/{id}`` and the legacy completions' streamed logprobs and prompt batches, driven by the
real ``openai`` SDK (in-process gateway, stand-in engine, SQLite)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.gateway.test_openai_inprocess import (  # noqa: F401  (fixtures)
    interactions,
    make_gw,
    tokenizer,
)


async def test_models_retrieve_and_unknown_id_is_an_openai_404(make_gw: Any) -> None:
    async with make_gw(["a"]) as gw:
        client = gw.sdk()
        model = await client.models.retrieve("tiny")
        assert (model.id, model.object, model.owned_by) == ("tiny", "model", "agentrl") and model.created > 0
        with pytest.raises(openai.NotFoundError) as info:
            await client.models.retrieve("gpt-5")
        body = info.value.body
        assert isinstance(body, dict) and body["code"] == "model_not_found" and body["param"] == "model"
        assert (await gw.http.get("/v1/models/tiny")).status_code == 401  # no key


async def test_streamed_completion_logprobs_match_the_plain_ones(make_gw: Any) -> None:
    async with make_gw(["The answer is forty two."] * 2) as gw:
        sess = await gw.session()
        client = gw.sdk(key=sess["api_key"])
        plain = await client.completions.create(model="m", prompt="Q?", max_tokens=20, logprobs=0)
        lp = plain.choices[0].logprobs
        assert lp is not None and lp.tokens and len(lp.tokens) == len(lp.token_logprobs or [])
        stream = await client.completions.create(model="m", prompt="Q?", max_tokens=20, logprobs=0, stream=True)
        tokens: list[str] = []
        values: list[float] = []
        text = ""
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                if c.logprobs is not None:
                    tokens += c.logprobs.tokens or []
                    values += c.logprobs.token_logprobs or []
        assert text == plain.choices[0].text == "The answer is forty two."
        assert tokens == lp.tokens and values == lp.token_logprobs
        assert "".join(tokens) == text
        # without logprobs the stream carries none
        stream = await client.completions.create(model="m", prompt="Q?", max_tokens=20, stream=True)
        seen = [c.logprobs async for chunk in stream for c in chunk.choices]
        assert seen and all(lp is None for lp in seen)


async def test_prompt_list_is_a_batch_one_turn_per_prompt(make_gw: Any) -> None:
    async with make_gw(["x"] * 8) as gw:
        sess = await gw.session()
        client = gw.sdk(key=sess["api_key"])
        r = await client.completions.create(model="m", prompt=["one", "two"], n=2, max_tokens=4)
        assert [c.index for c in r.choices] == [0, 1, 2, 3] and {c.text for c in r.choices} == {"x"}
        turns = await interactions(gw, sess["session_id"])
        assert sorted(t.request["prompt"] for t in turns) == ["one", "one", "two", "two"]
        assert r.usage is not None and r.usage.completion_tokens == sum(len(t.output_ids) for t in turns)
        # a one-element list is a single prompt; token-id lists batch too
        single = await client.completions.create(model="m", prompt=["three"], max_tokens=4)
        assert len(single.choices) == 1
        ids = gw.svc.tokenizer.encode(" hello", add_special_tokens=False)
        both = await client.completions.create(model="m", prompt=[ids, ids], max_tokens=4)
        assert [c.index for c in both.choices] == [0, 1]
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model="m", prompt=["a", "b"], max_tokens=4, stream=True)
        body = info.value.body
        assert isinstance(body, dict) and body["param"] == "prompt" and "batch" in body["message"]
        for prompt in ([[]], [ids, []], ["a"] * 17):  # an empty prompt; more choices than --max-n (16)
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model="m", prompt=prompt, max_tokens=4)
            assert isinstance(info.value.body, dict) and info.value.body["param"].startswith("prompt"), prompt
        assert len(await interactions(gw, sess["session_id"])) == 7
