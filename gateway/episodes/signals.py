"""What a request says about its place in an agent's episode, read from its headers and body alone.

Pure functions, no I/O: :func:`read_signals` turns one request into :class:`Signals`, which the linker
(``gateway.episodes.linker``) resolves against what the store holds. Only signals the clients really send
are used; they were observed in the captures of ``agent_traffic/`` (Claude Code 2.1.197, Codex CLI 0.171.0,
see ``docs/coding-agents.md``):

- **Claude Code** (Messages API): ``X-Claude-Code-Session-Id`` is shared by the main agent and every
  sub-agent of one run; a sub-agent's requests add ``x-claude-code-agent-id`` (its thread). Its first user
  message ends with the ``prompt`` of the ``Agent`` tool call that started it. A summarizer request ends its
  last user message with the compaction instruction ("CRITICAL: Respond with TEXT ONLY ... create a detailed
  summary of the conversation so far"); the requests after a compaction start with "This session is being
  continued from a previous conversation that ran out of context" (each compaction's text differs, so its
  digest names the segment). A ``tool_result`` of an ``Agent`` call names the sub-agent (``agentId: ...``),
  and so does a background agent's ``<task-notification>`` (with the call's id).
- **Codex** (Responses API): ``session-id`` is the root thread, ``thread-id`` this thread,
  ``x-codex-parent-thread-id`` the spawning thread; ``x-codex-turn-metadata`` (JSON) carries ``turn_id``,
  ``parent_turn_id``, ``request_kind`` (``compaction`` for a local summarizer request) and the window
  (``window_number``, also the ``:N`` suffix of ``x-codex-window-id``), which moves on at each compaction.
  Remote compaction v2 ends its input with ``{"type": "compaction_trigger"}``. A ``function_call_output``
  of ``spawn_agent`` names the child thread (``{"agent_id": ...}``).
- **Any other client**: ``X-AgentRL-Parent-Response: <response id>`` names the turn that started this
  thread, ``X-AgentRL-Link: spawn | compaction`` says how (default ``spawn``) and ``X-AgentRL-Thread`` names
  the thread (default: one thread per parent response).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PARENT_HEADER = "x-agentrl-parent-response"
LINK_HEADER = "x-agentrl-link"
THREAD_HEADER = "x-agentrl-thread"
LINK_KINDS = ("spawn", "compaction")

CLAUDE_SESSION = "x-claude-code-session-id"
CLAUDE_AGENT = "x-claude-code-agent-id"
# the compaction instruction block starts so (its full text, 5,978 chars, then asks for "a detailed summary
# of the conversation so far"; the start alone is matched, so that a shortened copy is still recognised)
CLAUDE_SUMMARIZE = "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools."
CLAUDE_CONTINUED = "This session is being continued from a previous conversation that ran out of context"
CLAUDE_AGENT_TOOL = "Agent"
_AGENT_ID = re.compile(r"agentId: (a[0-9a-f]{16})\b")
_TASK_ID = re.compile(r"<task-id>([^<]+)</task-id>")
_TASK_CALL = re.compile(r"<tool-use-id>([^<]+)</tool-use-id>")

CODEX_SESSION = "session-id"
CODEX_THREAD = "thread-id"
CODEX_PARENT = "x-codex-parent-thread-id"
CODEX_METADATA = "x-codex-turn-metadata"
CODEX_WINDOW = "x-codex-window-id"
CODEX_SPAWN_TOOL = "spawn_agent"

MAIN = "main"  # the thread key of Claude Code's main agent (its requests carry no agent id)


@dataclass(frozen=True, slots=True)
class Confirmation:
    """A later request says which thread a tool call started: ``call_id`` started thread ``thread``."""

    call_id: str
    thread: str


@dataclass(slots=True)
class Signals:
    """One request's episode signals. ``client`` None: nothing to link (an ordinary request)."""

    client: str | None = None  # "claude_code" | "codex" | "header"
    episode: str | None = None  # the client's id of the whole run (Claude session id, Codex session-id)
    thread: str = MAIN  # the client's id of this agent (Claude agent id or "main", Codex thread-id, header)
    segment: str = "0"  # which context window of the thread ("0" until the first compaction)
    role: str = "turn"  # "turn" | "summarizer" (its output replaces the history) | "compaction_trigger"
    parent_thread: str | None = None  # the spawning thread, when the client names it (Codex)
    parent_turn: str | None = None  # the client's id of the spawning turn (Codex parent_turn_id)
    client_turn: str | None = None  # the client's id of this turn (Codex turn_id)
    spawn_text: str | None = None  # the text a spawning call handed this thread (its first task)
    parent_response: str | None = None  # X-AgentRL-Parent-Response
    link: str = "spawn"  # X-AgentRL-Link
    confirmations: list[Confirmation] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # signals present but unreadable (shown, counted)

    def label(self) -> dict[str, Any]:
        """What the turn records about its thread (``request.episode``)."""
        out: dict[str, Any] = {"client": self.client, "thread": self.thread, "segment": self.segment,
                               "role": self.role}
        if self.client_turn:
            out["client_turn"] = self.client_turn
        return out


def _lower(headers: Mapping[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def read_signals(headers: Mapping[str, str], body: Mapping[str, Any], api: str) -> Signals:
    """The signals of one request; ``api`` is ``"messages"`` or ``"responses"``."""
    h = _lower(headers)
    if h.get(CLAUDE_SESSION) and api == "messages":
        return _claude(h, body)
    if h.get(CODEX_SESSION) and h.get(CODEX_THREAD) and api == "responses":
        return _codex(h, body)
    if h.get(PARENT_HEADER) or h.get(THREAD_HEADER):
        return _header(h)
    return Signals()


# ------------------------------------------------------------------------------------------ Claude Code


def _blocks(content: Any) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [b for b in content if isinstance(b, Mapping)] if isinstance(content, list) else []


def _texts(content: Any) -> list[str]:
    return [b["text"] for b in _blocks(content) if b.get("type") == "text" and isinstance(b.get("text"), str)]


def _result_text(block: Mapping[str, Any]) -> str:
    inner = block.get("content")
    return inner if isinstance(inner, str) else "\n".join(_texts(inner))


def _claude(h: dict[str, str], body: Mapping[str, Any]) -> Signals:
    sig = Signals(client="claude_code", episode=h[CLAUDE_SESSION].strip())
    agent = h.get(CLAUDE_AGENT, "").strip()
    sig.thread = agent or MAIN
    messages = [m for m in body.get("messages") or [] if isinstance(m, Mapping)]
    users = [m for m in messages if m.get("role") == "user"]
    if users:
        first = _texts(users[0].get("content"))
        continued = next((t for t in first if CLAUDE_CONTINUED in t), None)
        if continued is not None:  # a compacted window: its summary text names it
            sig.segment = "c" + hashlib.sha256(continued.encode()).hexdigest()[:16]
        if agent and first:
            sig.spawn_text = first[-1]
        last = _texts(users[-1].get("content"))
        spoken = [m for m in messages if m.get("role") != "system"]
        if spoken[-1] is users[-1] and any(t.startswith(CLAUDE_SUMMARIZE) for t in last):
            sig.role = "summarizer"
    # tool results and task notifications name the sub-agents that calls started
    for m in users:
        for block in _blocks(m.get("content")):
            if block.get("type") == "tool_result" and isinstance(block.get("tool_use_id"), str):
                found = _AGENT_ID.search(_result_text(block))
                if found:
                    sig.confirmations.append(Confirmation(block["tool_use_id"], found.group(1)))
            elif block.get("type") == "text" and "<task-notification>" in str(block.get("text")):
                task, call = _TASK_ID.search(block["text"]), _TASK_CALL.search(block["text"])
                if task and call:
                    sig.confirmations.append(Confirmation(call.group(1).strip(), task.group(1).strip()))
    return sig


# ------------------------------------------------------------------------------------------------ Codex


def _metadata(h: dict[str, str], sig: Signals) -> dict[str, Any]:
    raw = h.get(CODEX_METADATA)
    if not raw:
        return {}
    try:
        meta = json.loads(raw)
    except ValueError:
        sig.problems.append("x-codex-turn-metadata is not JSON")
        return {}
    return meta if isinstance(meta, dict) else {}


def _item_text(item: Mapping[str, Any]) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    return "".join(str(p.get("text", "")) for p in content or [] if isinstance(p, Mapping))


def _codex(h: dict[str, str], body: Mapping[str, Any]) -> Signals:
    sig = Signals(client="codex", episode=h[CODEX_SESSION].strip(), thread=h[CODEX_THREAD].strip())
    meta = _metadata(h, sig)
    sig.parent_thread = (h.get(CODEX_PARENT) or meta.get("parent_thread_id") or None)
    sig.parent_turn = meta.get("parent_turn_id") if isinstance(meta.get("parent_turn_id"), str) else None
    sig.client_turn = meta.get("turn_id") if isinstance(meta.get("turn_id"), str) else None
    window = meta.get("window_number")
    if not isinstance(window, int):
        suffix = h.get(CODEX_WINDOW, "").rpartition(":")[2]
        window = int(suffix) if suffix.isdigit() else 0
    sig.segment = str(window)
    items = body.get("input")
    items = [i for i in items if isinstance(i, Mapping)] if isinstance(items, list) else []
    if meta.get("request_kind") == "compaction":
        sig.role = "summarizer"
    if items and items[-1].get("type") == "compaction_trigger":
        sig.role = "compaction_trigger"
    if sig.parent_thread:
        users = [i for i in items if i.get("type", "message") == "message" and i.get("role") == "user"]
        if users:
            sig.spawn_text = _item_text(users[-1])
    for item in items:
        if item.get("type") == "function_call_output" and isinstance(item.get("call_id"), str):
            output = item.get("output")
            try:
                parsed = json.loads(output) if isinstance(output, str) else None
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and isinstance(parsed.get("agent_id"), str):
                sig.confirmations.append(Confirmation(item["call_id"], parsed["agent_id"]))
    return sig


# ----------------------------------------------------------------------------------------- other clients


def _header(h: dict[str, str]) -> Signals:
    parent = h.get(PARENT_HEADER, "").strip() or None
    sig = Signals(client="header", parent_response=parent)
    link = h.get(LINK_HEADER, "spawn").strip().lower() or "spawn"
    if link not in LINK_KINDS:
        sig.problems.append(f"{LINK_HEADER} {link!r} is not one of {', '.join(LINK_KINDS)}")
        link = "spawn"
    sig.link = link
    # a spawned thread is named after its parent response; a compacted one keeps its thread (the parent
    # response's, filled in by the linker, which reads that turn)
    sig.thread = h.get(THREAD_HEADER, "").strip() or (
        "" if link == "compaction" and parent else f"child-of-{parent}" if parent else MAIN)
    if link == "compaction":
        sig.segment = "after-" + (parent or "?")
    return sig


# ------------------------------------------------------------------------------- calls in a model's answer


def spawn_calls(message: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(call id, task text)`` of every call in a returned assistant message that starts a sub-agent:
    Claude Code's ``Agent`` (its ``prompt``) and Codex's ``spawn_agent`` (its ``message``)."""
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        key = {CLAUDE_AGENT_TOOL: "prompt", CODEX_SPAWN_TOOL: "message"}.get(fn.get("name"))
        if key is None:
            continue
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            continue
        if isinstance(args, dict) and isinstance(args.get(key), str) and isinstance(call.get("id"), str):
            out.append((call["id"], args[key]))
    return out
