"""Defaults that several processes must agree on, in one place.

`agentrl up`, `agentrl train`, `agentrl gateway` and the agent runner read their defaults from here, so a
setting left alone means the same thing everywhere. At run time the trainer is the source of truth for
group size and staleness bound (it tells the gateway, ``POST /admin/trainer``) and the gateway for gamma
(the trainer keeps the returns it exports unless given its own ``--gamma``).
"""

from __future__ import annotations

LR = 1e-5  # AdamW learning rate (SmolLM2-135M learns visibly in a few steps at this rate)
GAMMA = 0.9  # discount along each root-to-leaf path: a later turn's reward counts for less at turn 1
GROUP_SIZE = 4  # sessions per GRPO group
BATCH_GROUPS = 4  # groups per trainer step
STALENESS_BOUND = 1  # k: data may be at most k weight versions older than the trainer
KEEP_CHECKPOINTS = 2  # checkpoints kept on disk (the newest K); 0 keeps every one
