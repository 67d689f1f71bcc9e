"""Training data in: leases from the gateway, duplicate dropping, sharding over ranks, micro-batch packing.

The gateway hands out finished groups under a lease (``GET /v1/trajectories``, binary batch in the format
of :mod:`agentrl.trajectory`) and takes them back unless the lease is acknowledged
(``POST /v1/trajectories/ack``) before it times out. Delivery is therefore at-least-once and the trainer
drops rows it has already trained on by ``row_id``. Only rank 0 talks HTTP; the other ranks receive the
same bytes by a broadcast (see ``trainer.loop``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import torch

from trainer.core_algos import ZERO_VARIANCE_STD
from agentrl.trajectory import LEASE_HEADER, Row, decode_batch, discounted_returns

log = logging.getLogger(__name__)


class GatewayError(RuntimeError):
    """The gateway refused a lease or ack, or could not be reached; the message says which and why."""


@dataclass
class Lease:
    lease_id: str
    rows: list[Row]
    meta: dict[str, Any]
    raw: bytes = b""
    lease_ids: list[str] = field(default_factory=list)  # a batch may combine several leases

    def __post_init__(self) -> None:
        if not self.lease_ids:
            self.lease_ids = [self.lease_id]


class LeaseClient:
    """Thin client for the trajectory leasing routes (admin key as Bearer)."""

    def __init__(self, gateway: str, admin_key: str, *, client: httpx.Client | None = None) -> None:
        self.base = gateway.rstrip("/")
        self.client = client or httpx.Client(timeout=httpx.Timeout(30.0, read=None))
        self.headers = {"Authorization": f"Bearer {admin_key}"}

    def lease(self, max_groups: int, wait_s: float) -> Lease | None:
        """Long-poll for up to ``max_groups`` finished groups; ``None`` when none arrived within ``wait_s``."""
        try:
            resp = self.client.get(
                f"{self.base}/v1/trajectories", params={"max_groups": max_groups, "wait_s": wait_s},
                headers=self.headers, timeout=httpx.Timeout(30.0, read=wait_s + 30.0),
            )
        except httpx.HTTPError as exc:
            raise GatewayError(f"cannot lease trajectories from {self.base}: {exc}") from exc
        if resp.status_code == 204:
            return None
        if resp.status_code != 200:
            raise GatewayError(f"GET /v1/trajectories answered {resp.status_code}: {resp.text[:300]}")
        return parse_lease(resp.content, resp.headers)

    def why_waiting(self) -> str:
        """The gateway's one-line account of why no group is ready (``GET /v1/trajectories/stats``)."""
        try:
            resp = self.client.get(f"{self.base}/v1/trajectories/stats", headers=self.headers)
            return str(resp.json().get("waiting") or f"stats answered {resp.status_code}")
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            return f"cannot ask the gateway why: {exc}"

    def ack(self, lease_id: str) -> None:
        try:
            resp = self.client.post(f"{self.base}/v1/trajectories/ack", json={"lease_id": lease_id}, headers=self.headers)
        except httpx.HTTPError as exc:
            raise GatewayError(f"cannot ack lease {lease_id}: {exc}") from exc
        if resp.status_code >= 300:
            raise GatewayError(f"POST /v1/trajectories/ack for lease {lease_id} answered {resp.status_code}: {resp.text[:300]}")


def parse_lease(body: bytes, headers: Any = None) -> Lease | None:
    """Decode a lease response: the lease id comes from the ``X-Agentrl-Lease-Id`` header or the batch meta."""
    rows, meta = decode_batch(body)
    lease_id = (headers or {}).get(LEASE_HEADER.lower()) or meta.get("lease_id")
    if not rows and not lease_id:
        return None
    if not lease_id:
        raise GatewayError(f"the gateway sent a batch without a lease id (header {LEASE_HEADER} or meta.lease_id)")
    return Lease(lease_id=str(lease_id), rows=rows, meta=meta, raw=bytes(body))


# ------------------------------------------------------------------------------------------ row handling


@dataclass
class SeenRows:
    """Row ids already trained on (bounded: the oldest are forgotten first)."""

    limit: int = 1_000_000
    _ids: dict[str, None] = field(default_factory=dict)

    def __contains__(self, row_id: str) -> bool:
        return row_id in self._ids

    def add(self, row_id: str) -> None:
        self._ids[row_id] = None
        if len(self._ids) > self.limit:
            del self._ids[next(iter(self._ids))]

    def state(self) -> list[str]:
        return list(self._ids)

    @classmethod
    def from_state(cls, ids: Iterable[str], limit: int = 1_000_000) -> SeenRows:
        seen = cls(limit=limit)
        for row_id in ids:
            seen.add(row_id)
        return seen


def drop_duplicates(rows: Sequence[Row], seen: SeenRows) -> tuple[list[Row], int]:
    """Rows not seen before (also de-duplicated within the batch), and how many were dropped."""
    kept: list[Row] = []
    batch_ids: set[str] = set()
    for row in rows:
        if row.row_id in seen or row.row_id in batch_ids:
            continue
        batch_ids.add(row.row_id)
        kept.append(row)
    return kept, len(rows) - len(kept)


def row_rewards(rows: Sequence[Row], gamma: float | None) -> np.ndarray:
    """Each row's scalar reward: as exported, or recomputed from raw turn rewards with ``gamma``."""
    if gamma is None:
        return np.array([r.reward for r in rows], dtype=np.float64)
    return np.array(
        [discounted_returns(r.turn_rewards, gamma)[0] if len(r.turn_rewards) else r.reward for r in rows],
        dtype=np.float64,
    )


def describe_batch(rows: Sequence[Row], gamma: float | None) -> dict[str, Any]:
    """What a step trains on, for ``metrics.jsonl``: every group's id, task, sessions and reward spread.

    A group whose rows all have the same reward gives every row a zero advantage: nothing to learn from
    it. ``batch/zero_variance_groups`` counts those; when it equals ``batch/groups`` the step is skipped.
    """
    rewards = row_rewards(rows, gamma)
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(row.grpo_group, []).append(i)
    described = []
    for key, index in groups.items():
        values = rewards[index]
        described.append({
            "group_id": rows[index[0]].group_id, "group_key": key, "task_id": rows[index[0]].task_id,
            "sessions": len({rows[i].session_id for i in index}), "rows": len(index),
            "reward_mean": round(float(values.mean()), 6), "reward_std": round(float(values.std()), 6),
            "reward_min": float(values.min()), "reward_max": float(values.max()),
        })
    return {
        "batch/groups": len(described),
        "batch/sessions": len({r.session_id for r in rows}),
        "batch/group_ids": [g["group_id"] for g in described],
        "batch/task_ids": sorted({str(g["task_id"]) for g in described if g["task_id"] is not None}),
        "batch/zero_variance_groups": sum(g["reward_max"] - g["reward_min"] <= ZERO_VARIANCE_STD for g in described),
        "batch/reward_spread": described,
    }


def index_of(values: Sequence[str]) -> torch.Tensor:
    """Strings -> int64 ids (equal strings, equal ids), for the group/session indices of the math."""
    table: dict[str, int] = {}
    return torch.tensor([table.setdefault(v, len(table)) for v in values], dtype=torch.int64)


def split_by_group(rows: Sequence[Row], parts: int) -> list[list[int]]:
    """Row indices in ``parts`` mini-batches, whole groups each, balanced by group count."""
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(row.grpo_group, []).append(i)
    out: list[list[int]] = [[] for _ in range(parts)]
    for j, idx in enumerate(groups.values()):
        out[j % parts].extend(idx)
    return [p for p in out if p]


def shard_rows(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Row indices per rank, balancing tokens (longest first onto the lightest rank). Deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    loads = [0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        r = min(range(world_size), key=lambda k: (loads[k], k))
        shards[r].append(i)
        loads[r] += lengths[i]
    return [sorted(s) for s in shards]


def pack_micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Group row indices into micro-batches whose padded size (rows x longest row) stays within ``budget``.

    Rows are taken longest first, so each micro-batch's first row sets its padded length. A row longer than
    the budget is refused (``trainer.config.check_row_fits`` says how to fix it).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    width = 0
    for i in order:
        if lengths[i] > budget:
            raise ValueError(f"row {i} has {lengths[i]} tokens, more than the micro-batch budget {budget}")
        if batches and (len(batches[-1]) + 1) * width <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
            width = lengths[i]
    return batches


@dataclass
class MicroBatch:
    """Padded tensors of one micro-batch; token columns are aligned with the *predicted* tokens (T-1)."""

    input_ids: torch.Tensor  # (B, T) int64, right-padded with 0
    attention_mask: torch.Tensor  # (B, T) int64
    loss_mask: torch.Tensor  # (B, T-1) float32: 1 where token t+1 was generated by the model
    behaviour: torch.Tensor  # (B, T-1) float32 engine logprobs of token t+1
    versions: torch.Tensor  # (B, T-1) int32 weight version of token t+1 (-1 elsewhere)
    advantages: torch.Tensor  # (B,) float32
    rows: list[int]  # indices into the batch
    prox: torch.Tensor | None = None  # (B, T-1) logprobs recomputed with the weights at the start of the step
    temperature: torch.Tensor | None = None  # (B, T-1) float32 sampling temperature of token t+1 (1 elsewhere)
    real_tokens: int = 0  # tokens that are not padding (counted on the CPU, so reading it never waits for a GPU)
    packed: Any = None  # trainer.packing.Packed of this micro-batch, made on the CPU (packing path)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device) -> MicroBatch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return MicroBatch(move(self.input_ids), move(self.attention_mask), move(self.loss_mask),
                          move(self.behaviour), move(self.versions), move(self.advantages), self.rows, move(self.prox),
                          move(self.temperature), self.real_tokens,
                          None if self.packed is None else self.packed.to(device))


def collate(rows: Sequence[Row], index: Sequence[int], advantages: torch.Tensor) -> MicroBatch:
    """Pad the rows ``index`` of ``rows`` into one :class:`MicroBatch` (CPU tensors)."""
    width = max(rows[i].num_tokens for i in index)
    b = len(index)
    input_ids = torch.zeros(b, width, dtype=torch.int64)
    attention = torch.zeros(b, width, dtype=torch.int64)
    loss_mask = torch.zeros(b, width, dtype=torch.float32)
    behaviour = torch.zeros(b, width, dtype=torch.float32)
    versions = torch.full((b, width), -1, dtype=torch.int32)
    temperature = torch.ones(b, width, dtype=torch.float32)
    for j, i in enumerate(index):
        row = rows[i]
        n = row.num_tokens
        input_ids[j, :n] = torch.from_numpy(np.array(row.input_ids, dtype=np.int64))  # copy: decoded rows are read-only views
        attention[j, :n] = 1
        loss_mask[j, :n] = torch.from_numpy(np.array(row.loss_mask, dtype=np.float32))  # copy: decoded rows are read-only views
        behaviour[j, :n] = torch.from_numpy(np.array(row.logprobs, dtype=np.float32))  # copy: decoded rows are read-only views
        versions[j, :n] = torch.from_numpy(np.array(row.versions, dtype=np.int32))  # copy: decoded rows are read-only views
        temperature[j, :n] = torch.from_numpy(row.token_temperatures())
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention,
        loss_mask=loss_mask[:, 1:].contiguous(),
        behaviour=behaviour[:, 1:].contiguous(),
        versions=versions[:, 1:].contiguous(),
        advantages=advantages[list(index)].to(torch.float32),
        rows=list(index),
        temperature=temperature[:, 1:].contiguous(),
        real_tokens=sum(rows[i].num_tokens for i in index),
    )


def dummy_micro_batch() -> MicroBatch:
    """A one-row, all-masked micro-batch: keeps FSDP ranks in step when one rank has fewer micro-batches."""
    return MicroBatch(
        input_ids=torch.zeros(1, 2, dtype=torch.int64), attention_mask=torch.ones(1, 2, dtype=torch.int64),
        loss_mask=torch.zeros(1, 1), behaviour=torch.zeros(1, 1), versions=torch.full((1, 1), -1, dtype=torch.int32),
        advantages=torch.zeros(1), rows=[], real_tokens=0,
    )
