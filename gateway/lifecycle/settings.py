"""Export settings and counters: what the lifecycle loop, leasing and the staleness budget are configured
with (``ExportSettings``, read from the gateway's settings by field name, validated at start-up) and what
they count (``ExportStats``, served by ``GET /v1/trajectories/stats``)."""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from agentrl import defaults
from agentrl.settings import SettingsError
from agentrl.trajectory import EXPORT_MODES, REWARD_MODES

ENV_PREFIX = "AGENTRL_GATEWAY_"


@dataclass
class ExportSettings:
    """Settings of export, leasing and staleness. Declared here only: the gateway's settings
    (``gateway.settings.GatewaySettings``) inherit these fields, so their flags, environment variables and
    defaults are these; the help is the flags'."""

    group_size: int = field(default=defaults.GROUP_SIZE, metadata={
        "help": "sessions per GRPO group (a session's metadata.group_size overrides; no group_id = a group of one); a registered trainer's group size replaces it in the admission budget"})
    export_mode: str = field(default="concat", metadata={
        "help": "trajectory rows: concat (one per leaf, root-to-leaf path) or individual (one per turn)"})
    gamma: float = field(default=defaults.GAMMA, metadata={"help": "reward discount along each root-to-leaf path (the trainer uses the returns exported with it)"})
    reward_mode: str = field(default="discounted", metadata={
        "help": "a row's reward: discounted (return of its first turn) or last (its last turn's reward)"})
    idle_timeout_s: float = field(default=300.0, metadata={
        "help": "finish a session idle this long once it has a reward"})
    group_timeout_s: float = field(default=900.0, metadata={
        "help": "send an incomplete group after this (its unfinished sessions are abandoned)"})
    lease_timeout_s: float = field(default=300.0, metadata={
        "help": "an unacknowledged trajectory lease returns to the queue after this"})
    stale_max_age_s: float = field(default=60.0, metadata={
        "help": "drop groups held back as too stale (oldest token version < v - k) after this, giving their "
                "admission budget back (only a trainer registering a larger staleness bound could still lease them; "
                "docs/chaos.md)"})
    max_lease_groups: int = field(default=1024, metadata={"help": "largest max_groups of GET /v1/trajectories"})
    max_wait_s: float = field(default=300.0, metadata={"help": "largest wait_s of GET /v1/trajectories"})
    retry_after_s: float = field(default=2.0, metadata={
        "help": "Retry-After (s) of a 429 when the staleness budget is reached"})
    tick_s: float = field(default=0.5, metadata={"help": "period of the session lifecycle / export loop"})

    def validate(self) -> None:
        if self.export_mode not in EXPORT_MODES:
            raise ValueError(f"export_mode {self.export_mode!r}: use one of {', '.join(EXPORT_MODES)}")
        if self.reward_mode not in REWARD_MODES:
            raise ValueError(f"reward_mode {self.reward_mode!r}: use one of {', '.join(REWARD_MODES)}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma {self.gamma} must be within [0, 1]")
        if self.group_size < 1 or self.max_lease_groups < 1:
            raise ValueError("group_size and max_lease_groups must be >= 1")
        for name in ("idle_timeout_s", "group_timeout_s", "lease_timeout_s", "stale_max_age_s", "tick_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")

    @classmethod
    def from_settings(cls, settings: Any, environ: Mapping[str, str] | None = None) -> ExportSettings:
        """Each field from the gateway's settings object if it has one of that name, else from the
        environment variable ``AGENTRL_GATEWAY_<FIELD>`` (e.g. ``AGENTRL_GATEWAY_GROUP_SIZE=8``), else
        the default. Raises SettingsError with the variable's name for a malformed value."""
        env = os.environ if environ is None else environ
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):
            var = ENV_PREFIX + f.name.upper()
            if hasattr(settings, f.name):
                values[f.name] = getattr(settings, f.name)
            elif var in env:
                kind = hints[f.name]
                try:
                    values[f.name] = kind(env[var])
                except ValueError:
                    raise SettingsError(f"{var}={env[var]!r} is not a valid {kind.__name__}") from None
        out = cls(**values)
        try:
            out.validate()
        except ValueError as exc:
            raise SettingsError(f"export settings: {exc} (flag --<field>, or {ENV_PREFIX}<FIELD>)") from exc
        return out


@dataclass
class ExportStats:
    """Counters since start-up (this process)."""

    idle_finished: int = 0
    groups_exported: int = 0
    groups_swept: int = 0  # staged by an exporter that died before publishing; published by the sweep
    groups_partial: int = 0
    rows_exported: int = 0
    sessions_exported: int = 0
    sessions_abandoned: int = 0
    sessions_empty: int = 0
    sessions_failed: int = 0
    sessions_untrainable: int = 0  # sampled with top_p < 1 / top_k: refused (agentrl.trajectory.UntrainableSampling)
    stale_groups_dropped: int = 0
    stale_rows_dropped: int = 0
    stale_groups_requeued: int = 0
    leases: int = 0
    groups_leased: int = 0
    groups_redelivered: int = 0
    acks: int = 0
    groups_acked: int = 0
    ticks: int = 0
    tick_errors: int = 0  # ticks that failed, for any reason
    tick_outages: int = 0  # of those, ticks that failed because Redis or the database was unavailable
    last_tick_ms: float = 0.0  # wall time of the last complete tick (bench/soak.py reports it)
