"""Lease parsing, duplicate dropping, sharding and micro-batch packing."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from agentrl.trajectory import encode_batch
from tests.trainer.helpers import synthetic_rows
from trainer import data


def test_pack_micro_batches_respects_padded_budget():
    lengths = [10, 3, 7, 7, 2, 9, 1]
    packs = data.pack_micro_batches(lengths, budget=20)
    assert sorted(i for p in packs for i in p) == list(range(7))
    for p in packs:
        assert len(p) * max(lengths[i] for i in p) <= 20
    with pytest.raises(ValueError, match="more than the micro-batch budget"):
        data.pack_micro_batches([5, 21], budget=20)


def test_shard_rows_balances_and_covers():
    lengths = [50, 10, 40, 20, 30, 5]
    shards = data.shard_rows(lengths, 2)
    assert sorted(i for s in shards for i in s) == list(range(6))
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert abs(loads[0] - loads[1]) <= 5


def test_drop_duplicates_across_and_within_batches():
    rows = synthetic_rows(n_groups=1, group_size=3)
    seen = data.SeenRows()
    seen.add(rows[0].row_id)
    kept, dropped = data.drop_duplicates(rows + [rows[1]], seen)
    assert [r.row_id for r in kept] == [rows[1].row_id, rows[2].row_id]
    assert dropped == 2


def test_seen_rows_is_bounded():
    seen = data.SeenRows(limit=2)
    for i in range(3):
        seen.add(str(i))
    assert "0" not in seen and "2" in seen


def test_collate_shifts_to_predicted_tokens():
    rows = synthetic_rows(n_groups=1, group_size=2, prompt_len=3, max_out=4)
    mb = data.collate(rows, [0, 1], torch.tensor([1.5, -1.5]))
    width = max(r.num_tokens for r in rows)
    assert mb.input_ids.shape == (2, width) and mb.loss_mask.shape == (2, width - 1)
    r = rows[0]
    n = r.num_tokens
    assert mb.loss_mask[0, : n - 1].tolist() == r.loss_mask[1:].astype(float).tolist()
    assert mb.behaviour[0, : n - 1].tolist() == pytest.approx(r.logprobs[1:].tolist())
    assert mb.attention_mask[0].sum() == n
    assert mb.advantages.tolist() == [1.5, -1.5]


def test_lease_client_against_a_mock_gateway():
    rows = synthetic_rows(n_groups=2, group_size=2)
    body = encode_batch(rows, {"lease_id": "L1"})
    acked = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer adm"
        if request.url.path == "/v1/trajectories":
            assert request.url.params["max_groups"] == "2"
            return httpx.Response(200, content=body, headers={"content-type": "application/octet-stream"})
        if request.url.path == "/v1/trajectories/ack":
            acked.append(request.read())
            return httpx.Response(200, json={"acked": True})
        return httpx.Response(404)

    client = data.LeaseClient("http://gw", "adm", client=httpx.Client(transport=httpx.MockTransport(handler)))
    lease = client.lease(2, 0.1)
    assert lease.lease_id == "L1" and [r.row_id for r in lease.rows] == [r.row_id for r in rows]
    assert np.array_equal(lease.rows[1].input_ids, rows[1].input_ids)
    client.ack("L1")
    assert b"L1" in acked[0]


def test_lease_client_empty_and_errors():
    responses = iter([httpx.Response(204), httpx.Response(401, json={"error": {"message": "bad key"}})])
    client = data.LeaseClient("http://gw", "k", client=httpx.Client(transport=httpx.MockTransport(lambda r: next(responses))))
    assert client.lease(1, 0.1) is None
    with pytest.raises(data.GatewayError, match="401"):
        client.lease(1, 0.1)


def test_split_by_group_keeps_groups_whole():
    rows = synthetic_rows(n_groups=3, group_size=2)
    parts = data.split_by_group(rows, 2)
    for part in parts:
        groups = {rows[i].group_id for i in part}
        assert all(sum(rows[i].group_id == g for i in part) == 2 for g in groups)


def test_row_rewards_recomputed_with_gamma():
    rows = synthetic_rows(n_groups=1, group_size=1)
    rows[0].turn_rewards = np.array([1.0, 0.0, 2.0])
    assert data.row_rewards(rows, 0.5).tolist() == [1.0 + 0.25 * 2.0]
    assert data.row_rewards(rows, None).tolist() == [rows[0].reward]


def test_advantages_are_normalised_per_exported_group_key_not_group_id():
    """Two exported chunks of one group id (implicit mode: same root prompt at different times) are two
    GRPO groups: rewards 0/1 in one and 10/11 in the other give +-0.71 each, not a mix around 5.5."""
    from dataclasses import replace

    from trainer.config import TrainerSettings
    from trainer.step import advantages_for

    rows = synthetic_rows(n_groups=1, group_size=4)
    for i, r in enumerate(rows):
        r.reward = [0.0, 1.0, 10.0, 11.0][i]
        r.turn_rewards = r.turn_returns = np.array([r.reward])
    rows = [replace(r, group_key="k1" if i < 2 else "k2") for i, r in enumerate(rows)]
    adv, metrics = advantages_for(rows, TrainerSettings())
    assert adv.tolist() == pytest.approx([-0.7071, 0.7071, -0.7071, 0.7071], abs=1e-3)
    assert metrics["adv/groups"] == 2.0
    assert data.split_by_group(rows, 2) == [[0, 1], [2, 3]]
    assert [g["group_key"] for g in data.describe_batch(rows, None)["batch/reward_spread"]] == ["k1", "k2"]


def test_collate_carries_each_tokens_temperature():
    rows = synthetic_rows(n_groups=1, group_size=2)
    rows[0].turn_temperatures = np.array([0.7], dtype=np.float32)
    micro = data.collate(rows, [0, 1], torch.zeros(2))
    n = rows[0].num_tokens
    want = torch.from_numpy(np.where(rows[0].loss_mask[1:] == 1, 0.7, 1.0).astype(np.float32))
    assert torch.equal(micro.temperature[0, : n - 1], want)
    assert torch.all(micro.temperature[1] == 1.0)


def test_packed_and_padded_logprobs_agree_under_per_token_temperatures(tiny_model_dir):
    """The packed LM-head path (trainer.packing) and the padded one divide each token's logits by its own
    temperature, forward and backward alike."""
    from transformers import AutoModelForCausalLM

    from trainer.model import token_logprobs
    from trainer.packing import packed_logprobs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    rows = synthetic_rows(n_groups=1, group_size=3, vocab=500)
    for i, r in enumerate(rows):
        r.turn_temperatures = np.array([0.6 + 0.4 * i], dtype=np.float32)
    m = data.collate(rows, [0, 1, 2], torch.zeros(3))
    temp = m.temperature
    mask = m.loss_mask.bool()
    padded, _ = token_logprobs(model, m.input_ids, m.attention_mask, temperature=temp)
    packed, _ = packed_logprobs(model, m.input_ids, m.attention_mask, m.loss_mask, temperature=temp)
    assert torch.allclose(padded[mask], packed[mask], atol=1e-5)
    plain, _ = token_logprobs(model, m.input_ids, m.attention_mask)
    assert not torch.allclose(plain[mask], padded[mask], atol=1e-3)
    g1 = torch.autograd.grad(padded[mask].sum(), model.lm_head.weight)[0]
    g2 = torch.autograd.grad(packed[mask].sum(), model.lm_head.weight)[0]
    assert torch.allclose(g1, g2, atol=1e-5)
