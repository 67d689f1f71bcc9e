"""One GRPO step of the tiny model (CPU) over coding agents' rows.

Over a replayed run: a Claude Code run whose main agent delegated to a sub-agent (two rows, reward 1) and
the same run rewarded 0 (one of its rows only), one group. Each episode gets one advantage and weighs as
one (``core_algos.episode_weights``), and the step trains on every row.

Over the real CLI's own rows: Claude Code 2.1.197 (npm, as in ``test_real_clis.py``) run twice as one group
by ``agentrl group`` through the gateway on a real socket, rewarded by a check of the file its sub-agent
wrote (``POST /reward``: 1 and 0), the group leased from ``GET /v1/trajectories`` as the trainer leases it,
and one ``train_step`` over exactly those rows. The CLI runs with its own tool set cut to ``Bash`` and
``Agent`` and a one-line system prompt (``--tools``, ``--system-prompt``): its default prompt and tools
make a row of some 12,500 tokens (12,550 measured for the main thread), whose 49,152-way logits, their
softmax and gradients take some 10 GB on a CPU; cut, the rows are about 2,200 to 2,700 tokens. The
requests, headers and linking are still the CLI's own.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from agentrl.settings import load
from agentrl.trajectory import decode_batch, export_session, turn_from_interaction
from gateway.episodes import table
from tests.gateway.episodes.clis import claude_command, clis_or_skip, run_group, served
from tests.gateway.episodes.conftest import ADMIN, AGENT
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


SMALL = ("--tools", "Bash", "Agent", "--system-prompt", "You are a coding agent. Use your tools to do the task.")


async def test_one_step_over_a_real_claude_code_group(tiny_model_dir: Path, tokenizer: Any, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    clis = await clis_or_skip()
    async with served(tiny_model_dir, tokenizer, tmp_path) as (base, app, _):
        status, attempts, summary = await run_group(base, capsys, 2, "grep -qx hi hello.txt && echo 1 || echo 0",
                                                    claude_command(clis["claude"], *SMALL))
        logs = Path(summary["attempts_dir"])
        assert status == 0, [(a, (logs / f"attempt-{a['index']}.log").read_text()[-2000:]) for a in attempts]
        rewards = {a["session_id"]: a["reward"] for a in attempts}
        assert sorted(rewards.values()) == [0.0, 1.0]  # the sub-agent wrote hi once, bye once
        store = app.state.services.store
        sub_threads = {}
        for sid in rewards:
            threads = await table.session_threads(store, sid)
            assert sorted((r.kind, r.edge, r.status) for r in threads) == \
                [("main", None, "root"), ("subagent", "spawned_by", "confirmed")]
            sub_threads[sid] = {r.thread for r in threads if r.kind == "subagent"}
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            resp = await http.get("/v1/trajectories", params={"max_groups": 1, "wait_s": 30},
                                  headers={"Authorization": f"Bearer {ADMIN}"})
        assert resp.status_code == 200, resp.text
        batch, meta = decode_batch(resp.content)
        assert meta["groups"][0]["complete"] is True and {r.session_id for r in batch} == set(rewards)
        # every row is the recorded turns, token for token: the leaf's full sequence, and on each trained
        # turn's tokens that turn's own output ids and behaviour logprobs; every row has the episode's reward
        on_sub = []
        for row in batch:
            assert row.reward == rewards[row.session_id]
            assert row.input_ids.tolist() == await store.full_sequence(interaction_id=row.leaf_id)
            assert row.turn_interaction_ids and row.loss_mask.sum() > 0
            for k, iid in enumerate(row.turn_interaction_ids):
                turn = await store.get_interaction(interaction_id=iid)
                mine = row.turn_ids == k
                assert row.input_ids[mine].tolist() == list(turn.output_ids)
                np.testing.assert_array_equal(row.logprobs[mine], np.asarray(turn.output_logprobs, np.float32))
            leaf = await store.get_interaction(interaction_id=row.leaf_id)
            if leaf.request["episode"]["thread"] in sub_threads[row.session_id]:
                on_sub.append(row)
        assert sorted(r.session_id for r in on_sub) == sorted(rewards)  # each episode's sub-agent: one row
        assert len(batch) > len(on_sub)  # and its main thread
        assert all(r.reward == rewards[r.session_id] for r in on_sub)
        lengths = sorted(r.num_tokens for r in batch)
    # each episode weighs as one in the loss, whatever its number of rows
    sessions = [r.session_id for r in batch]
    weights = core_algos.episode_weights(torch.tensor([sorted(rewards).index(s) for s in sessions]))
    assert weights.tolist() == pytest.approx([1 / sessions.count(s) for s in sessions])
    config = settings(tmp_path)
    adv, _ = advantages_for(batch, config)  # one advantage per episode, the rewarded one's above zero
    by_episode = {s: {float(a) for a, t in zip(adv, sessions) if t == s} for s in rewards}
    assert all(len(got) == 1 for got in by_episode.values())
    assert [next(iter(by_episode[s])) > 0 for s in rewards] == [rewards[s] == 1.0 for s in rewards]
    model = load_model(tiny_model_dir)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    metrics = train_step(model, opt, batch, config, init_distributed("cpu"), version=0)
    assert metrics["batch/rows"] == len(batch), (metrics, lengths)
    assert math.isfinite(metrics["actor/loss"]) and metrics["actor/grad_norm"] > 0.0
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
    shutil.rmtree(logs)
