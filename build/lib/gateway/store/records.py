"""The records the store takes and returns (plain dataclasses; token arrays as Python lists)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

SessionStatus = Literal["active", "finished", "consumed", "abandoned"]
SESSION_STATUSES: tuple[str, ...] = ("active", "finished", "consumed", "abandoned")
FinishReason = Literal["stop", "length", "tool_calls", "abort"]


@dataclass(slots=True, kw_only=True)
class SessionRecord:
    """One session (episode). ``api_key`` is the plain key only on the record returned by
    ``create_session``; the store keeps a SHA-256 of it, so every other read returns ``api_key=None``."""

    id: str
    api_key: str | None
    group_id: str
    task_id: str | None
    metadata: dict[str, Any]
    status: SessionStatus
    is_eval: bool
    created_at: float
    finished_at: float | None
    last_activity_at: float
    reward: float | None = None  # the session-level reward, if one was posted (export decides its use)
    version: int = 0  # bumped on every status/reward change; keeps Redis copies from going backwards


@dataclass(slots=True, kw_only=True, frozen=True)
class GroupRecord:
    """A GRPO group admitted as a whole. ``places`` sessions were charged to the staleness budget and
    ``created`` of them exist (``POST /v1/groups`` creates them all at once; sessions created one by one
    with a group id fill places reserved when the group's first session came). ``status``: ``open``
    (places may still be filled), ``closed`` (sent or timed out: unused places were given back) or
    ``abandoned``."""

    id: str
    size: int  # sessions per GRPO group
    places: int
    created: int
    status: str
    task_id: str | None
    metadata: dict[str, Any]
    created_at: float

    @property
    def sealed(self) -> bool:
        """No further session can join: every reserved place is used, or the group is no longer open."""
        return self.status != "open" or self.created >= self.places


@dataclass(slots=True, kw_only=True)
class Interaction:
    """One turn. ``id`` is the response id (``chatcmpl-<hex>``); with ``n>1`` each choice is its own turn.

    ``prompt_ids`` holds ONLY the delta beyond the parent's full sequence (for a root: the whole prompt),
    so storage stays linear in conversation length. The full sequence of a turn is
    ``full_sequence(parent) + prompt_ids + output_ids``. ``bridge_len`` leading prompt tokens are an
    end-of-turn token added because the parent was cut (always loss-masked). ``output_logprobs`` and
    ``output_versions`` have one entry per output token.
    """

    id: str
    session_id: str
    parent_id: str | None
    request: dict[str, Any]  # only the messages new beyond the parent's path, plus tools and params
    response_message: dict[str, Any]  # the assistant message exactly as returned
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str
    chain_hash: str  # hash chain over normalised messages + returned assistant message
    request_hash: str  # hash chain over the request's normalised messages (equal for retries)
    bridge_len: int = 0
    reward: float | None = None
    root_reason: str | None = None  # for roots: "first_turn", "no_prefix_match", ...
    created_at: float = field(default_factory=time.time)
    timings: dict[str, float] = field(default_factory=dict)  # milliseconds, by stage


@dataclass(slots=True, frozen=True)
class NewSession:
    """A session not stored yet, created with its first turns (``Store.new_session``)."""

    row: dict[str, Any]  # its SQL row
    api_key: str  # the plain key (only its hash is stored)

    @property
    def id(self) -> str:
        return str(self.row["id"])


@dataclass(slots=True, frozen=True)
class ParentMatch:
    """The turn found as parent, and the length of the message prefix (the candidate) that matched."""

    prefix_len: int
    interaction: Interaction


@dataclass(slots=True, kw_only=True, frozen=True)
class RewardRecord:
    """One row of the reward audit: who set which value on which target, when."""

    id: int
    session_id: str
    interaction_id: str | None  # None for a session-level reward
    reward: float
    source: str
    created_at: float


@dataclass(slots=True, kw_only=True)
class CommitStats:
    """Counters of the group-commit writer (monotonic since ``open``)."""

    transactions: int = 0  # committed batch transactions (successful or not)
    rows: int = 0  # interactions committed
    calls: int = 0  # record_interactions calls completed successfully
    failed_calls: int = 0
    retried_batches: int = 0  # batches that failed and were retried caller by caller
    max_batch_calls: int = 0  # the most callers served by one transaction
