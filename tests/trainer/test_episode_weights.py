"""Episodes, not rows, weigh in the loss (``core_algos.episode_weights``), with hand-computed numbers.

The batch: episode E1 is one row (session 7); episode E2 is a coding agent's run exported as two rows, its
main thread and a sub-agent (session 9), both with E2's one advantage. Row 0 has advantage 0.5 on 2
generated tokens; rows 1 and 2 have -1 on 1 and 3 tokens. Ratio and importance weight are 1 (all
logprobs 0), so each token's PPO term is ``-w * A``.
"""

from __future__ import annotations

import pytest
import torch

from trainer import core_algos

SESSIONS = torch.tensor([7, 9, 9])
ADV = torch.tensor([0.5, -1.0, -1.0])
TOKENS = [2, 1, 3]


def loss(mode: str, weighted: bool) -> float:
    mask = torch.zeros(3, 3)
    for b, n in enumerate(TOKENS):
        mask[b, :n] = 1
    w = core_algos.episode_weights(SESSIONS) if weighted else torch.ones(3)
    tokens, seqs = core_algos.weighted_counts(w, torch.tensor([float(n) for n in TOKENS]))
    zeros = torch.zeros(3, 3)
    out, _ = core_algos.ppo_loss(zeros, zeros, zeros, core_algos.token_advantages(ADV * w, mask), mask,
                                 clip_low=0.2, clip_high=0.2, is_cap=None, agg_mode=mode,
                                 global_tokens=tokens, global_seqs=seqs)
    return float(out)


def test_weights_are_one_over_the_episode_rows() -> None:
    w = core_algos.episode_weights(torch.tensor([7, 9, 9, 4, 9]))
    assert w.tolist() == pytest.approx([1.0, 1 / 3, 1 / 3, 1.0, 1 / 3])
    # weighted tokens and the number of episodes
    assert core_algos.weighted_counts(w, torch.tensor([2.0, 3.0, 3.0, 1.0, 3.0])) == pytest.approx((6.0, 3.0))
    assert core_algos.episode_weights(torch.zeros(0, dtype=torch.int64)).numel() == 0


def test_seq_mean_modes_count_each_episode_once() -> None:
    # token sums: E1 = -0.5 * 2 = -1; E2 = mean of its rows' (1 * 1, 1 * 3) = 2 -> (-1 + 2) / 2 episodes
    assert loss("seq-mean-token-sum", True) == pytest.approx(0.5)
    # row token means: E1 = -0.5; E2 = mean(1, 1) = 1 -> (-0.5 + 1) / 2
    assert loss("seq-mean-token-mean", True) == pytest.approx(0.25)
    # unweighted, E2 counted twice: (-1 + 1 + 3) / 3 rows and (-0.5 + 1 + 1) / 3
    assert loss("seq-mean-token-sum", False) == pytest.approx(1.0)
    assert loss("seq-mean-token-mean", False) == pytest.approx(0.5)


def test_token_mean_weighs_each_token_by_its_row() -> None:
    # (1 * -0.5 * 2 + 0.5 * 1 * 1 + 0.5 * 1 * 3) / (2 + 0.5 + 1.5)
    assert loss("token-mean", True) == pytest.approx(0.25)
    assert loss("token-mean", False) == pytest.approx((-1 + 1 + 3) / 6)


def test_one_row_episodes_are_unchanged() -> None:
    sessions = torch.tensor([1, 2, 3])
    assert core_algos.episode_weights(sessions).tolist() == [1.0, 1.0, 1.0]


def test_rows_of_one_episode_get_one_advantage() -> None:
    """Rows exported with the episode's reward (``agentrl.trajectory.episode_reward``) are one session in
    the group's statistics and get one advantage: group {E1: 1.0, E2: 0.0 on two rows, E3: 0.5}."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5])
    adv, _ = core_algos.group_advantages(rewards, torch.zeros(4, dtype=torch.int64), torch.tensor([1, 2, 2, 3]))
    # sessions' rewards 1, 0, 0.5: mean 0.5, unbiased std 0.5
    assert adv.tolist() == pytest.approx([1.0, -1.0, -1.0, 0.0], abs=1e-5)
