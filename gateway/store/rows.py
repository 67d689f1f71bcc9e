"""Conversions between SQL rows and the store's records (packing token arrays on the way in)."""

from __future__ import annotations

import hashlib
import secrets
import time
import uuid
from collections.abc import Mapping
from typing import Any

from gateway.store.records import GroupRecord, Interaction, RewardRecord, SessionRecord
from gateway.store.errors import InvalidValue
from gateway.store.packing import pack_f32, pack_i32, unpack_f32, unpack_i32


def session_from_row(row: Mapping[Any, Any], *, api_key: str | None = None) -> SessionRecord:
    return SessionRecord(
        id=row["id"],
        api_key=api_key,
        group_id=row["group_id"],
        task_id=row["task_id"],
        metadata=row["meta"] if "meta" in row else row["metadata"],
        status=row["status"],
        is_eval=bool(row["is_eval"]),
        created_at=row["created_at"],
        finished_at=row["finished_at"],
        last_activity_at=row["last_activity_at"],
        reward=row["reward"],
        version=row["version"],
    )


def group_from_row(row: Mapping[Any, Any]) -> GroupRecord:
    return GroupRecord(id=row["id"], size=row["size"], places=row["places"], created=row["created"],
                       status=row["status"], task_id=row["task_id"], metadata=row["meta"],
                       created_at=row["created_at"])


def check_interaction(it: Interaction) -> None:
    """Reject a turn whose arrays disagree, before it reaches the database."""
    n = len(it.output_ids)
    if len(it.output_logprobs) != n or len(it.output_versions) != n:
        raise InvalidValue(
            f"interaction {it.id}: output_ids ({n}), output_logprobs ({len(it.output_logprobs)}) and "
            f"output_versions ({len(it.output_versions)}) must have the same length"
        )
    if not 0 <= it.bridge_len <= len(it.prompt_ids):
        raise InvalidValue(f"interaction {it.id}: bridge_len {it.bridge_len} outside 0..{len(it.prompt_ids)}")
    if it.parent_id is None and it.bridge_len:
        raise InvalidValue(f"interaction {it.id}: a root turn cannot have bridge tokens")
    if it.parent_id == it.id:
        raise InvalidValue(f"interaction {it.id} cannot be its own parent")


def interaction_to_row(it: Interaction) -> dict[str, Any]:
    try:
        return {
            "id": it.id,
            "session_id": it.session_id,
            "parent_id": it.parent_id,
            "created_at": it.created_at,
            "request": it.request,
            "response_message": it.response_message,
            "prompt_ids": pack_i32(it.prompt_ids),
            "bridge_len": it.bridge_len,
            "output_ids": pack_i32(it.output_ids),
            "output_logprobs": pack_f32(it.output_logprobs),
            "output_versions": pack_i32(it.output_versions),
            "finish_reason": it.finish_reason,
            "reward": it.reward,
            "chain_hash": it.chain_hash,
            "request_hash": it.request_hash,
            "root_reason": it.root_reason,
            "timings": it.timings,
        }
    except (TypeError, OverflowError) as exc:
        raise InvalidValue(f"interaction {it.id}: token arrays must be int32/float32 numbers: {exc}") from exc


def interaction_from_row(row: Mapping[Any, Any]) -> Interaction:
    return Interaction(
        id=row["id"],
        session_id=row["session_id"],
        parent_id=row["parent_id"],
        created_at=row["created_at"],
        request=row["request"],
        response_message=row["response_message"],
        prompt_ids=unpack_i32(row["prompt_ids"]),
        bridge_len=row["bridge_len"],
        output_ids=unpack_i32(row["output_ids"]),
        output_logprobs=unpack_f32(row["output_logprobs"]),
        output_versions=unpack_i32(row["output_versions"]),
        finish_reason=row["finish_reason"],
        reward=row["reward"],
        chain_hash=row["chain_hash"],
        request_hash=row["request_hash"],
        root_reason=row["root_reason"],
        timings=row["timings"],
    )


def reward_from_row(row: Mapping[Any, Any]) -> RewardRecord:
    return RewardRecord(
        id=row["id"],
        session_id=row["session_id"],
        interaction_id=row["interaction_id"],
        reward=row["reward"],
        source=row["source"],
        created_at=row["created_at"],
    )


def hash_key(api_key: str) -> str:
    """The SHA-256 (hex) under which a session's api key is stored and cached."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def new_session_row(
    *, group_id: str | None, task_id: str | None, metadata: dict[str, Any] | None, session_id: str | None = None
) -> tuple[dict[str, Any], str]:
    """The SQL row of a new active session, and its plain api key (only its hash is stored)."""
    metadata = dict(metadata or {})
    sid = session_id or f"sess-{uuid.uuid4().hex}"
    api_key = f"sk-agentrl-{secrets.token_urlsafe(32)}"
    now = time.time()
    row = {"id": sid, "key_hash": hash_key(api_key), "group_id": group_id or sid, "task_id": task_id,
           "meta": metadata, "status": "active", "is_eval": metadata.get("eval") is True, "reward": None,
           "version": 0, "created_at": now, "finished_at": None, "last_activity_at": now}
    return row, api_key
