"""Wire schemas of the gateway's request bodies.

Every model derives from :class:`WireModel`, which accepts fields it does not know (OpenAI adds fields
often; SDKs send ``user``, ``metadata``, ``store``, ...) and logs them once per name instead of failing.
Messages and tools are kept as plain JSON here: the chat layer validates them with JSON paths in its
errors (``messages[2].tool_call_id``), which is more useful to an agent author than a pydantic union error.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

log = logging.getLogger("agentrl.gateway.wire")
INT32_MAX = 2**31 - 1  # bound of counters and versions stored in SQL INTEGER columns
SEED_MAX = 2**63 - 1
_LOGGED_UNKNOWN: set[str] = set()


class WireModel(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    @model_validator(mode="after")
    def _log_unknown(self) -> WireModel:
        extra = self.model_extra or {}
        for name in extra:
            key = f"{type(self).__name__}.{name}"
            if key not in _LOGGED_UNKNOWN and len(_LOGGED_UNKNOWN) < 1024:  # names come from clients: bounded
                _LOGGED_UNKNOWN.add(key)
                log.info("accepted and ignored unknown field %r in %s", name, type(self).__name__)
        return self

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(WireModel):
    include_usage: StrictBool = False


class SamplingFields(WireModel):
    """Sampling fields shared by chat and text completions."""

    model: str | None = None
    n: StrictInt = Field(default=1, ge=1, le=INT32_MAX)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt | None = Field(default=None, ge=-1, le=INT32_MAX)  # SGLang / vLLM extension; 0 or -1: off
    seed: StrictInt | None = Field(default=None, ge=-SEED_MAX, le=SEED_MAX)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if len(items) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(SamplingFields):
    messages: Any = None  # validated by gateway.chat.normalize.validate_messages
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    response_format: Any = None  # checked by gateway.constraints
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=INT32_MAX)

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.messages is None:
            raise ValueError("messages is required")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if self.tool_choice is not None and not (
            self.tool_choice in ("none", "auto", "required") or isinstance(self.tool_choice, dict)
        ):
            raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', ...}")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def wants_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class CompletionRequest(SamplingFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]] = Field(min_length=1)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)
    echo: StrictBool = False
    best_of: StrictInt | None = Field(default=None, ge=1, le=INT32_MAX)
    suffix: str | None = None

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or a batch (a list of strings or of token id lists)."""
        p = self.prompt
        if isinstance(p, str) or all(isinstance(t, int) for t in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value


class SessionCreate(WireModel):
    group_id: str | None = Field(default=None, min_length=1, max_length=200)
    task_id: str | None = Field(default=None, max_length=200)
    metadata: dict[str, Any] | None = None


class GroupCreate(WireModel):
    size: StrictInt = Field(ge=1)
    group_id: str | None = Field(default=None, min_length=1, max_length=200)
    task_id: str | None = Field(default=None, max_length=200)
    metadata: dict[str, Any] | None = None


class RewardRequest(WireModel):
    response_id: str | None = None
    session_id: str | None = None
    reward: Any = None
    source: str | None = Field(default=None, max_length=200)

    @model_validator(mode="after")
    def _check(self) -> RewardRequest:
        if (self.response_id is None) == (self.session_id is None):
            raise ValueError("give exactly one of response_id and session_id")
        value = self.reward
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"reward must be a number, got {type(value).__name__}")
        if not math.isfinite(float(value)):
            raise ValueError("reward must be a finite number (not NaN or infinity)")
        self.reward = float(value)
        return self


class ResumeRequest(WireModel):
    weight_version: StrictInt = Field(ge=0, le=INT32_MAX)


class PauseRequest(WireModel):
    mode: Literal["abort", "in_place", "retract"] = "abort"


class TrainerStatus(WireModel):
    version: StrictInt = Field(ge=0, le=INT32_MAX)
    batch_size: StrictInt = Field(ge=1, le=INT32_MAX)
    staleness_bound: StrictInt = Field(ge=0, le=INT32_MAX)
    group_size: StrictInt | None = Field(default=None, ge=1, le=INT32_MAX)  # the trainer's; replaces --group-size in the budget
    metrics: dict[str, Any] | None = None  # the step's metrics (finite numbers kept), for the trace viewer
