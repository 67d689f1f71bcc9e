"""The packed, loss-positions-only logprob path (trainer.packing) against the padded full-logits path."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.trainer.helpers import full, synthetic_rows
from trainer.config import TrainerSettings
from trainer.data import collate
from trainer.model import load_model, token_logprobs
from trainer.packing import LinearLogprob, pack, packed_logprobs
from trainer.step import train_step


def _padded(rows):
    return collate(rows, list(range(len(rows))), torch.zeros(len(rows)))


def test_pack_layout_restarts_positions_and_indexes_loss_tokens():
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    att = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    loss = torch.tensor([[0., 1., 1.], [1., 0., 0.]])  # predicts tokens 7, 8 of row 0 and 10 of row 1
    p = pack(ids, att, loss)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 0, 1]]
    assert p.index.tolist() == [0, 1, 2, 3, 4, 5]  # flat positions in the padded (2, 4) layout
    assert p.src.tolist() == [1, 2, 4]  # hidden states at tokens 6, 7 (row 0) and 9 (row 1)
    assert p.targets.tolist() == [7, 8, 10]
    assert p.dst.tolist() == [1, 2, 3]  # flat (B, T-1) = (2, 3) positions


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_linear_logprob_matches_autograd_in_float64(temperature):
    torch.manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (37,))
    g = torch.randn(37, dtype=torch.float64)
    logp, ent = LinearLogprob.apply(h, w, t, 8, temperature)  # 5 chunks, the last one short
    (logp * g).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = torch.log_softmax(h @ w.t() / temperature, dim=-1)
    (ref.gather(-1, t[:, None])[:, 0] * g).sum().backward()
    assert torch.allclose(logp, ref.gather(-1, t[:, None])[:, 0], atol=1e-12)
    assert torch.allclose(ent, -(ref.exp() * ref).sum(-1), atol=1e-12)
    assert torch.allclose(gh, h.grad, atol=1e-12) and torch.allclose(gw, w.grad, atol=1e-12)


def test_packed_logprobs_equal_padded_ones(tiny_model_dir, dist_info):
    rows = synthetic_rows(n_groups=2, group_size=3, seed=3, max_out=12)
    m = _padded(rows)
    model = load_model(tiny_model_dir)
    ref, ref_ent = token_logprobs(model, m.input_ids, m.attention_mask, with_entropy=True)
    logp, ent = packed_logprobs(model, m.input_ids, m.attention_mask, m.loss_mask, with_entropy=True)
    mask = m.loss_mask.bool()
    assert mask.sum() > 10
    assert torch.allclose(logp[mask], ref[mask], atol=2e-5), (logp[mask] - ref[mask]).abs().max()
    assert torch.allclose(ent[mask], ref_ent[mask], atol=2e-5)
    assert (logp[~mask] == 0).all() and (ent[~mask] == 0).all()


def test_packed_step_equals_unpacked_step(tiny_model_dir, dist_info):
    """Loss, gradient norm, entropy and the updated weights agree between the two paths (float32, CPU)."""
    rows = synthetic_rows(n_groups=3, group_size=3, seed=5, max_out=14)
    results = []
    for packing in (False, True):
        torch.manual_seed(0)
        model = load_model(tiny_model_dir)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        settings = TrainerSettings(engine_urls=["unused"], micro_batch_tokens=64, packing=packing)
        metrics = train_step(model, opt, rows, settings, dist_info, version=0)
        weights = {k: full(v).clone() for k, v in model.state_dict().items()}
        results.append((metrics, weights))
    (a, wa), (b, wb) = results
    for key in ("actor/loss", "actor/grad_norm", "actor/entropy", "batch/loss_tokens", "batch/tokens",
                "logprob_gap/mean", "actor/is_weight_mean"):
        assert np.isclose(a[key], b[key], rtol=1e-4, atol=1e-6), (key, a[key], b[key])
    assert a["actor/grad_norm"] > 0
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-5), k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_packed_step_equals_unpacked_step_on_gpu_bf16(tiny_model_dir):
    """The GPU path (bf16 compute, fused AdamW, compile) against the unpacked step, bf16 tolerances."""
    import torch.distributed as dist

    from trainer.model import build_optimizer, init_distributed

    if dist.is_initialized() and "nccl" not in str(dist.get_backend()):
        pytest.skip("this session already joined a CPU (gloo) process group; run this test on its own")
    info = init_distributed("cuda")
    rows = synthetic_rows(n_groups=3, group_size=3, seed=5, max_out=14)
    out = []
    for packing in (False, True):
        torch.manual_seed(0)
        model = load_model(tiny_model_dir, dtype="bfloat16", device=info.device, compile=packing)
        settings = TrainerSettings(engine_urls=["unused"], micro_batch_tokens=64, packing=packing)
        out.append(train_step(model, build_optimizer(model, settings, info.device), rows, settings, info, version=0))
    a, b = out
    assert abs(a["actor/loss"] - b["actor/loss"]) <= 2e-3 + 2e-2 * abs(a["actor/loss"])
    assert abs(a["actor/grad_norm"] - b["actor/grad_norm"]) <= 3e-2 * a["actor/grad_norm"]
