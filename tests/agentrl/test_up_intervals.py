"""The 95% Wilson intervals (3 digits) `agentrl up` reports with held-out accuracy, and what its summary
holds for an agent with accuracies and for one with rewards only."""

from __future__ import annotations

import pytest

from agentrl.stats import wilson_interval
from agentrl.up import _eval_summary, _eval_line, _step_line, step_row


def test_wilson_interval_hand_computed():
    # 0 of 4: centre = half = (z^2 / 2n) / (1 + z^2 / n) = 0.48020 / 1.96040 = 0.24495
    assert wilson_interval(0, 4) == (0.0, 0.49)
    # 163 of 400 (p = 0.4075): the textbook Wilson bounds 0.3604, 0.4563
    assert wilson_interval(163, 400) == (0.36, 0.456)
    lo, hi = wilson_interval(17, 400)
    assert lo < 17 / 400 < hi and hi < 0.36  # the before/after intervals of the GPU run do not overlap
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_eval_summary_adds_intervals_over_the_prompts_run():
    out = _eval_summary({"accuracy_turn1": 0.5, "accuracy_final": 0.75, "mean_reward": 0.7, "episodes": 20}, 99)
    assert out["prompts"] == 20
    assert out["accuracy_final_ci95"] == list(wilson_interval(15, 20))
    assert out["accuracy_turn1_ci95"][0] < 0.5 < out["accuracy_turn1_ci95"][1]


def test_an_agent_without_accuracy_gets_rewards_only_in_the_summary_and_on_the_console():
    """An episode function reports rewards only: no `turn-1 acc 0.000` (the 2026-12-04 newcomer's console)."""
    custom = {"episodes": 8, "failed": 1, "mean_reward": 0.625, "task_rewards": {}}
    row = step_row(0, custom, {"step": 1, "reward/mean": 0.5125}, 12.0)
    assert "accuracy_turn1" not in row and "accuracy_final" not in row
    assert row["mean_reward"] == 0.625 and row["trainer_reward"] == 0.5125
    line = _step_line(row, 0.9)
    assert "acc" not in line
    assert "mean episode reward 0.625 over 8 episodes" in line and "trainer reward 0.512 (discounted to turn 1, gamma 0.9)" in line
    evaluated = _eval_summary(custom, 20)
    assert set(evaluated) == {"mean_reward", "prompts", "failed"} and "accuracy" not in _eval_line(custom)

    math = {"episodes": 8, "failed": 0, "mean_reward": 0.5, "accuracy_turn1": 0.25, "accuracy_final": 0.5, "mean_turns": 1.5}
    row = step_row(1, math, {"step": 2, "skipped": "zero_variance"}, 3.0)
    assert row["accuracy_turn1"] == 0.25 and row["accuracy_final"] == 0.5 and row["skipped"]
    line = _step_line(row, 0.9)
    assert "turn-1 accuracy 0.250" in line and "final accuracy 0.500" in line and "skipped (nothing to learn)" in line


@pytest.mark.parametrize("device, engine_url, expected", [("cuda", "", "tensor"), ("cpu", "", "disk"),
                                                           ("cuda", "http://sglang:30000", "disk")])
def test_up_sync_mode_auto_is_tensor_only_when_colocated_on_a_gpu(device, engine_url, expected, tmp_path):
    from agentrl.up import UpSettings

    settings = UpSettings(device=device, engine_url=engine_url, out_dir=str(tmp_path))
    settings.validate()
    assert settings.sync_mode == expected
    explicit = UpSettings(device=device, engine_url=engine_url, out_dir=str(tmp_path), sync_mode="disk")
    explicit.validate()
    assert explicit.sync_mode == "disk"
