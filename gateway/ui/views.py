"""What the trace viewer shows, as JSON-able dicts: one function per page, each the body of its JSON API.

Everything here reads; nothing writes. The pieces come from where they already live, so that the viewer
shows what the system does rather than a second opinion of it:

- the turn tree from ``gateway.store.tree.tree_json`` (the JSON of ``GET /v1/sessions/{id}``);
- dropped retries and the rows export will produce from :mod:`agentrl.trajectory` (``abandoned_retries``,
  ``export_session``) with the gateway's export settings (mode, gamma, reward mode);
- GRPO groups as the exporter cuts them (``gateway.lifecycle.grpo_chunks``) and their advantages from
  ``trainer.core_algos.group_advantages`` (the trainer's own function, imported when a group page is asked
  for: it needs torch);
- the trainer's state from the staleness control, the trajectory queue and the trainer's step reports.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from agentrl.trajectory import Row, Turn, abandoned_retries, export_session, turn_from_interaction
from gateway.admission import admission_status
from gateway.errors import InvalidRequest, NotFound
from gateway.lifecycle import ExportSettings, grpo_chunks
from gateway.store import Interaction, SessionRecord, Store
from gateway.store import errors as store_errors
from gateway.store.browse import SessionFilter, sessions_page, status_counts
from gateway.store.tree import tree_json

if TYPE_CHECKING:
    from gateway.context import Services

MAX_TOKENS_SHOWN = 16384  # a token view longer than this shows its last tokens (the newest turn)


def session_json(record: SessionRecord) -> dict[str, Any]:
    out = dataclasses.asdict(record)
    out.pop("api_key", None)
    return out


# -------------------------------------------------------------------------------------------- sessions


async def sessions_list(store: Store, *, filters: SessionFilter, limit: int, cursor: str | None) -> dict[str, Any]:
    """A page of sessions (newest first) with counts per status under the same filters."""
    page = await sessions_page(store, filters=filters, limit=limit, cursor=cursor)
    counts = await status_counts(store, filters=filters)
    return {
        "sessions": [{**session_json(s), "turns": page.turns.get(s.id, 0)} for s in page.sessions],
        "next_cursor": page.next_cursor,
        "counts": counts,
        "total": sum(counts[k] for k in (filters.status or counts)),
    }


async def _load(store: Store, session_id: str) -> tuple[SessionRecord, list[Interaction]]:
    try:
        session = await store.get_session(session_id=session_id)
        return session, await store.session_interactions(session_id=session_id)
    except store_errors.NotFound:
        raise NotFound(f"no session {session_id!r}", param="session_id") from None


def export_rows(session: SessionRecord, turns: Sequence[Interaction], settings: ExportSettings) -> list[Row]:
    """The rows export would produce for this session now (same function and settings as the exporter)."""
    return export_session([turn_from_interaction(t) for t in turns], mode=settings.export_mode,
                          gamma=settings.gamma, reward_mode=settings.reward_mode, session_reward=session.reward,
                          session_id=session.id, group_id=session.group_id, task_id=session.task_id)


def _row_summary(row: Row) -> dict[str, Any]:
    return {
        "row_id": row.row_id, "leaf_id": row.leaf_id, "reward": row.reward, "is_truncated": row.is_truncated,
        "num_tokens": row.num_tokens, "trained_tokens": int(row.loss_mask.sum()), "min_version": row.min_version,
        "turn_ids": list(row.turn_interaction_ids), "turn_rewards": [float(x) for x in row.turn_rewards],
        "turn_returns": [float(x) for x in row.turn_returns],
    }


def _messages(request: dict[str, Any]) -> list[dict[str, Any]]:
    if "messages" in request:
        return list(request["messages"] or [])
    if "prompt" in request:  # /v1/completions
        return [{"role": "prompt", "content": request["prompt"]}]
    return []


async def session_detail(store: Store, session_id: str, settings: ExportSettings) -> dict[str, Any]:
    """The turn tree, each turn annotated with what the viewer needs (see docs/gateway.md)."""
    session, turns = await _load(store, session_id)
    tree = tree_json(session, turns, None)  # what Store.session_tree_json returns, without reading again
    history = await store.reward_history(session_id=session_id)
    as_turns = [turn_from_interaction(t) for t in turns]
    dropped = abandoned_retries(as_turns)
    try:
        rows = export_rows(session, turns, settings)
        export_error = None
    except ValueError as exc:  # a malformed tree: the exporter would leave this session out
        rows, export_error = [], str(exc)
    row_of_leaf = {r.leaf_id: r for r in rows}
    in_rows = {tid for r in rows for tid in r.turn_interaction_ids}
    conversation: dict[str, list[dict[str, Any]]] = {}  # turn id -> messages the agent sent

    def annotate(node: dict[str, Any], before: list[dict[str, Any]]) -> None:
        seen = before + _messages(node["request"])
        conversation[node["id"]] = seen
        timings = node.get("timings") or {}
        node.update({
            "messages": seen,
            "new_messages": len(_messages(node["request"])),
            "tools": node["request"].get("tools"),
            "params": node["request"].get("params"),
            "dropped": node["id"] in dropped,
            "exported": node["id"] in in_rows,
            "row": _row_summary(row_of_leaf[node["id"]]) if node["id"] in row_of_leaf else None,
            "latency_ms": round(sum(float(v) for k, v in timings.items() if k.endswith("_ms")), 3),
            "reward_history": [dataclasses.asdict(h) for h in history if h.interaction_id == node["id"]],
        })
        for child in node["children"]:
            annotate(child, seen + [node["response_message"]])

    for root in tree["roots"]:
        annotate(root, [])
    return {
        "session": session_json(session),
        "roots": tree["roots"],
        "num_interactions": tree["num_interactions"],
        "rows": [_row_summary(r) for r in rows],
        "export": {"mode": settings.export_mode, "gamma": settings.gamma, "reward_mode": settings.reward_mode,
                   "error": export_error},
        "dropped": sorted(dropped),
        "reward_history": [dataclasses.asdict(h) for h in history if h.interaction_id is None],
    }


# ---------------------------------------------------------------------------------------------- tokens


def _decode_each(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    return list(tokenizer.batch_decode([[int(i)] for i in ids], skip_special_tokens=False)) if ids else []


def _token_payload(tokenizer: Any, ids: Sequence[int], kinds: Sequence[str], mask: Sequence[int],
                   logprobs: Sequence[float | None], versions: Sequence[int], turns: Sequence[int]) -> dict[str, Any]:
    start = max(0, len(ids) - MAX_TOKENS_SHOWN)
    sl = slice(start, None)
    return {
        "skipped": start,  # tokens left out at the start (only beyond MAX_TOKENS_SHOWN)
        "num_tokens": len(ids),
        "ids": [int(i) for i in ids[sl]],
        "text": _decode_each(tokenizer, ids[sl]),
        "kind": list(kinds[sl]),
        "loss_mask": [int(m) for m in mask[sl]],
        "logprobs": [None if lp is None else round(float(lp), 5) for lp in logprobs[sl]],
        "versions": [int(v) for v in versions[sl]],
        "turns": [int(t) for t in turns[sl]],
    }


def _segments(path: Sequence[Turn]) -> tuple[list[str], list[int]]:
    """Per-token kind (``bridge``, ``prompt``: the turn's prompt delta, ``output``) and path index."""
    kinds: list[str] = []
    index: list[int] = []
    for k, turn in enumerate(path):
        n_prompt = len(turn.prompt_ids)
        kinds += ["bridge"] * turn.bridge_len + ["prompt"] * (n_prompt - turn.bridge_len) + ["output"] * len(turn.output_ids)
        index += [k] * (n_prompt + len(turn.output_ids))
    return kinds, index


def _path_to(turns: Sequence[Interaction], turn_id: str) -> list[Interaction]:
    by_id = {t.id: t for t in turns}
    if turn_id not in by_id:
        raise NotFound(f"no turn {turn_id!r} in this session", param="turn_id")
    path = [by_id[turn_id]]
    while path[-1].parent_id is not None and len(path) <= len(by_id):
        path.append(by_id[path[-1].parent_id])
    return path[::-1]


async def turn_tokens(store: Store, tokenizer: Any, session_id: str, turn_id: str) -> dict[str, Any]:
    """One turn's full sequence: its ancestors' tokens as context, then its bridge, prompt delta and output.
    Only the turn's own output carries a loss mask, logprobs and versions (as in an ``individual`` row)."""
    _, turns = await _load(store, session_id)
    path = [turn_from_interaction(t) for t in _path_to(turns, turn_id)]
    kinds, index = _segments(path)
    last = len(path) - 1
    kinds = [k if i == last else "context" for k, i in zip(kinds, index)]
    ids: list[int] = [int(x) for t in path for x in (*t.prompt_ids, *t.output_ids)]
    turn = path[-1]
    n_before = len(ids) - len(turn.output_ids)
    mask = [0] * n_before + [1] * len(turn.output_ids)
    logprobs: list[float | None] = [None] * n_before + [float(x) for x in turn.logprobs]
    versions = [-1] * n_before + [int(v) for v in turn.versions]
    return {
        "session_id": session_id, "turn_id": turn_id, "row_id": None, "path": [t.id for t in path],
        "finish_reason": turn.finish_reason, "reward": turn.reward, "bridge_len": turn.bridge_len,
        "tokens": _token_payload(tokenizer, ids, kinds, mask, logprobs, versions, index),
    }


async def row_tokens(store: Store, tokenizer: Any, session_id: str, leaf_id: str,
                     settings: ExportSettings) -> dict[str, Any]:
    """One row exactly as export produces it (``leaf_id`` names it: the leaf in concat mode, the turn in
    individual mode), each token labelled with the part of its turn it came from."""
    session, turns = await _load(store, session_id)
    try:
        rows = export_rows(session, turns, settings)
    except ValueError as exc:
        raise InvalidRequest(f"this session cannot be exported: {exc}") from None
    row = next((r for r in rows if r.leaf_id == leaf_id), None)
    if row is None:
        raise NotFound(f"no exported row ends at turn {leaf_id!r} (dropped retry, inner turn or unknown id)",
                       param="leaf_id")
    path = [turn_from_interaction(t) for t in _path_to(turns, row.turn_interaction_ids[-1])]
    kinds, index = _segments(path)
    mask = [int(m) for m in row.loss_mask]
    logprobs: list[float | None] = [float(lp) if m else None for lp, m in zip(row.logprobs, mask)]
    return {
        "session_id": session_id, "turn_id": None, "row_id": row.row_id, "path": [t.id for t in path],
        "row": _row_summary(row),
        "tokens": _token_payload(tokenizer, [int(x) for x in row.input_ids], kinds, mask, logprobs,
                                 [int(v) for v in row.versions], index),
    }


# ---------------------------------------------------------------------------------------------- groups


def _advantages(rows: list[Row], estimator: str) -> tuple[list[float], dict[str, float]]:
    import torch

    from trainer.core_algos import group_advantages

    sessions = {sid: k for k, sid in enumerate(dict.fromkeys(r.session_id for r in rows))}
    adv, metrics = group_advantages(
        torch.tensor([r.reward for r in rows], dtype=torch.float64), torch.zeros(len(rows), dtype=torch.int64),
        torch.tensor([sessions[r.session_id] for r in rows], dtype=torch.int64), estimator=estimator)
    return [float(a) for a in adv], metrics


async def group_detail(store: Store, group_id: str, settings: ExportSettings, estimator: str) -> dict[str, Any]:
    """A group id's sessions, cut into GRPO groups as the exporter cuts them, with each session's rows,
    rewards and the advantages the trainer's ``group_advantages`` gives them if exported now."""
    from trainer.core_algos import ADV_ESTIMATORS

    if estimator not in ADV_ESTIMATORS:
        raise InvalidRequest(f"unknown estimator {estimator!r}; valid: {', '.join(ADV_ESTIMATORS)}",
                             param="estimator")
    members = await store.list_sessions(group_id=group_id)
    if not members:
        raise NotFound(f"no group {group_id!r}", param="group_id")
    trained = [s for s in members if not s.is_eval]
    out_groups = []
    for chunk, size in grpo_chunks(trained, settings.group_size):
        entries: list[dict[str, Any]] = []
        rows: list[Row] = []
        for s in chunk:
            turns = await store.session_interactions(session_id=s.id)
            try:
                got = export_rows(s, turns, settings)
            except ValueError:
                got = []
            rows += got
            entries.append({"session": session_json(s), "turns": len(turns), "rows": [_row_summary(r) for r in got]})
        advantages, metrics = _advantages(rows, estimator) if rows else ([], {})
        k = 0
        for entry in entries:
            for row in entry["rows"]:
                row["advantage"] = advantages[k]
                k += 1
            rewards = [r["reward"] for r in entry["rows"]]
            entry["reward"] = sum(rewards) / len(rewards) if rewards else None  # counted once per session
        session_rewards = [e["reward"] for e in entries if e["reward"] is not None]
        mean = sum(session_rewards) / len(session_rewards) if session_rewards else None
        var = (sum((r - mean) ** 2 for r in session_rewards) / max(1, len(session_rewards) - 1)
               if mean is not None else None)
        out_groups.append({
            "size": size, "complete": len(chunk) == size, "sessions": entries,
            "reward_mean": mean, "reward_std": math.sqrt(var) if var is not None else None,
            "zero_variance": bool(metrics.get("adv/zero_var_groups")) if metrics else None,
            "metrics": metrics,
        })
    return {
        "group_id": group_id, "estimator": estimator, "export": {"mode": settings.export_mode, "gamma": settings.gamma,
                                                                  "reward_mode": settings.reward_mode},
        "grpo_groups": out_groups,
        "eval_sessions": [session_json(s) for s in members if s.is_eval],
    }


# --------------------------------------------------------------------------------------------- trainer


def chart_points(entries: Sequence[dict[str, Any]], name: str) -> list[tuple[float, float]]:
    """(step, value) of one metric over the trainer's reports (the step number, else the report's index)."""
    out = []
    for k, entry in enumerate(entries):
        metrics = entry.get("metrics") or {}
        if name in metrics:
            out.append((float(metrics.get("step", k + 1)), float(metrics[name])))
    return out


def chart(entries: Sequence[dict[str, Any]], name: str, *, width: int = 520, height: int = 160,
          pad: int = 34) -> dict[str, Any]:
    """An inline-SVG line chart of one metric: the polyline's points in pixels plus axis labels."""
    points = chart_points(entries, name)
    if not points:
        return {"name": name, "points": "", "n": 0, "width": width, "height": height}
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y0 == y1:
        y0, y1 = y0 - 0.5, y1 + 0.5
    sx = (width - 2 * pad) / (x1 - x0) if x1 > x0 else 0.0
    sy = (height - 2 * pad) / (y1 - y0)

    def px(x: float, y: float) -> str:
        return f"{pad + (x - x0) * sx if sx else width / 2:.1f},{height - pad - (y - y0) * sy:.1f}"

    return {
        "name": name, "n": len(points), "width": width, "height": height, "pad": pad,
        "points": " ".join(px(x, y) for x, y in points),
        "dots": [{"xy": px(x, y).split(","), "x": x, "y": y} for x, y in points],
        "x_min": x0, "x_max": x1, "y_min": min(ys), "y_max": max(ys), "last": ys[-1],
    }


async def trainer_detail(svc: Services, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Staleness budget, queue depth, leases and acks, versions, and the trainer's step reports."""
    described = await svc.trajectories.describe()
    router = svc.router
    return {
        "admission": await admission_status(svc.admission),
        "trainer": described["trainer"],
        "queue": described["queue"],
        "stats": described["stats"],
        "export": described["settings"],
        "weight_version": router.weight_version,
        "paused": router.paused,
        "engines": [e.as_json() for e in router.engines],
        "sessions": await status_counts(svc.store, filters=SessionFilter()),
        "reports": entries,
        "charts": [chart(entries, "reward/mean"), chart(entries, "logprob_gap/mean")],
    }


async def find(store: Store, ident: str) -> dict[str, Any]:
    """What an id names (a session, a turn = response id, or a group) and the viewer page that shows it."""
    ident = ident.strip()
    if not ident:
        raise InvalidRequest("give an id to look up: a session id, a response id or a group id", param="id")
    try:
        session = await store.get_session(session_id=ident)
        return {"kind": "session", "session_id": session.id, "url": f"/ui/sessions/{quote(session.id, safe='')}"}
    except store_errors.NotFound:
        pass
    try:
        turn = await store.get_interaction(interaction_id=ident)
        sid = quote(turn.session_id, safe="")
        return {"kind": "turn", "session_id": turn.session_id, "url": f"/ui/sessions/{sid}#turn-{quote(turn.id, safe='')}"}
    except store_errors.NotFound:
        pass
    if await store.list_sessions(group_id=ident, limit=1):
        return {"kind": "group", "group_id": ident, "url": f"/ui/groups/{quote(ident, safe='')}"}
    raise NotFound(f"no session, response or group has the id {ident!r}", param="id")
