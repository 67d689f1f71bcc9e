"""The GRPO math, twice: hand-computed numbers on tiny tensors, and slow loops against the vectorised code."""

from __future__ import annotations

import math

import pytest
import torch

from trainer import core_algos as ca


# ------------------------------------------------------------------------------------------ advantages


def test_group_advantages_hand_computed_each_session_once():
    # group 0: sessions a (1.0), b (0.0), c with two rows (1.0, 1.0); group 1: two sessions with 0.5 (zero
    # variance); group 2: a single session (zero variance).
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 3.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    sessions = torch.tensor([10, 11, 12, 12, 20, 21, 30])
    adv, metrics = ca.group_advantages(rewards, groups, sessions, eps=0.0)
    # sessions of group 0 counted once: mean 2/3, unbiased std sqrt(1/3)
    std = math.sqrt(1 / 3)
    expected = [(1 / 3) / std, (-2 / 3) / std, (1 / 3) / std, (1 / 3) / std, 0.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert metrics["adv/zero_var_groups"] == 2
    assert metrics["adv/groups"] == 3
    # counting rows instead of sessions would have given mean 0.75: make sure we are not doing that
    assert adv[1].item() == pytest.approx(-1.1547005, abs=1e-6)


def test_tiny_reward_spread_is_zero_variance():
    """Rewards 1e-9 apart are noise: dividing by their std gave advantages near +-0.7 (1e-9 / 1.4e-9)."""
    rewards = torch.tensor([1.0, 1.0 + 1e-9, 1.0, 1.0 + 1e-9], dtype=torch.float64)
    adv, metrics = ca.group_advantages(rewards, torch.zeros(4, dtype=torch.int64), torch.arange(4))
    assert adv.abs().max().item() == 0.0 and metrics["adv/zero_var_groups"] == 1.0
    adv, _ = ca.group_advantages(torch.tensor([0.0, 1e-3, 0.0, 1e-3]), torch.zeros(4, dtype=torch.int64),
                                 torch.arange(4))
    assert adv.abs().min().item() > 0.5  # a small but real spread still counts


def test_dr_grpo_does_not_divide_by_std():
    adv, _ = ca.group_advantages(torch.tensor([2.0, 0.0, 1.0]), torch.zeros(3, dtype=torch.long),
                                 torch.arange(3), estimator="dr_grpo")
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0])


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError, match="grpo, dr_grpo"):
        ca.group_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.arange(2), estimator="ppo")


def test_session_in_two_groups_is_refused():
    with pytest.raises(ValueError, match="one group"):
        ca.group_advantages(torch.zeros(2), torch.tensor([0, 1]), torch.tensor([5, 5]))


def _slow_advantages(rewards, groups, sessions, estimator, eps):
    rewards, groups, sessions = rewards.tolist(), groups.tolist(), sessions.tolist()
    session_rewards: dict[int, list[float]] = {}
    session_group: dict[int, int] = {}
    for r, g, s in zip(rewards, groups, sessions):
        session_rewards.setdefault(s, []).append(r)
        session_group[s] = g
    out = []
    for r, g, s in zip(rewards, groups, sessions):
        vals = [sum(v) / len(v) for sid, v in session_rewards.items() if session_group[sid] == g]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
        if len(vals) < 2 or std == 0.0:
            out.append(0.0)
        elif estimator == "grpo":
            out.append((r - mean) / (std + eps))
        else:
            out.append(r - mean)
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("estimator", ca.ADV_ESTIMATORS)
def test_advantages_match_slow_loop(seed, estimator):
    g = torch.Generator().manual_seed(seed)
    n_groups = 4
    sessions, groups = [], []
    sid = 0
    for grp in range(n_groups):
        for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
            for _ in range(int(torch.randint(1, 3, (1,), generator=g))):  # rows per session
                sessions.append(sid)
                groups.append(grp * 7)
            sid += 1
    n = len(sessions)
    rewards = torch.randint(0, 3, (n,), generator=g).double() / 2
    # rows of a session share its reward (as the concat export gives them)
    sess_reward = {s: float(rewards[i]) for i, s in enumerate(sessions)}
    rewards = torch.tensor([sess_reward[s] for s in sessions])
    perm = torch.randperm(n, generator=g)
    rewards, groups_t, sessions_t = rewards[perm], torch.tensor(groups)[perm], torch.tensor(sessions)[perm]
    adv, _ = ca.group_advantages(rewards, groups_t, sessions_t, estimator=estimator, eps=1e-6)
    assert adv.tolist() == pytest.approx(_slow_advantages(rewards, groups_t, sessions_t, estimator, 1e-6), abs=1e-5)


# ---------------------------------------------------------------------------------------------- losses


def _hand_batch():
    prox = torch.zeros(1, 5)
    logp = torch.tensor([[math.log(1.5), math.log(0.5), math.log(0.5), 0.0, 7.0]], requires_grad=True)
    behaviour = torch.tensor([[0.0, -math.log(2.0), 0.0, -math.log(4.0), 3.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    return logp, prox, behaviour, adv, mask


def test_ppo_loss_hand_computed():
    logp, prox, behaviour, adv, mask = _hand_batch()
    loss, stats = ca.ppo_loss(logp, prox, behaviour, adv, mask, clip_low=0.2, clip_high=0.2, is_cap=3.0,
                              global_tokens=4, global_seqs=1)
    # token 0: ratio 1.5, A=1 -> clipped to 1.2 -> -1.2, w=1
    # token 1: ratio 0.5, A=1 -> unclipped -0.5 (> -0.8), w=2 -> -1.0
    # token 2: ratio 0.5, A=-1 -> clipped 0.8 (> 0.5), w=1 -> 0.8
    # token 3: w=4 > cap 3 -> masked; token 4: loss mask 0
    assert loss.item() == pytest.approx((-1.2 - 1.0 + 0.8) / 4, abs=1e-6)
    assert stats["clipped"].item() == 2
    assert stats["capped"].item() == 1
    assert stats["tokens"].item() == 4
    assert stats["is_weight_max"].item() == pytest.approx(4.0)
    loss.backward()
    # d/dlogp: clipped tokens have no gradient; token 1: w * -A * ratio / N = 2 * -1 * 0.5 / 4
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -0.25, 0.0, 0.0, 0.0], abs=1e-6)


def test_ppo_loss_without_cap_keeps_heavy_tokens():
    logp, prox, behaviour, adv, mask = _hand_batch()
    loss, stats = ca.ppo_loss(logp, prox, behaviour, adv, mask, clip_low=0.2, clip_high=0.2, is_cap=None,
                              global_tokens=4, global_seqs=1)
    assert stats["capped"].item() == 0
    assert loss.item() == pytest.approx((-1.2 - 1.0 + 0.8 - 4.0) / 4, abs=1e-6)


def test_aggregation_modes_hand_computed():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert ca.aggregate_loss(loss_mat, mask, "token-mean", global_tokens=3, global_seqs=2).item() == pytest.approx(7 / 3)
    assert ca.aggregate_loss(loss_mat, mask, "seq-mean-token-sum", global_tokens=3, global_seqs=2).item() == pytest.approx(3.5)
    assert ca.aggregate_loss(loss_mat, mask, "seq-mean-token-mean", global_tokens=3, global_seqs=2).item() == pytest.approx((1.5 + 4) / 2)
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-sum, seq-mean-token-mean"):
        ca.aggregate_loss(loss_mat, mask, "mean", global_tokens=3, global_seqs=2)


def _slow_ppo_loss(logp, prox, behaviour, adv, mask, clip, cap, n_tokens):
    total = 0.0
    for b in range(len(logp)):
        for t in range(len(logp[0])):
            if not mask[b][t]:
                continue
            w = math.exp(prox[b][t] - behaviour[b][t])
            if cap is not None and w > cap:
                continue
            ratio = math.exp(logp[b][t] - prox[b][t])
            a = adv[b][t]
            total += w * max(-a * ratio, -a * min(max(ratio, 1 - clip), 1 + clip))
    return total / n_tokens


def _random_batch(seed, b=5, t=9):
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(b, t, generator=g) * 3
    logp = prox + torch.randn(b, t, generator=g) * 0.3
    behaviour = prox + torch.randn(b, t, generator=g) * 0.5
    adv = torch.randn(b, generator=g)[:, None].expand(b, t).clone()
    mask = (torch.rand(b, t, generator=g) > 0.3).long()
    return logp, prox, behaviour, adv, mask


@pytest.mark.parametrize("seed", range(8))
def test_ppo_loss_matches_slow_loop(seed):
    logp, prox, behaviour, adv, mask = _random_batch(seed)
    n = float(mask.sum())
    loss, _ = ca.ppo_loss(logp, prox, behaviour, adv, mask, clip_low=0.2, clip_high=0.2, is_cap=2.0,
                          global_tokens=n, global_seqs=5)
    slow = _slow_ppo_loss(logp.tolist(), prox.tolist(), behaviour.tolist(), adv.tolist(), mask.tolist(), 0.2, 2.0, n)
    assert loss.item() == pytest.approx(slow, abs=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_masked_positions_do_not_change_the_loss(seed):
    logp, prox, behaviour, adv, mask = _random_batch(seed)
    kw = dict(clip_low=0.2, clip_high=0.28, is_cap=2.0, global_tokens=float(mask.sum()), global_seqs=5)
    logp1 = logp.clone().requires_grad_(True)
    loss1, _ = ca.ppo_loss(logp1, prox, behaviour, adv, mask, **kw)
    loss1.backward()
    off = mask == 0
    noise = torch.randn(logp.shape, generator=torch.Generator().manual_seed(99)) * 5
    logp2 = torch.where(off, logp + noise, logp).requires_grad_(True)
    loss2, _ = ca.ppo_loss(logp2, torch.where(off, prox - noise, prox), torch.where(off, behaviour + noise, behaviour),
                           torch.where(off, adv * 100, adv), mask, **kw)
    loss2.backward()
    assert loss2.item() == pytest.approx(loss1.item(), abs=1e-6)
    assert torch.all(logp2.grad[off] == 0)
    assert torch.allclose(logp1.grad, logp2.grad, atol=1e-7)


@pytest.mark.parametrize("mode", ca.LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", range(3))
def test_loss_and_gradient_do_not_depend_on_micro_batch_split(mode, seed):
    logp, prox, behaviour, adv, mask = _random_batch(seed, b=6)
    kw = dict(clip_low=0.2, clip_high=0.2, is_cap=3.0, agg_mode=mode, global_tokens=float(mask.sum()), global_seqs=6)
    whole = logp.clone().requires_grad_(True)
    loss_whole, _ = ca.ppo_loss(whole, prox, behaviour, adv, mask, **kw)
    loss_whole.backward()

    split = logp.clone().requires_grad_(True)
    total = 0.0
    for rows in ([0], [1, 2, 3], [4, 5]):
        # micro-batches may also be padded to different lengths: cut trailing columns where possible
        part, _ = ca.ppo_loss(split[rows], prox[rows], behaviour[rows], adv[rows], mask[rows], **kw)
        part.backward()
        total += part.item()
    assert total == pytest.approx(loss_whole.item(), abs=1e-6)
    assert torch.allclose(split.grad, whole.grad, atol=1e-7)


def test_token_advantages_and_masked_mean():
    adv = ca.token_advantages(torch.tensor([2.0, -1.0]), torch.tensor([[0, 1, 1], [1, 0, 0]]))
    assert adv.tolist() == [[0.0, 2.0, 2.0], [-1.0, 0.0, 0.0]]
    assert ca.masked_mean(torch.tensor([1.0, 5.0, 3.0]), torch.tensor([1, 0, 1])).item() == 2.0


def test_entropy_of_uniform_and_peaked():
    logits = torch.zeros(1, 1, 4)
    assert ca.token_entropy(logits).item() == pytest.approx(math.log(4))
    peaked = torch.tensor([[[100.0, 0.0, 0.0]]])
    assert ca.token_entropy(peaked).item() == pytest.approx(0.0, abs=1e-6)
