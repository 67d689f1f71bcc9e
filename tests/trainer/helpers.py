"""Synthetic batches for trainer tests: rows built with agentrl.trajectory from random tokens."""

from __future__ import annotations

import numpy as np

from agentrl.trajectory import Row


def synthetic_rows(n_groups: int = 3, group_size: int = 3, *, seed: int = 0, vocab: int = 1000,
                   prompt_len: int = 6, max_out: int = 10) -> list[Row]:
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(n_groups):
        prompt = rng.integers(5, vocab, prompt_len)
        for s in range(group_size):
            n_out = int(rng.integers(2, max_out + 1))
            out = rng.integers(5, vocab, n_out)
            ids = np.concatenate([prompt, out]).astype(np.int32)
            mask = np.r_[np.zeros(prompt_len), np.ones(n_out)].astype(np.int8)
            logprobs = np.where(mask == 1, -rng.uniform(5, 9, len(ids)), 0).astype(np.float32)
            reward = float(rng.integers(0, 2))
            rows.append(Row(
                input_ids=ids, loss_mask=mask, logprobs=logprobs,
                versions=np.where(mask == 1, 0, -1).astype(np.int32),
                turn_ids=np.where(mask == 1, 0, -1).astype(np.int32),
                turn_rewards=np.array([reward]), turn_returns=np.array([reward]), reward=reward,
                is_truncated=False, session_id=f"s{g}-{s}", group_id=f"g{g}", leaf_id=f"l{g}-{s}",
                row_id=f"r{g}-{s}-{seed}", task_id=None,
            ))
    return rows


def full(t):
    """The whole tensor: gathered from an FSDP2 shard (several ranks, or ``fsdp=True``) or as it is (one rank)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
