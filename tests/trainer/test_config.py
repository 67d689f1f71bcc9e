"""Trainer settings: impossible combinations are refused at start with a how-to-fix message."""

from __future__ import annotations

import pytest

from agentrl.settings import SettingsError, load
from trainer.config import TrainerSettings, check_row_fits

OK = {"gateway": "http://127.0.0.1:9"}


@pytest.mark.parametrize("overrides, match", [
    ({"group_size": 1}, "group-size 2 or more"),
    ({"max_seq_len": 4096, "micro_batch_tokens": 1024}, "raise --micro-batch-tokens to at least 4096"),
    ({"micro_batch_tokens": 0}, "positive token count"),
    ({"batch_groups": 2, "mini_batches": 3}, "1 <= --mini-batches <= --batch-groups"),
    ({"clip_low": 1.5}, "0 < clip_low < 1"),
    ({"is_cap": 0.5}, "value > 1"),
    ({"gamma": 2.0}, "within \\[0, 1\\]"),
    ({"sync_retries": 0}, "--sync-retries 1"),
    ({"lr": -1.0}, "positive number"),
])
def test_bad_combinations_are_refused(overrides, match):
    with pytest.raises(SettingsError, match=match):
        load(TrainerSettings, env={}, **OK, **overrides)


def test_unknown_mode_from_env_lists_valid_ones():
    with pytest.raises(SettingsError, match="unknown sync_mode 'rsync'; valid: disk, broadcast, tensor, none"):
        load(TrainerSettings, env={"AGENTRL_TRAINER_SYNC_MODE": "rsync", "AGENTRL_TRAINER_GATEWAY": "http://x"})


def test_push_needs_a_destination():
    with pytest.raises(SettingsError, match="--gateway URL .* or --engine-urls"):
        load(TrainerSettings, env={})
    assert load(TrainerSettings, env={}, sync_mode="none").sync_mode == "none"


def test_yaml_env_and_flags_layer(tmp_path):
    cfg = tmp_path / "t.yaml"
    cfg.write_text("lr: 0.001\ngroup_size: 8\nsync_mode: broadcast\n")
    s = load(TrainerSettings, yaml_path=cfg, env={"AGENTRL_TRAINER_GROUP_SIZE": "6"}, **OK)
    assert (s.lr, s.group_size, s.sync_mode) == (0.001, 6, "broadcast")
    assert s.is_cap_or_none == 5.0 and s.gamma_or_none is None


def test_row_longer_than_budget_is_refused_when_the_batch_arrives():
    s = load(TrainerSettings, env={}, micro_batch_tokens=100, **OK)
    check_row_fits(100, s)
    with pytest.raises(SettingsError, match="raise --micro-batch-tokens to at least 101"):
        check_row_fits(101, s, "row-7")
