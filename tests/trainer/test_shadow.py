"""One rank without FSDP: bf16 compute weights beside float32 masters (trainer.shadow), the clipping folded
into a fused AdamW, and the unpadded attention layout; each against the path it replaces."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.trainer.helpers import full, synthetic_rows
from trainer import shadow
from trainer.config import TrainerSettings
from trainer.data import collate
from trainer.model import load_model, token_logprobs
from trainer.packing import pack, packed_logprobs
from trainer.step import _clip_and_step, train_step


def _step(tiny_model_dir, dist_info, rows, **load):
    torch.manual_seed(0)
    model = load_model(tiny_model_dir, dtype="bfloat16", **load)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    settings = TrainerSettings(engine_urls=["unused"], micro_batch_tokens=64, packing=True)
    metrics = train_step(model, opt, rows, settings, dist_info, version=0)
    return model, metrics


def test_bf16_shadow_step_matches_the_fsdp_mixed_precision_step(tiny_model_dir, dist_info):
    """Same step, bf16 compute, one rank: shadow weights vs FSDP2's per-step cast (the path it replaces)."""
    rows = synthetic_rows(n_groups=3, group_size=3, seed=7, max_out=14)  # several micro-batches of 64 tokens
    model, a = _step(tiny_model_dir, dist_info, rows)
    ref, b = _step(tiny_model_dir, dist_info, rows, fsdp=True)
    sh = shadow.get(model)
    assert sh is not None and shadow.get(ref) is None
    # the module shows float32 masters outside the forward pass: state_dict, pushes and checkpoints see them
    assert all(v.dtype == torch.float32 for v in model.state_dict().values())
    assert all(leaf.dtype == torch.bfloat16 for leaf in sh.leaves)
    # the step's numbers agree within bf16 rounding (the tolerances bench/trainer.py uses on GPUs)
    for key in ("actor/loss", "actor/grad_norm", "actor/entropy"):
        assert abs(a[key] - b[key]) <= 2e-3 + 2e-2 * abs(b[key]), (key, a[key], b[key])
    assert a["batch/tokens"] == b["batch/tokens"] and a["batch/loss_tokens"] == b["batch/loss_tokens"]
    # masters moved the same way, and the compute copy was refreshed from them after the optimizer step
    start = dict(load_model(tiny_model_dir).named_parameters())
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.dtype == torch.float32
        assert torch.allclose(p, full(q), atol=2e-3), name  # lr 1e-3: bf16 gradient rounding may flip a step's sign
        assert not torch.equal(p, start[name]), name
    for master, leaf in zip(sh.masters, sh.leaves):
        assert torch.equal(leaf, master.detach().to(torch.bfloat16))
    assert all(m.grad is not None for m in sh.masters) and all(leaf.grad is None for leaf in sh.leaves)


def test_a_shadowed_model_is_freed_with_its_last_reference(tiny_model_dir, dist_info):
    import gc
    import weakref

    model, _ = _step(tiny_model_dir, dist_info, synthetic_rows(n_groups=2, group_size=2, seed=1))
    refs = [weakref.ref(model), weakref.ref(next(model.parameters())), weakref.ref(shadow.get(model).leaves[0])]
    del model
    gc.collect()
    assert all(r() is None for r in refs)


def test_shadow_follows_a_master_changed_outside_the_optimizer(tiny_model_dir):
    model = load_model(tiny_model_dir, dtype="bfloat16")
    sh = shadow.get(model)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with shadow.compute_weights(model):
        before = model(input_ids=ids).logits
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)  # e.g. a checkpoint load: the version counter moves
    with shadow.compute_weights(model):
        assert model.model.norm.weight.dtype == torch.bfloat16
        after = model(input_ids=ids).logits
    assert model.model.norm.weight.dtype == torch.float32
    k = next(i for i, m in enumerate(sh.masters) if m is model.model.norm.weight)
    assert torch.equal(sh.leaves[k], model.model.norm.weight.detach().to(torch.bfloat16))
    assert not torch.allclose(before, after)


def test_shadow_accumulates_micro_batch_gradients_in_float32(tiny_model_dir):
    model = load_model(tiny_model_dir, dtype="bfloat16")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    grads = []
    for _ in range(2):
        with shadow.compute_weights(model):
            model(input_ids=ids).logits.float().square().mean().backward()
        assert all(leaf.grad is not None for leaf in shadow.get(model).leaves)  # on the bf16 leaves until collected
        shadow.collect_grads(model)
        grads.append(model.model.norm.weight.grad.clone())
    assert grads[0].dtype == torch.float32
    assert torch.allclose(grads[1], 2 * grads[0], rtol=1e-6)  # added in float32: exactly twice


def test_fused_adamw_clipping_by_grad_scale_equals_clip_grad_norm(tiny_model_dir):
    """_clip_and_step's fused path (clip folded into AdamW's grad_scale) against clip_grad_norm_ + AdamW."""
    out = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = load_model(tiny_model_dir)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 3.0  # norm far above 1: clipping is active
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        norm = float(_clip_and_step(model, opt, 1.0))
        assert getattr(opt, "grad_scale", None) is None
        out.append((norm, [p.detach().clone() for p in model.parameters()]))
    (n0, w0), (n1, w1) = out
    assert n0 > 10 and np.isclose(n0, n1, rtol=1e-6)
    for a, b in zip(w0, w1):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("max_norm", [1.0, 0.0])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_gradient_skips_the_update_fused_or_not(tiny_model_dir, max_norm, bad):
    """An inf or NaN in one gradient, with clipping on and off (max_norm 0), fused AdamW or not: the norm is
    reported as it is, no weight, moment or step count changes (it used to turn every weight into NaN), and
    the next finite update goes through, the same in both paths."""
    out = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = load_model(tiny_model_dir)
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * 0.01
        next(iter(model.parameters())).grad.view(-1)[0] = bad
        norm = float(_clip_and_step(model, opt, max_norm))
        assert not np.isfinite(norm) and (np.isnan(norm) == np.isnan(bad))
        assert getattr(opt, "found_inf", None) is None and getattr(opt, "grad_scale", None) is None
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert all(float(st.get("step", 0)) == 0 and not st.get("exp_avg", torch.zeros(1)).any()
                   for st in opt.state.values())
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * 0.01
        assert np.isfinite(float(_clip_and_step(model, opt, max_norm)))
        assert all(float(st["step"]) == 1 for st in opt.state.values())
        out.append([p.detach().clone() for p in model.parameters()])
    w0, w1 = out
    assert any(not torch.equal(a, b) for a, b in zip(w0, before))  # the finite update moved the weights
    for a, b in zip(w0, w1):
        assert torch.allclose(a, b, atol=1e-6)


def test_packed_logprobs_of_unpadded_rows_use_the_dense_layout(tiny_model_dir):
    """Rows of equal length: no padding, attention runs on a view of the packed tokens (no copies)."""
    rows = synthetic_rows(n_groups=2, group_size=2, seed=11, prompt_len=5, max_out=2)  # 7 tokens each
    assert len({r.num_tokens for r in rows}) == 1
    m = collate(rows, list(range(len(rows))), torch.zeros(len(rows)))
    p = pack(m.input_ids, m.attention_mask, m.loss_mask)
    assert p.dense and m.loss_mask.sum() > 4
    model = load_model(tiny_model_dir)
    ref, ref_ent = token_logprobs(model, m.input_ids, m.attention_mask, with_entropy=True)
    logp, ent = packed_logprobs(model, m.input_ids, m.attention_mask, m.loss_mask, with_entropy=True, packed=p)
    mask = m.loss_mask.bool()
    assert torch.allclose(logp[mask], ref[mask], atol=2e-5) and torch.allclose(ent[mask], ref_ent[mask], atol=2e-5)
