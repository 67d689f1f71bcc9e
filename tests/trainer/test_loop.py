"""The loop against a gateway faked at the HTTP boundary: acks, duplicates, checkpoints, resume, refusal."""

from __future__ import annotations

import json
import math

import httpx
import numpy as np
import pytest
import torch

from agentrl.settings import load
from agentrl.trajectory import encode_batch
from tests.trainer.helpers import full, synthetic_rows
from trainer import checkpoint
from trainer.config import TrainerSettings
from trainer.loop import train
from trainer.weight_sync import WeightSyncError


class FakeGateway:
    """Serves the given batches in order (then 204), records acks and admin calls; its one engine
    (http://engine) refuses weight updates when ``refuse`` is set."""

    def __init__(self, batches, refuse: bool = False):
        self.batches = list(batches)
        self.acked: list[str] = []
        self.admin: list[tuple[str, dict]] = []
        self.refuse = refuse
        self.n = 0

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == "engine":
            self.admin.append((request.url.path, json.loads(request.content or b"{}")))
            if self.refuse:
                return httpx.Response(400, json={"success": False, "message": "shape mismatch for lm_head"})
            return httpx.Response(200, json={"success": True, "message": "ok"})
        if request.url.path.startswith("/admin/"):
            assert request.headers["authorization"] == "Bearer k"
            self.admin.append((request.url.path, json.loads(request.content or b"{}")))
            if request.url.path == "/admin/engines":
                return httpx.Response(200, json={"engines": [{"url": "http://engine", "healthy": True}]})
            return httpx.Response(200, json={})
        if request.url.path == "/v1/trajectories":
            if not self.batches:
                return httpx.Response(204)
            self.n += 1
            rows = self.batches.pop(0)
            return httpx.Response(200, content=encode_batch(rows, {"lease_id": f"lease-{self.n}"}))
        if request.url.path == "/v1/trajectories/ack":
            self.acked.append(json.loads(request.content)["lease_id"])
            return httpx.Response(200, json={})
        return httpx.Response(404)

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(self.handler))


def _settings(tmp_path, **kw):
    base = dict(gateway="http://gw", admin_key="k", model="tiny", sync_mode="none", checkpoint_dir=str(tmp_path / "ckpt"),
                lr=1e-3, group_size=3, batch_groups=2, micro_batch_tokens=4096, lease_wait_s=0.01, max_idle_s=0.05)
    return load(TrainerSettings, env={}, **{**base, **kw})


@pytest.mark.slow
def test_train_acks_checkpoints_and_resume_continues_the_version(tmp_path, dist_info, tiny_model_dir):
    first, second = synthetic_rows(2, 3, seed=1), synthetic_rows(2, 3, seed=2)
    gw = FakeGateway([first, second])
    state = train(_settings(tmp_path, steps=2, save_every=1), http=gw.client())
    assert (state.step, state.version) == (2, 2)
    assert gw.acked == ["lease-1", "lease-2"]
    ckpt = checkpoint.latest(tmp_path / "ckpt")
    assert ckpt.name == "step_000002"
    assert json.loads((ckpt / "trainer_state.json").read_text())["version"] == 2
    lines = (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines]
    assert [m["version"] for m in metrics] == [1, 2]
    for key in ("reward/mean", "adv/std", "actor/clip_frac", "actor/is_weight_mean", "actor/entropy",
                "logprob_gap/mean", "perf/tokens_per_s", "adv/zero_var_groups"):
        assert key in metrics[0]

    # the checkpoint is a Hugging Face directory; the optimizer state comes back with it
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(hf.model.embed_tokens.weight, base.model.embed_tokens.weight)

    # resume: a re-delivered batch (the last one, as if its ack had been lost) is acked without training;
    # a new batch continues the version count from 2
    third = synthetic_rows(2, 3, seed=3)
    gw2 = FakeGateway([second, third])
    state = train(_settings(tmp_path, steps=1), http=gw2.client())  # --steps: steps to run now
    assert (state.step, state.version) == (3, 3)
    assert gw2.acked == ["lease-1", "lease-2"]
    metrics = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == [1, 2, 3]
    assert metrics[-1]["batch/rows"] == 6


def test_checkpoint_round_trip_restores_optimizer(tmp_path, dist_info, tiny_model_dir):
    from trainer.model import load_model
    from trainer.step import train_step

    model = load_model(tiny_model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    settings = _settings(tmp_path)
    train_step(model, opt, synthetic_rows(2, 3), settings, dist_info, version=0)
    state = checkpoint.TrainerState(step=1, version=1, seen_rows=["a"])
    path = checkpoint.save(tmp_path / "c", state, model, opt, dist_info, source_dir=tiny_model_dir)
    assert (path / "tokenizer.json").exists() and (path / "config.json").exists()

    model2 = load_model(path)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    checkpoint.load_optimizer(path, model2, opt2)
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), model2.named_parameters()):
        assert n1 == n2 and torch.equal(full(p1), full(p2))
        s1, s2 = opt.state[p1], opt2.state[p2]
        assert torch.equal(full(s1["exp_avg"]), full(s2["exp_avg"]))
    assert checkpoint.load_state(path) == state


def test_refused_push_stops_the_trainer_without_acking(tmp_path, dist_info):
    gw = FakeGateway([synthetic_rows(2, 3, seed=4)], refuse=True)
    with pytest.raises(WeightSyncError, match="version 1 failed after 2 attempt.*shape mismatch.*keep serving version 0"):
        train(_settings(tmp_path, steps=1, sync_mode="disk", sync_retries=2), http=gw.client())
    assert gw.acked == []
    calls = [path for path, _ in gw.admin]
    assert calls.count("/update_weights_from_disk") >= 2
    # paused, then resumed on the old version
    assert calls.index("/admin/pause") < calls.index("/update_weights_from_disk")
    assert gw.admin[-1] == ("/admin/resume", {"weight_version": 0})


def _with_rewards(rows, rewards_by_group):
    """The rows with each group's rewards replaced (in order), and a task id per group."""
    import dataclasses

    out, seen = [], {}
    for row in rows:
        i = seen[row.group_id] = seen.get(row.group_id, -1) + 1
        r = float(rewards_by_group[row.group_id][i])
        out.append(dataclasses.replace(row, reward=r, turn_rewards=np.array([r]), turn_returns=np.array([r]),
                                       task_id=f"task-{row.group_id}"))
    return out


def test_zero_variance_batch_is_skipped_loudly_then_a_real_one_trains(tmp_path, dist_info, caplog):
    flat = _with_rewards(synthetic_rows(2, 3, seed=5), {"g0": [1, 1, 1], "g1": [0, 0, 0]})
    mixed = _with_rewards(synthetic_rows(2, 3, seed=6), {"g0": [1, 0, 0], "g1": [0, 0, 0]})
    gw = FakeGateway([flat, mixed])
    with caplog.at_level("WARNING", logger="trainer"):
        state = train(_settings(tmp_path, steps=2, save_every=1, sync_mode="disk"), http=gw.client())
    assert (state.step, state.version) == (2, 2)
    assert any("NOTHING TO LEARN" in r.message and "2 groups" in r.message for r in caplog.records)
    calls = [path for path, _ in gw.admin]
    # step 1: no pause and no push, only the version moves; step 2: one real push
    first_push = calls.index("/update_weights_from_disk")
    assert ("/admin/resume", {"weight_version": 1}) in gw.admin[:first_push]
    # ...and the engine labels its unchanged weights version 1 first, so the tokens it generates from now on
    # carry the trainer's version (tokens are tagged with the engine-reported version) and are not stale
    relabel = gw.admin.index(("/update_weight_version", {"new_version": "1", "abort_all_requests": False}))
    assert relabel < gw.admin.index(("/admin/resume", {"weight_version": 1}))
    assert "/admin/pause" not in calls[:calls.index("/admin/resume")]
    assert calls.count("/update_weights_from_disk") == 1 and gw.acked == ["lease-1", "lease-2"]
    # the trainer tells the gateway its group size with the budget
    trainer_posts = [body for path, body in gw.admin if path == "/admin/trainer"]
    assert trainer_posts[0] == {"version": 0, "batch_size": 2, "staleness_bound": 1, "group_size": 3}
    # and after each step that step's numeric metrics (the gateway's trace viewer charts them)
    assert [p["version"] for p in trainer_posts] == [0, 1, 2]
    step1, step2 = trainer_posts[1]["metrics"], trainer_posts[2]["metrics"]
    assert step1["step"] == 1 and "actor/loss" not in step1 and "skipped" not in step1
    assert step2["step"] == 2 and "reward/mean" in step2 and "logprob_gap/mean" in step2
    assert all(isinstance(v, float) and math.isfinite(v) for m in (step1, step2) for v in m.values())
    # only the trained step was checkpointed
    assert [p.name for p in sorted((tmp_path / "ckpt").glob("step_*"))] == ["step_000002"]
    metrics = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["skipped"] == "zero_variance" and "actor/loss" not in metrics[0]
    assert metrics[1].get("skipped") is None and "actor/loss" in metrics[1]
    for m in metrics:
        assert m["batch/group_ids"] == ["g0", "g1"] and m["batch/task_ids"] == ["task-g0", "task-g1"]
        assert m["batch/sessions"] == 6 and m["batch/groups"] == 2
    assert metrics[0]["batch/zero_variance_groups"] == 2 and metrics[1]["batch/zero_variance_groups"] == 1
    spread = {g["group_id"]: g for g in metrics[1]["batch/reward_spread"]}
    assert (spread["g0"]["reward_min"], spread["g0"]["reward_max"], spread["g0"]["sessions"]) == (0.0, 1.0, 3)
    assert spread["g0"]["reward_mean"] == pytest.approx(1 / 3, abs=1e-6) and spread["g1"]["reward_std"] == 0.0


@pytest.mark.slow
def test_only_the_newest_k_checkpoints_are_kept(tmp_path, dist_info):
    batches = [_with_rewards(synthetic_rows(1, 2, seed=10 + i), {"g0": [0, 1]}) for i in range(3)]
    train(_settings(tmp_path, steps=3, save_every=1, batch_groups=1, group_size=2, keep_checkpoints=2),
          http=FakeGateway(batches).client())
    assert [p.name for p in sorted((tmp_path / "ckpt").glob("step_*"))] == ["step_000002", "step_000003"]


def test_sync_mode_none_never_announces_a_version_it_did_not_push(tmp_path, dist_info):
    """With --sync-mode none the served weights never change: the trainer trains (its own version moves)
    but tells the gateway no version (before, it announced v+1 after every step, so the gateway held every
    row generated since as stale) and touches no admin route."""
    gw = FakeGateway([synthetic_rows(2, 3, seed=5)])
    state = train(_settings(tmp_path, steps=1), http=gw.client())
    assert (state.step, state.version) == (1, 1) and gw.acked == ["lease-1"]
    assert gw.admin == []


def test_a_trainer_waiting_over_a_minute_logs_why(caplog):
    import time

    from trainer.data import LeaseClient
    from trainer.loop import explain_wait

    why = "6 groups open (24 sessions: 24 active, 0 finished), 0 ready to lease, staleness budget full (24 of 24 sessions admitted)"
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(200, json={"waiting": why})

    leases = LeaseClient("http://gw", "k", client=httpx.Client(transport=httpx.MockTransport(handler)))
    now = time.monotonic()
    assert explain_wait(leases, now - 30, now - 30) == now - 30 and seen == []  # under a minute: quiet
    with caplog.at_level("WARNING", logger="trainer"):
        later = explain_wait(leases, now - 61, now - 61)
    assert later >= now and seen == ["/v1/trajectories/stats"]
    assert "no data for 61 s: " + why in caplog.text


def test_release_memory_frees_the_engines_during_the_step_and_takes_it_back_before_the_push(tmp_path, dist_info):
    gw = FakeGateway([synthetic_rows(2, 3, seed=1)])
    state = train(_settings(tmp_path, steps=1, sync_mode="disk", release_memory="all"), http=gw.client())
    assert state.step == 1
    calls = [path for path, _ in gw.admin if path not in ("/admin/engines", "/admin/trainer", "/get_model_info",
                                                        "/admin/weight_version", "/model_info", "/weight_info")]
    assert calls == ["/admin/pause", "/release_memory_occupation", "/resume_memory_occupation", "/admin/pause",
                     "/update_weights_from_disk", "/admin/resume"], calls
    bodies = dict(gw.admin)
    assert bodies["/release_memory_occupation"] == bodies["/resume_memory_occupation"] == {
        "tags": ["kv_cache", "weights", "cuda_graph"]}
    (metrics,) = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert metrics["engine/release_s"] >= 0 and metrics["engine/resume_memory_s"] >= 0
