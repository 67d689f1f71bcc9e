"""Settings of the agent runner (`agentrl agent`, and the runner inside `agentrl up`).

Kept apart from `agents.runner` so that building the command line does not import the openai SDK.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from agentrl import defaults
from agentrl.settings import SettingsError

AGENTS = ("math", "tools")
DEFAULT_MAX_TURNS = {"math": 2, "tools": 4}


@dataclass
class RunnerSettings:
    """Settings of `agentrl agent` (and of the runner inside `agentrl up`)."""

    env_prefix: ClassVar[str] = "AGENTRL_AGENT_"

    agent: str = field(default="math", metadata={"help": "which example agent: math or tools", "choices": AGENTS})
    gateway: str = field(default="http://127.0.0.1:8000", metadata={"help": "gateway root URL (no /v1)"})
    admin_key: str = field(default="", metadata={"help": "the gateway's admin key (creates and finishes sessions)"})
    dataset: str = field(default="synthetic:1",
                         metadata={"help": "gsm8k:PATH (.jsonl, a directory of split.jsonl, or a datasets dir), "
                                           "synthetic or synthetic:DIFFICULTY (1-8)"})
    split: str = field(default="train", metadata={"help": "dataset split: train or test", "choices": ("train", "test")})
    limit: int = field(default=16, metadata={"help": "number of prompts to run (each gives group_size sessions)"})
    offset: int = field(default=0, metadata={"help": "skip this many prompts of the dataset first"})
    seed: int = field(default=0, metadata={"help": "seed of the synthetic dataset"})
    group_size: int = field(default=defaults.GROUP_SIZE, metadata={"help": "sessions per prompt, sharing one group id (GRPO group)"})
    concurrency: int = field(default=8, metadata={"help": "agents running at the same time"})
    eval: bool = field(default=False, metadata={"help": "mark sessions as evaluation (metadata eval=true): "
                                                        "recorded but never exported for training"})
    max_turns: int = field(default=0, metadata={"help": "model calls per episode; 0 = the agent's default "
                                                        "(math 2, tools 4)"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    max_tokens: int = field(default=256, metadata={"help": "max new tokens per model call"})
    model: str = field(default="", metadata={"help": "model name sent to the gateway; empty = first of /v1/models"})
    reward_workers: int = field(default=2, metadata={"help": "processes scoring answers"})
    reward_timeout_s: float = field(default=10.0, metadata={"help": "seconds one reward call may take"})
    reward_retries: int = field(default=1, metadata={"help": "retries of a reward call that timed out or crashed"})
    request_timeout_s: float = field(default=600.0, metadata={"help": "seconds one model call may take"})
    gateway_wait_s: float = field(default=120.0, metadata={"help": "how long to keep retrying a gateway that is down"})
    admission_wait_s: float = field(default=3600.0,
                                    metadata={"help": "how long to keep retrying one session refused with 429"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})

    def validate(self) -> None:
        if self.agent not in AGENTS:
            raise SettingsError(f"agent must be one of {AGENTS}, got {self.agent!r}")
        if not self.gateway.startswith(("http://", "https://")):
            raise SettingsError(f"--gateway must be an http(s) URL such as http://127.0.0.1:8000, got {self.gateway!r}")
        self.gateway = self.gateway.rstrip("/")
        if self.gateway.endswith("/v1"):
            raise SettingsError(f"--gateway is the root URL, without /v1: use {self.gateway[:-3]}")
        if not self.admin_key:
            raise SettingsError("--admin-key is required (the gateway's admin key; env AGENTRL_AGENT_ADMIN_KEY)")
        for name in ("limit", "group_size", "concurrency", "max_tokens", "reward_workers"):
            if getattr(self, name) < 1:
                raise SettingsError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("offset", "max_turns", "reward_retries"):
            if getattr(self, name) < 0:
                raise SettingsError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.temperature <= 2.0:
            raise SettingsError(f"--temperature must be within [0, 2], got {self.temperature}")
        for name in ("reward_timeout_s", "request_timeout_s", "gateway_wait_s", "admission_wait_s"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.max_turns == 0:
            self.max_turns = DEFAULT_MAX_TURNS[self.agent]
