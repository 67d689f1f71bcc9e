"""From a request's signals to its place in an episode: which session, which thread, which edge.

Why a linker at all: a coding CLI's run is one episode (one reward, one GRPO sample), but its requests are
several token chains. A sub-agent starts with its own system prompt and a fresh history, and a compaction
replaces the history with a summary, so neither continues any recorded turn by prefix. Without a link each
would start an episode of its own (implicit mode) and be trained apart from the reward it earned.

The linker works in two steps around the conversation core (``GenerationService``), called by the Messages
and Responses routes:

1. :meth:`EpisodeLinker.link` (before the turn): read the signals (``gateway.episodes.signals``); in
   implicit mode find the session that already holds this client run (``episode_threads.episode_key``) or
   the response named by ``X-AgentRL-Parent-Response``, so that the turn is recorded in that session (its
   tree gets a new root where a new thread starts; within a thread, parents and stitching are untouched).
   The turn's thread label goes into its recorded request (``request["episode"]``), in the turn's own
   commit.
2. :meth:`EpisodeLink.recorded` (after the commit, before the client sees the answer): the first turn of a
   thread segment adds its ``episode_threads`` row with its edge: ``spawned_by`` (the turn and tool call
   whose task text is this thread's first task; Codex also by parent thread and turn ids; a header client
   by the response it names) or ``compacted_from`` (the segment before, and the summarizer turn whose text
   the new window carries). Later requests confirm or correct a spawn link (Claude's ``agentId`` in the
   ``tool_result``, a ``<task-notification>``, Codex's ``spawn_agent`` output).

A link that cannot be made is recorded as ``status: unlinked`` with the reason, counted in
``agentrl_gateway_episode_links_total{client,edge,outcome}`` and shown on the session (``GET
/v1/sessions/{id}/threads``); the turn itself is recorded either way. Nothing is guessed: of several pending
calls with the same task text the newest is taken and the detail says how many there were, until a tool
result names the right one.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter

from gateway.episodes import table
from gateway.episodes.signals import MAIN, Confirmation, Signals, read_signals, spawn_calls
from gateway.episodes.table import ThreadRow
from gateway.store import errors as store_errors

log = logging.getLogger("agentrl.gateway.episodes")

SESSION_CACHE = 4096  # sessions whose thread rows this process keeps (the rest are read again from SQL)
SUMMARY_PROBE = 160  # characters of a summary looked for in the window that follows it


def _counter(registry: Any) -> Counter:
    """The link counter of one metrics registry (several apps may share a process, each its registry)."""
    found = getattr(registry, "_agentrl_episode_links", None)
    if found is None:
        found = Counter("agentrl_gateway_episode_links", "episode links by client, edge kind and outcome "
                        "(root, linked, confirmed, unlinked, relinked, error)", ["client", "edge", "outcome"],
                        registry=registry)
        registry._agentrl_episode_links = found
    return found


def is_main(sig: Signals) -> bool:
    if sig.client == "claude_code":
        return sig.thread == MAIN
    if sig.client == "codex":
        return sig.thread == sig.episode and not sig.parent_thread
    return sig.parent_response is None or sig.link == "compaction"


def _label(turn: Any) -> dict[str, Any]:
    label = (turn.request or {}).get("episode")
    return label if isinstance(label, dict) else {}


def _summary_probe(message: Mapping[str, Any]) -> str:
    """The part of a summarizer's answer that the next window carries verbatim (Claude keeps the body of
    ``<summary>``; Codex the whole text)."""
    text = str(message.get("content") or "")
    if "<summary>" in text:
        text = text.split("<summary>", 1)[1].split("</summary>", 1)[0]
    return text.strip()[:SUMMARY_PROBE]


@dataclass
class EpisodeLink:
    """One request's link: the session to record it in (None: a new implicit episode) and its label."""

    linker: EpisodeLinker | None
    signals: Signals
    session: Any  # SessionRecord | KeyedSession | None, as the core takes it
    owner: str | None = None
    body: Mapping[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def evidence(self) -> str:
        """The request's user-side text, where a summary (or a compaction handle) is looked for (only read
        for a new segment: not on every turn's path)."""
        return _evidence(self.body)

    def meta(self, base: dict[str, Any]) -> dict[str, Any]:
        """The format's recorded meta plus this turn's thread label."""
        if self.signals.client is None:
            return base
        label = self.signals.label()
        if self.notes:
            label["notes"] = list(self.notes)
        return {**base, "episode": label}

    async def recorded(self, runs: Sequence[Any]) -> None:
        """After the turn's commit: its thread row and confirmations. Never raises (the turn is recorded;
        an error here must not turn the answer into a failure and a retry into a duplicate)."""
        if self.linker is None or self.signals.client is None or not runs:
            return
        try:
            await self.linker.after(self, runs[0])
        except Exception:  # counted and logged; the turn stands
            log.exception("episode link of turn %s not recorded", runs[0].id)
            self.linker.count(self.signals, "-", "error")

    async def watch(self, events: AsyncIterator[Any], runs: Sequence[Any]) -> AsyncIterator[Any]:
        """A streamed turn's events, with :meth:`recorded` run before the ``recorded`` event goes on (so
        the link exists before the client's next request)."""
        try:
            async for event in events:
                if getattr(event, "kind", None) == "recorded":
                    await self.recorded(runs)
                yield event
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()


class EpisodeLinker:
    """Per app: the links' state is in SQL (``episode_threads``); this keeps a bounded cache of it."""

    def __init__(self, store: Any, registry: Any) -> None:
        self.store = store
        self.links = _counter(registry)
        self._threads: OrderedDict[str, dict[tuple[str, str], ThreadRow]] = OrderedDict()
        self._episodes: OrderedDict[tuple[str | None, str], str] = OrderedDict()

    def count(self, sig: Signals, edge: str, outcome: str) -> None:
        self.links.labels(sig.client or "-", edge, outcome).inc()

    # ------------------------------------------------------------------------------------ before the turn
    async def link(self, headers: Mapping[str, str], body: Mapping[str, Any], api: str, *, session: Any,
                   owner: str | None, implicit_allowed: bool) -> EpisodeLink:
        sig = read_signals(headers, body, api)
        out = EpisodeLink(self, sig, session, owner, body=body)
        if sig.client is None:
            return out
        for problem in sig.problems:
            out.notes.append(problem)
            self.count(sig, "-", "bad_signal")
        if sig.client == "header" and sig.parent_response:
            await self._by_parent_response(out)
        elif session is None and implicit_allowed and sig.episode:
            found = await self._episode_session(sig, owner)
            if found is not None:
                out.session = found
        return out

    async def _episode_session(self, sig: Signals, owner: str | None) -> Any:
        key = f"{sig.client}:{sig.episode}"
        sid = self._episodes.get((owner, key))
        if sid is None:
            sid = await table.session_of_episode(self.store, key, owner)
        if sid is None:
            return None
        try:
            record = await self.store.get_session(session_id=sid)
        except store_errors.NotFound:
            return None
        if record.status != "active" or (record.metadata or {}).get("owner") != owner:
            return None  # the run was rewarded and finished: what comes now is a new episode
        self._remember(self._episodes, (owner, key), sid)
        return record

    async def _by_parent_response(self, out: EpisodeLink) -> None:
        """``X-AgentRL-Parent-Response``: the named turn's session, if this caller may use it."""
        sig = out.signals
        try:
            parent = await self.store.get_interaction(interaction_id=sig.parent_response)
            record = await self.store.get_session(session_id=parent.session_id)
        except store_errors.NotFound:
            out.notes.append(f"X-AgentRL-Parent-Response {sig.parent_response!r} is not a recorded response")
            sig.thread = sig.thread or MAIN
            return
        if not sig.thread:  # a compaction keeps the thread of the response it follows
            sig.thread = _label(parent).get("thread") or MAIN
        if out.session is not None:
            if out.session.id != record.id:
                out.notes.append(f"X-AgentRL-Parent-Response {sig.parent_response!r} belongs to another session")
            return
        if record.status == "active" and (record.metadata or {}).get("owner") == out.owner:
            out.session = record
        else:
            out.notes.append(f"X-AgentRL-Parent-Response {sig.parent_response!r}: its session is "
                             f"{record.status} or another key's")

    # ------------------------------------------------------------------------------------ after the commit
    async def after(self, link: EpisodeLink, run: Any) -> None:
        sig = link.signals
        turn_id = run.id
        session_id = link.session.id if link.session is not None else \
            (await self.store.get_interaction(interaction_id=turn_id)).session_id
        threads = await self._session_threads(session_id)
        key = (sig.thread, sig.segment)
        if key not in threads:
            threads = await self._session_threads(session_id, fresh=True)
        if key not in threads:
            row = await self._new_row(link, session_id, turn_id, threads)
            if await table.insert(self.store, row):
                threads[key] = row
                self.count(sig, row.edge or "root", row.status)
                if row.episode_key:
                    self._remember(self._episodes, (row.owner, row.episode_key), session_id)
            else:
                threads = await self._session_threads(session_id, fresh=True)
        for conf in sig.confirmations:
            await self._confirm(sig, session_id, conf, threads)

    async def _session_threads(self, session_id: str, *, fresh: bool = False) -> dict[tuple[str, str], ThreadRow]:
        cached = self._threads.get(session_id)
        if cached is None or fresh:
            cached = {(r.thread, r.segment): r for r in await table.session_threads(self.store, session_id)}
            self._remember(self._threads, session_id, cached)
        return cached

    def _remember(self, cache: OrderedDict[Any, Any], key: Any, value: Any) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > SESSION_CACHE:
            cache.popitem(last=False)

    async def _new_row(self, link: EpisodeLink, session_id: str, turn_id: str,
                       threads: dict[tuple[str, str], ThreadRow]) -> ThreadRow:
        sig = link.signals
        row = ThreadRow(session_id=session_id, thread=sig.thread, segment=sig.segment, client=sig.client or "-",
                        kind="main" if is_main(sig) else "subagent", first_turn=turn_id, status=table.ROOT)
        if not threads and sig.episode:  # the session's first thread names the client run it is
            row.episode_key, row.owner = f"{sig.client}:{sig.episode}", link.owner
        if link.notes:
            row.detail["notes"] = list(link.notes)
        earlier = [r for r in threads.values() if r.thread == sig.thread]
        if sig.client == "header" and sig.parent_response:
            await self._header_edge(row, sig, session_id)
        elif earlier:
            await self._compacted_from(row, link, session_id, max(earlier, key=lambda r: r.created_at))
        elif row.kind == "subagent":
            await self._spawned_by(row, sig, session_id, threads)
        elif threads:  # a main thread seen after other threads (its first request was never recorded here)
            row.status = table.UNLINKED
            row.detail["reason"] = "the main thread's first segment arrived after other threads"
        return row

    async def _turns(self, session_id: str) -> list[Any]:
        return sorted(await self.store.session_interactions(session_id=session_id),
                      key=lambda t: (t.created_at, t.id), reverse=True)  # newest first

    async def _spawned_by(self, row: ThreadRow, sig: Signals, session_id: str,
                          threads: dict[tuple[str, str], ThreadRow]) -> None:
        row.edge = "spawned_by"
        taken = {r.from_call for r in threads.values() if r.from_call}
        found: list[tuple[Any, str]] = []
        for turn in await self._turns(session_id):
            label = _label(turn)
            if sig.parent_thread and label.get("thread") != sig.parent_thread:
                continue
            if sig.parent_turn and label.get("client_turn") not in (None, sig.parent_turn):
                continue
            for call_id, text in spawn_calls(turn.response_message):
                if call_id not in taken and sig.spawn_text is not None and text.strip() == sig.spawn_text.strip():
                    found.append((turn, call_id))
        if sig.parent_thread:
            row.from_thread = sig.parent_thread
        if not found:
            row.status = table.UNLINKED
            row.detail["reason"] = ("no pending spawn call (Agent / spawn_agent) in this episode hands this "
                                    "thread its first task" if sig.spawn_text else "no task text to match")
            return
        turn, call_id = found[0]
        label = _label(turn)
        row.from_turn, row.from_call = turn.id, call_id
        row.from_thread = label.get("thread", row.from_thread)
        row.from_segment = label.get("segment")
        row.status = table.LINKED
        if len(found) > 1:
            row.detail["candidates"] = len(found)

    async def _compacted_from(self, row: ThreadRow, link: EpisodeLink, session_id: str, before: ThreadRow) -> None:
        row.edge, row.from_thread, row.from_segment = "compacted_from", before.thread, before.segment
        row.kind = before.kind
        summarizer = replaced = None
        for turn in await self._turns(session_id):
            label = _label(turn)
            if label.get("thread") != before.thread or label.get("segment") != before.segment:
                continue
            if label.get("role") in ("summarizer", "compaction_trigger"):
                summarizer = summarizer or turn
            elif replaced is None:
                replaced = turn
        if replaced is not None:
            row.detail["replaced_leaf"] = replaced.id
        if summarizer is None:
            row.status = table.UNLINKED
            row.detail["reason"] = "no summarizer turn was recorded in the segment before"
            return
        row.from_turn = summarizer.id
        probe = _summary_probe(summarizer.response_message)
        evidence = link.evidence
        carried = summarizer.id in evidence or (bool(probe) and probe in evidence)
        row.status = table.CONFIRMED if carried else table.LINKED
        if not carried:
            row.detail["note"] = "the new window does not carry the summarizer's text verbatim"

    async def _header_edge(self, row: ThreadRow, sig: Signals, session_id: str) -> None:
        row.edge = "compacted_from" if sig.link == "compaction" else "spawned_by"
        try:
            parent = await self.store.get_interaction(interaction_id=sig.parent_response)
        except store_errors.NotFound:
            parent = None
        if parent is None or parent.session_id != session_id:
            row.status = table.UNLINKED
            row.detail["reason"] = f"X-AgentRL-Parent-Response {sig.parent_response!r} is not a turn of this session"
            return
        label = _label(parent)  # an unlabelled turn (a request without episode signals) is of the main thread
        row.from_turn, row.from_thread = parent.id, label.get("thread") or MAIN
        row.from_segment = label.get("segment") or "0"
        row.status = table.CONFIRMED  # the client named it

    async def _confirm(self, sig: Signals, session_id: str, conf: Confirmation,
                       threads: dict[tuple[str, str], ThreadRow]) -> None:
        rows = [r for r in threads.values() if r.thread == conf.thread and r.edge == "spawned_by"]
        if not rows:
            return  # that thread has not sent a request yet (a background agent): confirmed later
        row = rows[0]
        if row.from_call == conf.call_id:
            if row.status == table.LINKED:
                await table.update(self.store, row, status=table.CONFIRMED)
                self.count(sig, "spawned_by", "confirmed")
            return
        holder = next((t for t in await self._turns(session_id)
                       if any(c == conf.call_id for c, _ in spawn_calls(t.response_message))
                       or any(c.get("id") == conf.call_id for c in t.response_message.get("tool_calls") or [])),
                      None)
        if holder is None:
            return
        label = _label(holder)
        detail = dict(row.detail)
        outcome = "confirmed" if row.status == table.UNLINKED else "relinked"
        if row.from_call:
            detail["relinked_from"] = row.from_call
        await table.update(self.store, row, from_turn=holder.id, from_call=conf.call_id,
                           from_thread=label.get("thread"), from_segment=label.get("segment"),
                           status=table.CONFIRMED, detail=detail)
        self.count(sig, "spawned_by", outcome)


def _evidence(body: Mapping[str, Any]) -> str:
    """The user-side text of a request, where a summary (or this gateway's compaction handle) is looked for."""
    parts: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, str):
            parts.append(value)
        elif isinstance(value, Mapping):
            for k, v in value.items():
                if k in ("text", "content", "encrypted_content"):
                    walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(body.get("messages") if "messages" in body else body.get("input"))
    return "\n".join(parts)
