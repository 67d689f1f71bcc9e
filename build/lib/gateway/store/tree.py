"""Turn trees: ordering turns parents-first and the JSON view for people and the UI."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from gateway.store.records import Interaction, SessionRecord


def parents_first(turns: Sequence[Interaction]) -> list[Interaction]:
    """Turns ordered oldest first, except that a parent always precedes its children."""
    ordered = sorted(turns, key=lambda it: (it.created_at, it.id))
    ids = {it.id for it in ordered}
    children: dict[str | None, list[Interaction]] = {}
    for it in ordered:
        parent = it.parent_id if it.parent_id in ids else None
        children.setdefault(parent, []).append(it)
    out: list[Interaction] = []
    ready = list(children.get(None, []))
    while ready:  # Kahn's algorithm, always taking the oldest turn whose parent is out
        ready.sort(key=lambda it: (it.created_at, it.id))
        it = ready.pop(0)
        out.append(it)
        ready.extend(children.get(it.id, []))
    return out


def tree_json(
    session: SessionRecord, turns: Sequence[Interaction], decode: Callable[[list[int]], str] | None
) -> dict[str, Any]:
    nodes: dict[str, dict[str, Any]] = {}
    roots: list[dict[str, Any]] = []
    for it in parents_first(turns):
        node: dict[str, Any] = {
            "id": it.id,
            "parent_id": it.parent_id,
            "created_at": it.created_at,
            "request": it.request,
            "response_message": it.response_message,
            "finish_reason": it.finish_reason,
            "reward": it.reward,
            "root_reason": it.root_reason,
            "bridge_len": it.bridge_len,
            "prompt_tokens": len(it.prompt_ids),
            "output_tokens": len(it.output_ids),
            "versions": [min(it.output_versions), max(it.output_versions)] if it.output_versions else None,
            "timings": it.timings,
            "children": [],
        }
        if decode is not None:
            node["prompt_text"] = decode(it.prompt_ids)
            node["output_text"] = decode(it.output_ids)
        nodes[it.id] = node
        parent = nodes.get(it.parent_id) if it.parent_id else None
        (parent["children"] if parent is not None else roots).append(node)
    session_json = dataclasses.asdict(session)
    session_json.pop("api_key")
    return {"session": session_json, "roots": roots, "num_interactions": len(nodes)}
