"""The 95% Wilson intervals `agentrl up` reports with held-out accuracy."""

from __future__ import annotations

import pytest

from agentrl.up import _eval_summary, wilson_interval


def test_wilson_interval_hand_computed():
    # 0 of 4: centre = half = (z^2 / 2n) / (1 + z^2 / n) = 0.48020 / 1.96040 = 0.24495
    assert wilson_interval(0, 4) == (0.0, 0.4899)
    # 163 of 400 (p = 0.4075): the textbook Wilson bounds
    assert wilson_interval(163, 400) == pytest.approx((0.3604, 0.4563), abs=1e-4)
    lo, hi = wilson_interval(17, 400)
    assert lo < 17 / 400 < hi and hi < 0.3604  # the before/after intervals of the GPU run do not overlap
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_eval_summary_adds_intervals_over_the_prompts_run():
    out = _eval_summary({"accuracy_turn1": 0.5, "accuracy_final": 0.75, "mean_reward": 0.7, "episodes": 20}, 99)
    assert out["prompts"] == 20
    assert out["accuracy_final_ci95"] == list(wilson_interval(15, 20))
    assert out["accuracy_turn1_ci95"][0] < 0.5 < out["accuracy_turn1_ci95"][1]


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
