"""Sessions and GRPO groups: admitted as a whole, abandoned early, listed for operators.

The staleness budget (``gateway.staleness``) counts sessions. Charged one session at a time, groups can
deadlock it: six groups of four each creating sessions one by one against a budget of four sessions fill
the budget with part-filled groups, none of which can ever complete (issue 13). So a group is admitted in
ONE decision for all of its places:

* ``POST /v1/groups {"size": N}`` charges ``N`` and creates the group and its ``N`` sessions in one
  transaction, or answers 429 (``Retry-After``) with nothing created.
* ``POST /v1/sessions`` with a ``group_id``: the first session of the group charges the whole group
  (``metadata.group_size``, else the gateway's ``group_size``) and reserves its places; the group's later
  sessions take a reserved place and are never refused. A session beyond the reserved places starts the
  next group of that id (charged again). Without a ``group_id`` a session is a group of one.
  Finding a free place, charging and adding places are ONE store transaction with the group row locked
  (``Store.join_group``; the budget is a row of the same database), so concurrent first sessions of a
  group make exactly one admission decision: one charges, the others take its places (before, each
  charged a whole group: 429s for sessions of an admitted group and places charged until the timeout).
* Whatever was charged is given back if creating the sessions then fails.

A place is given back when its session is abandoned (``POST /v1/sessions/{id}/abandon``,
``POST /v1/groups/{id}/abandon``, or the group timeout) and when a group is closed with places never used
(``POST /v1/groups/{id}/close``: no more sessions will come; or the group timeout).
A group goes to training as soon as all of its sessions are finished or abandoned and no more can join
(see ``gateway.lifecycle``), so an abandoned session never holds its group back. Eval sessions
(``metadata.eval``) are never charged.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from gateway import errors
from gateway.context import Services
from gateway.errors import from_store_error
from gateway.episodes.groups import seal_implicit
from gateway.store import GroupRecord, SessionRecord
from gateway.store import errors as store_errors

MAX_GROUP_SIZE = 1024
LIVE = ("active", "finished")


def _is_eval(metadata: dict[str, Any] | None) -> bool:
    return bool(metadata) and metadata is not None and metadata.get("eval") is True


def target_size(metadata: dict[str, Any] | None, default: int) -> int:
    """Sessions per group for a group id: ``metadata.group_size`` when it is a positive int."""
    wanted = (metadata or {}).get("group_size")
    if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted >= 1:
        return wanted
    return default


def _notify(svc: Services) -> None:
    """Wake the lifecycle (a group may be ready now)."""
    svc.trajectories.notify()


async def create_group(svc: Services, *, size: int, group_id: str | None, task_id: str | None,
                       metadata: dict[str, Any] | None) -> tuple[GroupRecord, list[SessionRecord]]:
    """Admit and create a whole group: all ``size`` sessions or none (429 / 409 / 503)."""
    if not 1 <= size <= MAX_GROUP_SIZE:
        raise errors.InvalidRequest(f"size must be between 1 and {MAX_GROUP_SIZE}, got {size}", param="size")
    charged = await svc.admission.reserve(size, metadata=metadata)
    try:
        return await svc.store.create_group(group_id=group_id, size=size, task_id=task_id, metadata=metadata)
    except BaseException as exc:
        await svc.admission.release(charged)
        if isinstance(exc, store_errors.StoreError):
            raise from_store_error(exc) from exc
        raise


async def create_session(svc: Services, *, group_id: str | None, task_id: str | None,
                         metadata: dict[str, Any] | None) -> SessionRecord:
    """``POST /v1/sessions``: a session in a reserved place of its group, reserving the group if needed."""
    meta = metadata or {}
    store = svc.store
    try:
        if group_id is None or _is_eval(meta):
            charged = await svc.admission.reserve(1, metadata=meta)
            try:
                return await store.create_session(group_id=group_id, task_id=task_id, metadata=meta)
            except BaseException:
                await svc.admission.release(charged)
                raise
        size = target_size(meta, svc.settings.group_size)
        await svc.admission.settle()

        async def charge(conn: Any, n: int) -> int:
            return int(await svc.admission.reserve_in(conn, n, metadata=meta))

        for _ in range(3):
            try:
                made = await store.join_group(group_id=group_id, size=size, task_id=task_id, metadata=meta,
                                              charge=charge)
            except store_errors.Conflict:  # another request created the group's row at that moment: join it
                continue
            if made is None:  # cannot happen: with a charge, join_group adds places when none is free
                raise errors.Conflict(f"group {group_id} is not open for new sessions")
            return made
        raise errors.Conflict(f"group {group_id} is being created concurrently; retry")
    except store_errors.StoreError as exc:
        raise from_store_error(exc) from exc


async def _abandon(svc: Services, session: SessionRecord) -> tuple[SessionRecord, bool]:
    """Abandon one active or finished session; (record, whether it changed). Consumed: 409."""
    if session.status == "abandoned":
        return session, False
    if session.status == "consumed":
        raise errors.Conflict(f"session {session.id} was already consumed by training", code="session_consumed")
    try:
        done = await svc.store.set_session_status(session_id=session.id, status="abandoned", expected=list(LIVE))
    except store_errors.Conflict:
        current = await svc.store.get_session(session_id=session.id)
        if current.status == "abandoned":
            return current, False
        raise errors.Conflict(f"session {session.id} is {current.status}; it cannot be abandoned",
                              code="session_consumed") from None
    return done, True


async def abandon_session(svc: Services, session: SessionRecord) -> SessionRecord:
    """Abandon a session: it is never trained on and its place in the budget is given back."""
    try:
        done, changed = await _abandon(svc, session)
    except store_errors.StoreError as exc:
        raise from_store_error(exc) from exc
    if changed and not done.is_eval:
        await svc.admission.release(1)
        _notify(svc)
    return done


async def abandon_group(svc: Services, group_id: str) -> dict[str, Any]:
    """Abandon every session of a group not yet consumed, close it, and give all its places back."""
    try:
        sessions = await svc.store.list_sessions(group_id=group_id)
        groups = await svc.store.get_groups(group_ids=[group_id])
        if not sessions and group_id not in groups:
            raise errors.NotFound(f"no group {group_id!r}", param="group_id")
        freed = 0
        for s in sessions:
            if s.status in LIVE:
                try:
                    _, changed = await _abandon(svc, s)
                except errors.Conflict:
                    continue  # consumed meanwhile: it is being trained on
                freed += changed and not s.is_eval
        freed += await svc.store.close_group(group_id=group_id, status="abandoned")
    except store_errors.StoreError as exc:
        raise from_store_error(exc) from exc
    await svc.admission.release(freed)
    _notify(svc)
    return await describe_group(svc, group_id)


async def close_group(svc: Services, group_id: str) -> dict[str, Any]:
    """No more sessions will join this group: give back the places never taken; its sessions go to training
    as soon as they are finished (a smaller group, ``complete: false``, if places were unused or sessions
    abandoned). The gateway cannot tell by itself that no more sessions are coming to a group created one
    session at a time (so an abandoned session does not shrink it: a later session of the group would then
    start a new, fully charged group); without this call such a group waits for the group timeout.
    A group that is already sealed is left as it is. A later session of the id starts the id's next group."""
    try:
        group = (await svc.store.get_groups(group_ids=[group_id])).get(group_id)
        if group is None:  # an implicit group (no row): sealed as it stands (gateway.episodes.groups)
            group = await seal_implicit(svc.store, group_id)
        if group is None:
            raise errors.NotFound(f"no group {group_id!r} was admitted (POST /v1/groups or /v1/sessions with "
                                  "this group_id) and no implicit session has it", param="group_id")
        unused = await svc.store.close_group(group_id=group_id, status="closed")
    except store_errors.StoreError as exc:
        raise from_store_error(exc) from exc
    await svc.admission.release(unused)
    _notify(svc)
    return await describe_group(svc, group_id)


def group_status(group: GroupRecord | None, sessions: list[SessionRecord]) -> str:
    """``abandoned`` | ``open`` (places not taken yet) | ``active`` | ``finished`` | ``exported``."""
    kept = [s for s in sessions if s.status != "abandoned"]
    if (group is not None and group.status == "abandoned") or not kept:
        return "abandoned"
    if group is not None and not group.sealed:
        return "open"
    if any(s.status == "active" for s in kept):
        return "active"
    if all(s.status == "consumed" for s in kept):
        return "exported"
    return "finished"


async def describe_group(svc: Services, group_id: str) -> dict[str, Any]:
    try:
        sessions = await svc.store.list_sessions(group_id=group_id)
        group = (await svc.store.get_groups(group_ids=[group_id])).get(group_id)
    except store_errors.StoreError as exc:
        raise from_store_error(exc) from exc
    if group is None and not sessions:
        raise errors.NotFound(f"no group {group_id!r}", param="group_id")
    return {
        "group_id": group_id,
        "size": group.size if group is not None else len(sessions),
        "status": group_status(group, sessions),
        "task_id": group.task_id if group is not None else (sessions[0].task_id if sessions else None),
        "sessions": [{"session_id": s.id, "status": s.status, "reward": s.reward} for s in sessions],
    }


# ---------------------------------------------------------------------------------- listing sessions


def encode_cursor(session: SessionRecord) -> str:
    raw = json.dumps([session.created_at, session.id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, sid = json.loads(raw)
        if isinstance(created_at, bool) or not isinstance(created_at, (int, float)) or not isinstance(sid, str):
            raise ValueError("bad cursor")
        return float(created_at), sid
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError):
        raise errors.InvalidRequest("cursor is not one this gateway returned as next_cursor",
                                    param="cursor") from None
