"""One GRPO step of the tiny model over the rows of replayed agent runs: a Claude Code run whose main agent
delegated to a sub-agent (two rows, reward 1) and the same run rewarded 0 (one of its rows only), one
group. Each episode gets one advantage and weighs as one (``core_algos.episode_weights``), and the step
trains on every row."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from agentrl.settings import load
from agentrl.trajectory import export_session, turn_from_interaction
from tests.gateway.episodes.conftest import AGENT
from tests.gateway.episodes.replay import Replayer, scripted_replies
from tests.gateway.episodes.replay import load as load_capture
from trainer import core_algos
from trainer.config import TrainerSettings
from trainer.model import init_distributed, load_model
from trainer.step import advantages_for, train_step


def settings(tmp_path: Path) -> TrainerSettings:
    return load(TrainerSettings, env={}, gateway="http://gw", admin_key="k", model="tiny", sync_mode="none",
                checkpoint_dir=str(tmp_path / "ckpt"), lr=1e-3, group_size=2, batch_groups=1,
                micro_batch_tokens=8192)


async def test_one_step_over_two_threaded_episodes(episode_gw: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    rows = load_capture("A1_claude_subagent.jsonl")
    exported = []
    async with episode_gw(scripted_replies(rows)) as gw:
        player = Replayer(gw.http, AGENT, rows)
        await player.run()
        sid = (await gw.store.get_interaction(interaction_id=player.answers[0])).session_id
        turns = [turn_from_interaction(t) for t in await gw.store.session_interactions(session_id=sid)]
    for reward in (1.0, 0.0):  # the run as two attempts of one group, one succeeded
        got = export_session(turns, gamma=0.9, session_reward=reward, session_id=f"{sid}-{reward}", group_id="g")
        for row in got:
            row.group_key = "g"
        exported += got
    exported.pop()  # the failed attempt without its last row: episodes of 2 rows and of 1, unlike tokens
    assert [r.reward for r in exported] == [1.0, 1.0, 0.0]
    config = settings(tmp_path)
    adv, _ = advantages_for(exported, config)
    # one advantage per episode: +1/-1 scaled by the group's std (two sessions, rewards 1 and 0)
    assert adv[0] == adv[1] > 0 > adv[2]
    weights = core_algos.episode_weights(torch.tensor([0, 0, 1]))
    assert weights.tolist() == [0.5, 0.5, 1.0]
    model = load_model(tiny_model_dir)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    metrics = train_step(model, opt, exported, config, init_distributed("cpu"), version=0)
    assert math.isfinite(metrics["actor/loss"]) and metrics["actor/grad_norm"] > 0.0
    assert metrics["batch/rows"] == 3
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
