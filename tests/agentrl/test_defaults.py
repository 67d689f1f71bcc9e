"""The defaults of `agentrl up`, `agentrl train`, the gateway and the runner agree (agentrl.defaults)."""

from __future__ import annotations

import dataclasses

from agentrl import defaults
from agentrl.up import UpSettings
from agents.settings import RunnerSettings
from gateway.lifecycle import ExportSettings
from gateway.settings import GatewaySettings
from trainer.config import TrainerSettings


def _default(cls: type, name: str) -> object:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def test_learning_rate_gamma_and_group_size_agree():
    assert _default(UpSettings, "lr") == _default(TrainerSettings, "lr") == defaults.LR
    assert _default(UpSettings, "gamma") == _default(GatewaySettings, "gamma") == _default(ExportSettings, "gamma") \
        == defaults.GAMMA
    # the trainer keeps the returns the gateway exported (its gamma) unless told otherwise
    assert _default(TrainerSettings, "gamma") == -1.0
    sizes = {_default(cls, "group_size") for cls in (UpSettings, TrainerSettings, GatewaySettings, ExportSettings,
                                                     RunnerSettings)}
    assert sizes == {defaults.GROUP_SIZE}
    assert _default(TrainerSettings, "staleness_bound") == defaults.STALENESS_BOUND
    assert _default(TrainerSettings, "keep_checkpoints") == defaults.KEEP_CHECKPOINTS > 0
