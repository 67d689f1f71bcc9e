"""GRPO math as pure functions: advantages, the decoupled PPO loss and loss aggregation.

Everything here takes tensors and returns tensors (plus a metrics dict of Python floats); nothing needs the
training loop's state, so every function is tested directly against hand-computed numbers and slow loops
(``tests/trainer/test_core_algos.py``). Shapes: ``N`` rows, ``B`` rows of one micro-batch, ``T`` tokens
per (padded) row. Variants are chosen by name; an unknown name raises ``ValueError`` listing the valid ones.

Token alignment: ``logprobs[b, t]`` is the log-probability of token ``t`` of row ``b`` given the tokens
before it; the caller shifts the model's logits (see ``trainer.model.token_logprobs``).

Decoupled PPO (three policies): the *behaviour* policy generated the tokens (logprobs recorded by the
engine, possibly several versions old), the *proximal* policy is the trainer's weights at the start of the
step (logprobs recomputed before any update), and the current policy is being optimised. The clipped ratio
is taken against the proximal policy, and the off-policy gap is corrected by the behaviour importance
weight ``exp(prox - behaviour)``; tokens whose weight exceeds a cap are masked out of the loss.
"""

from __future__ import annotations

from typing import Any

import torch

ADV_ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo")
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def _check_name(kind: str, name: str, valid: tuple[str, ...]) -> None:
    if name not in valid:
        raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(valid)}")


# ------------------------------------------------------------------------------------------ advantages


ZERO_VARIANCE_STD = 1e-6  # a group whose reward std is at most this has nothing to learn from


def group_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    session_index: torch.Tensor,
    *,
    estimator: str = "grpo",
    eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group-normalised advantage of every row.

    Args:
        rewards: (N,) float, the reward of each row.
        group_index: (N,) int64, which GRPO group each row belongs to (any integers).
        session_index: (N,) int64, which session each row belongs to. A session with several rows (a tree
            exported as one row per leaf) is counted **once** in its group's mean and std, with the mean of
            its rows' rewards, so branching sessions do not outweigh linear ones.
        estimator: ``"grpo"``: ``(r - mean) / (std + eps)`` with the unbiased std over the group's
            sessions; ``"dr_grpo"``: ``r - mean`` (no std division).
        eps: added to the std.

    Returns:
        advantages: (N,) float32. Rows of a group whose sessions all have the same reward (zero variance:
        std at most ``ZERO_VARIANCE_STD``, including groups of one session) get 0.
        metrics: ``adv/zero_var_groups`` (count), ``adv/groups``, ``adv/mean``, ``adv/std``, ``adv/min``,
        ``adv/max``.
    """
    _check_name("advantage estimator", estimator, ADV_ESTIMATORS)
    if not (rewards.shape == group_index.shape == session_index.shape) or rewards.dim() != 1:
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, group_index {tuple(group_index.shape)} and session_index "
            f"{tuple(session_index.shape)} must all be (N,)"
        )
    rewards = rewards.to(torch.float64)
    n = rewards.shape[0]
    if n == 0:
        return torch.zeros(0), {"adv/groups": 0.0, "adv/zero_var_groups": 0.0}

    # session -> its mean reward and its group (a session belongs to exactly one group)
    sessions, row_session = torch.unique(session_index, return_inverse=True)
    n_sessions = sessions.shape[0]
    rows_per_session = torch.zeros(n_sessions, dtype=torch.float64).index_add_(0, row_session, torch.ones(n, dtype=torch.float64))
    session_reward = torch.zeros(n_sessions, dtype=torch.float64).index_add_(0, row_session, rewards) / rows_per_session
    session_group = torch.zeros(n_sessions, dtype=torch.int64).scatter_(0, row_session, group_index.to(torch.int64))
    if not torch.equal(session_group[row_session], group_index.to(torch.int64)):
        raise ValueError("a session's rows are spread over several groups; every session belongs to one group")

    groups, session_gid = torch.unique(session_group, return_inverse=True)
    n_groups = groups.shape[0]
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, session_gid, torch.ones(n_sessions, dtype=torch.float64))
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, session_gid, session_reward) / count
    sq_dev = (session_reward - mean[session_gid]) ** 2
    var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, session_gid, sq_dev) / (count - 1).clamp(min=1)
    std = var.sqrt()
    zero_var = (count < 2) | (std <= ZERO_VARIANCE_STD)  # 1e-9 apart is noise, not a signal to scale by 1e9

    row_gid = session_gid[row_session]
    centred = rewards - mean[row_gid]
    if estimator == "grpo":
        adv = centred / (std[row_gid] + eps)
    else:
        adv = centred
    adv = torch.where(zero_var[row_gid], torch.zeros_like(adv), adv).to(torch.float32)
    metrics = {
        "adv/groups": float(n_groups),
        "adv/zero_var_groups": float(zero_var.sum()),
        "adv/mean": float(adv.mean()),
        "adv/std": float(adv.std()) if n > 1 else 0.0,
        "adv/min": float(adv.min()),
        "adv/max": float(adv.max()),
    }
    return adv, metrics


def episode_weights(session_index: torch.Tensor) -> torch.Tensor:
    """(N,) float32 weight of each row in the loss: 1 / the number of rows of its episode (session).

    An episode is the unit GRPO samples and rewards; a coding agent's episode exports one row per thread or
    compacted segment (and a tree one row per leaf), all with the episode's one advantage. Those rows are
    parts of one sample, not more samples: weighted so, an episode's rows together count as one row does,
    whatever the number of its threads, and an episode of one row (a linear conversation) weighs exactly
    what it weighed before. The trainer multiplies each row's advantage by its weight (the PPO objective
    is linear in the advantage: for ``w > 0``, ``max(-wA r, -wA clip(r)) = w max(-A r, -A clip(r))``) and
    normalises by the weighted counts (:func:`weighted_counts`): with ``seq-mean-*`` every episode counts
    once; with ``token-mean`` the loss is the token mean with each token weighed by its row's weight.
    """
    if session_index.dim() != 1:
        raise ValueError(f"session_index {tuple(session_index.shape)} must be (N,)")
    if session_index.numel() == 0:
        return torch.zeros(0)
    _, row_session, counts = torch.unique(session_index, return_inverse=True, return_counts=True)
    return (1.0 / counts.to(torch.float64))[row_session].to(torch.float32)


def weighted_counts(weights: torch.Tensor, loss_tokens: torch.Tensor) -> tuple[float, float]:
    """``(global_tokens, global_seqs)`` for :func:`aggregate_loss` of rows weighted by ``weights``: the
    weighted sum of their loss tokens and the sum of the weights (the number of episodes when the rows of
    each episode are all there)."""
    w = weights.to(torch.float64)
    return float((w * loss_tokens.to(torch.float64)).sum()), float(w.sum())


# ---------------------------------------------------------------------------------------------- losses


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_tokens: float,
    global_seqs: float,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar whose sum over micro-batches does not depend on the split.

    Args:
        loss_mat: (B, T) per-token loss.
        mask: (B, T) 1 where the token counts.
        mode: ``"token-mean"``: ``sum(loss * mask) / global_tokens`` (every token of the whole batch weighs
            the same); ``"seq-mean-token-sum"``: ``sum_b(sum_t loss * mask) / global_seqs``;
            ``"seq-mean-token-mean"``: ``sum_b(mean_t over the row's own tokens) / global_seqs``.
        global_tokens: number of loss tokens in the **whole** batch (all micro-batches, all ranks).
        global_seqs: number of rows in the whole batch.

    Normalising by batch-wide counts, not per micro-batch ones, is what makes the sum of the micro-batch
    losses equal the loss of the batch in one piece.
    """
    _check_name("loss aggregation mode", mode, LOSS_AGG_MODES)
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * mask).sum() / max(global_tokens, 1.0)
    per_seq = (loss_mat * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1.0)
    return per_seq.sum() / max(global_seqs, 1.0)


def ppo_loss(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    is_cap: float | None,
    agg_mode: str = "token-mean",
    global_tokens: float,
    global_seqs: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled, clipped PPO policy-gradient loss.

    Args:
        logprobs: (B, T) logprobs under the current weights (with grad).
        prox_logprobs: (B, T) logprobs under the weights at the start of the step (no grad).
        behaviour_logprobs: (B, T) logprobs the engine reported when it generated the tokens.
        advantages: (B, T) per-token advantages (the row's advantage broadcast over its tokens).
        mask: (B, T) 1 on tokens that are trained on (generated tokens).
        clip_low, clip_high: ratio clipped to ``[1 - clip_low, 1 + clip_high]``.
        is_cap: tokens whose behaviour importance weight ``exp(prox - behaviour)`` exceeds this are masked
            out of the loss (``None``: no cap).
        agg_mode, global_tokens, global_seqs: see :func:`aggregate_loss`.

    Per token: ``ratio = exp(logp - prox)``, ``pg = max(-A * ratio, -A * clip(ratio))``,
    ``loss = w * pg`` with ``w = exp(prox - behaviour)`` (detached).

    Returns:
        loss: scalar, this micro-batch's share of the batch loss.
        stats: per-micro-batch **sums** (tensors, detached) so that the caller can add them over micro-batches
        and ranks before dividing: ``tokens``, ``clipped`` (tokens where the clipped branch was taken),
        ``capped`` (tokens masked by the cap), ``is_weight_sum``, ``is_weight_max``, ``ratio_sum``.
    """
    mask_f = mask.to(logprobs.dtype)
    log_ratio = (logprobs - prox_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * clipped_ratio
    pg = torch.maximum(pg_unclipped, pg_clipped)

    is_weight = torch.exp((prox_logprobs - behaviour_logprobs).clamp(-20.0, 20.0)).detach()
    keep = mask_f
    capped = torch.zeros_like(mask_f)
    if is_cap is not None:
        over = (is_weight > is_cap).to(mask_f.dtype) * mask_f
        capped = over
        keep = mask_f - over
    loss_mat = pg * is_weight
    loss = aggregate_loss(loss_mat, keep, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs)

    with torch.no_grad():
        took_clip = (pg_clipped > pg_unclipped).to(mask_f.dtype) * keep
        stats = {
            "tokens": mask_f.sum(),
            "clipped": took_clip.sum(),
            "capped": capped.sum(),
            "is_weight_sum": (is_weight * mask_f).sum(),
            "is_weight_max": (is_weight * mask_f).max() if mask_f.numel() else torch.tensor(0.0),
            "ratio_sum": (ratio.detach() * mask_f).sum(),
        }
    return loss, stats


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits -> (B, T) entropy of the next-token distribution (float32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1 (0 when nothing is masked in). Shapes must broadcast."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def token_advantages(row_advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) row advantages, (B, T) mask -> (B, T) advantages on masked-in tokens, 0 elsewhere."""
    return row_advantages[:, None].to(torch.float32) * mask.to(torch.float32)


def summarise_stats(stats: dict[str, float]) -> dict[str, Any]:
    """Turn summed micro-batch stats (see :func:`ppo_loss`) into the logged fractions and means."""
    tokens = max(stats.get("tokens", 0.0), 1.0)
    return {
        "actor/clip_frac": stats.get("clipped", 0.0) / tokens,
        "actor/capped_frac": stats.get("capped", 0.0) / tokens,
        "actor/is_weight_mean": stats.get("is_weight_sum", 0.0) / tokens,
        "actor/is_weight_max": stats.get("is_weight_max", 0.0),
        "actor/ratio_mean": stats.get("ratio_sum", 0.0) / tokens,
    }
