"""Replay a captured Claude Code / Codex run (``agent_traffic/*.jsonl``) through the gateway.

The captures hold every request the unchanged CLIs sent to a scripted fake server, with their headers. To
replay one through the gateway, the engine behind it must answer what the fake answered, and the requests
must carry what the *gateway* answered (its own tool-call ids, its own compaction items):

- :func:`scripted_replies`: for each request, the model text whose parse is the assistant message the CLI
  sent back in its next request of the same thread (text + ``<tool_call>`` blocks, in the format the chat
  layer parses); a summarizer's reply is the summary the next window carries;
- :class:`Replayer` sends the requests in capture order with their own headers (the key replaced by the
  gateway's agent key) and, after each answer, replaces the fake's ids in every later request by the
  gateway's (tool call ids, the compaction item).

The captures' tools were cut down to names (strings) for size; :func:`usable_tools` turns those back into
minimal valid tools of the request's API, the same way in every request, so that a thread's tools stay
equal from turn to turn (as the CLI's were).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

TRAFFIC = Path(__file__).resolve().parents[4] / "shared" / "agent_traffic"
if not TRAFFIC.exists():  # the working tree is /work/main; the captures are in /work/shared
    TRAFFIC = Path("/work/shared/agent_traffic")
DROP_HEADERS = {"host", "content-length", "accept-encoding", "connection", "x-api-key", "authorization"}
CLAUDE_SUMMARY = re.compile(r"Summary:\n(.*?)\n\nIf you need specific details", re.S)
CODEX_SUMMARY_MARK = "use the information in this summary to assist with your own analysis:\n"


def load(name: str) -> list[dict[str, Any]]:
    """The POST requests of a capture that reached a model route, in arrival order."""
    rows = [json.loads(line) for line in (TRAFFIC / name).read_text().splitlines() if line.strip()]
    return [r for r in rows if r["method"] == "POST" and r["path"] in ("/v1/messages", "/v1/responses")]


def api_of(row: Mapping[str, Any]) -> str:
    return "messages" if row["path"] == "/v1/messages" else "responses"


def thread_of(row: Mapping[str, Any]) -> str:
    h = {k.lower(): v for k, v in row["headers"].items()}
    return h.get("x-claude-code-agent-id") or h.get("thread-id") or "main"


# ----------------------------------------------------------------------------------------------- tools


def _schema(parameters: Any) -> dict[str, Any]:
    if not isinstance(parameters, Mapping):
        return {"type": "object"}
    props = parameters.get("properties")
    if isinstance(props, list):  # cut down to the property names
        return {"type": "object", "properties": {p: {"type": "string"} for p in props},
                "required": list(parameters.get("required") or [])}
    return dict(parameters)


def usable_tools(tools: Any, api: str) -> Any:
    if not isinstance(tools, list):
        return tools
    out = []
    for tool in tools:
        if isinstance(tool, str):
            out.append({"name": tool, "input_schema": {"type": "object"}} if api == "messages"
                       else {"type": "function", "name": tool, "parameters": {"type": "object"}})
        elif isinstance(tool, Mapping) and tool.get("type") == "namespace":
            out.append({**tool, "tools": [{**t, "parameters": _schema(t.get("parameters"))}
                                          for t in tool.get("tools") or []]})
        elif isinstance(tool, Mapping) and tool.get("type") == "function":
            out.append({**tool, "parameters": _schema(tool.get("parameters"))})
        else:
            out.append(tool)
    return out


# --------------------------------------------------------------------------------------------- replies


def _plain(value: Any) -> Any:
    """A conversation item without what clients move around between requests (cache marks, item ids)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()
                if k not in ("cache_control", "id", "status", "internal_chat_message_metadata_passthrough")}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _history(row: Mapping[str, Any]) -> list[Any]:
    body = row["body"]
    return list(body.get("messages") or []) if api_of(row) == "messages" else list(body.get("input") or [])


def tool_call_text(name: str, arguments: Any) -> str:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


def _messages_reply(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    text = "".join(b.get("text", "") for b in content if b.get("type") == "text")
    calls = [tool_call_text(b["name"], b["input"]) for b in content if b.get("type") == "tool_use"]
    return text + ("\n" if text and calls else "") + "\n".join(calls)


def _responses_reply(items: list[Mapping[str, Any]]) -> str:
    text, calls = "", []
    for item in items:
        if item.get("type", "message") == "message" and item.get("role") == "assistant":
            text += "".join(p.get("text", "") for p in item.get("content") or [] if isinstance(p, Mapping))
        elif item.get("type") == "function_call":
            calls.append(tool_call_text(item["name"], item["arguments"]))
        else:
            break
    return text + ("\n" if text and calls else "") + "\n".join(calls)


def _summary_after(rows: list[dict[str, Any]], index: int) -> str | None:
    """The summary the window after request ``index`` (a summarizer) carries, as the model wrote it."""
    thread = thread_of(rows[index])
    for later in rows[index + 1:]:
        if thread_of(later) != thread:
            continue
        raw = json.dumps(later["body"], ensure_ascii=False)
        text = json.loads(raw)  # a copy
        if api_of(later) == "messages":
            for m in text.get("messages") or []:
                for block in m.get("content") if isinstance(m.get("content"), list) else []:
                    found = CLAUDE_SUMMARY.search(block.get("text", "")) if isinstance(block, Mapping) else None
                    if found:
                        return "<analysis>Checked the steps.</analysis>\n<summary>" + found.group(1) + "</summary>"
        else:
            for item in text.get("input") or []:
                for part in item.get("content") or [] if isinstance(item, Mapping) else []:
                    t = part.get("text", "") if isinstance(part, Mapping) else ""
                    if CODEX_SUMMARY_MARK in t:
                        return t.split(CODEX_SUMMARY_MARK, 1)[1]
    return None


def _texts_of(value: Any) -> list[str]:
    if isinstance(value, Mapping):
        return [t for k, v in value.items() for t in ([v] if k == "text" and isinstance(v, str) else _texts_of(v))]
    if isinstance(value, list):
        return [t for v in value for t in _texts_of(v)]
    return []


def role_of(row: Mapping[str, Any]) -> str:
    return str(row.get("fake_role") or "main")


def scripted_replies(rows: list[dict[str, Any]], final: str = "Done.") -> list[str]:
    """The engine's reply for each request (see the module docstring)."""
    replies = []
    for i, row in enumerate(rows):
        reply: str | None = None
        if role_of(row) in ("compaction_summarizer", "remote_compaction_v2"):
            reply = _summary_after(rows, i) or (
                "<analysis>The steps so far worked.</analysis>\n<summary>1. Task: the files the user asked for."
                "\n2. Done so far: the first steps.\n3. Next: the rest, then reply done.</summary>"
                if api_of(row) == "messages" else "SUMMARY: the first steps are done; next: the rest, then done.")
        else:
            mine = [_plain(x) for x in _history(row)]
            for later in rows[i + 1:]:
                if thread_of(later) != thread_of(row) or api_of(later) != api_of(row):
                    continue
                theirs = _history(later)
                if len(theirs) > len(mine) and [_plain(x) for x in theirs[:len(mine)]] == mine:
                    nxt = theirs[len(mine):]
                    if api_of(row) == "messages" and nxt[0].get("role") == "assistant":
                        reply = _messages_reply(nxt[0])
                    elif api_of(row) == "responses":
                        reply = _responses_reply(nxt) or None
                    if reply is not None:
                        break
        if reply is None:
            reply = _by_ids(rows, i)
        replies.append(reply if reply is not None else final)
    return replies


def _by_ids(rows: list[dict[str, Any]], index: int) -> str | None:
    """The reply of request ``index`` found by its tool call ids in a later request of its thread (after a
    compaction the next window re-sends the last round, while no request extends this one)."""
    reply = rows[index].get("fake_reply") or {}
    wanted = set(reply.get("tool_use_ids") or reply.get("call_ids") or [])
    if not wanted:
        return None
    for later in rows[index + 1:]:
        if thread_of(later) != thread_of(rows[index]):
            continue
        history = _history(later)
        for k, item in enumerate(history):
            if api_of(later) == "messages" and item.get("role") == "assistant" and isinstance(item.get("content"), list):
                if wanted & {b.get("id") for b in item["content"] if isinstance(b, Mapping)}:
                    return _messages_reply(item)
            elif api_of(later) == "responses" and item.get("type") == "function_call" and item.get("call_id") in wanted:
                start = k
                while start > 0 and (history[start - 1].get("type") == "function_call" or
                                     history[start - 1].get("role") == "assistant"):
                    start -= 1
                return _responses_reply(history[start:])
    return None


# ---------------------------------------------------------------------------------------------- replay


def sse_events(text: str) -> list[dict[str, Any]]:
    out = []
    for block in text.split("\n\n"):
        data = [line[5:].strip() for line in block.splitlines() if line.startswith("data:")]
        if data and data[0] != "[DONE]":
            out.append(json.loads("".join(data)))
    return out


@dataclass
class Answer:
    id: str
    calls: list[str]  # tool call ids, in order
    text: str
    compactions: list[dict[str, Any]]


def read_answer(api: str, resp: httpx.Response) -> Answer:
    """What the gateway answered, streamed or not."""
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = sse_events(resp.text)
        if api == "messages":
            start = next(e for e in events if e["type"] == "message_start")["message"]
            calls = [e["content_block"]["id"] for e in events
                     if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use"]
            text = "".join(e["delta"].get("text", "") for e in events
                           if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta")
            return Answer(start["id"], calls, text, [])
        final = next(e for e in events if e["type"] in ("response.completed", "response.incomplete"))["response"]
    else:
        final = resp.json()
        if api == "messages":
            return Answer(final["id"], [b["id"] for b in final["content"] if b["type"] == "tool_use"],
                          "".join(b.get("text", "") for b in final["content"] if b["type"] == "text"), [])
    output = final["output"]
    text = "".join(p.get("text", "") for o in output if o["type"] == "message" for p in o["content"])
    return Answer(final["id"], [o["call_id"] for o in output if o["type"] == "function_call"], text,
                  [o for o in output if o["type"] == "compaction"])


def _marker_parts(name: str, start: str, end: str | None) -> tuple[str, str]:
    """The text around the summary in a marker file (the CLI's own wording of a summary's window)."""
    text = (TRAFFIC / "markers" / name).read_text()
    text = text.split("---- next text block ----\n", 1)[-1]
    head, _, rest = text.partition(start)
    tail = rest[rest.index(end):] if end else ""
    return head + start, tail.rstrip("\n")


CLAUDE_WINDOW = _marker_parts("claude_post_compaction_first_user_message.txt", "Summary:\n",
                              "\n\nIf you need specific details")
CODEX_WINDOW = _marker_parts("codex_post_compaction_summary_message.txt", CODEX_SUMMARY_MARK, None)


@dataclass
class Replayer:
    http: httpx.AsyncClient
    key: str
    rows: list[dict[str, Any]]
    prefix: str = ""  # e.g. "/sessions/<id>" for a session's base URL
    ids: dict[str, str] = field(default_factory=dict)  # the fake's id -> the gateway's
    answers: list[str] = field(default_factory=list)  # the gateway's response id of each request

    def body(self, row: Mapping[str, Any]) -> dict[str, Any]:
        raw = json.dumps(row["body"], ensure_ascii=False)
        for fake, ours in self.ids.items():  # as JSON string contents (texts hold quotes and newlines)
            raw = raw.replace(json.dumps(fake, ensure_ascii=False)[1:-1], json.dumps(ours, ensure_ascii=False)[1:-1])
        body = json.loads(raw)
        body["tools"] = usable_tools(body.get("tools"), api_of(row))
        return body

    def headers(self, row: Mapping[str, Any]) -> dict[str, str]:
        h = {k: v for k, v in row["headers"].items() if k.lower() not in DROP_HEADERS}
        if "x-codex-turn-metadata" in {k.lower() for k in h}:
            h = {k: v for k, v in h.items() if k.lower() != "x-codex-turn-metadata"}
            h["x-codex-turn-metadata"] = json.dumps(row["headers_parsed"]["x-codex-turn-metadata"])
        if api_of(row) == "messages":
            h["x-api-key"] = self.key
        else:
            h["Authorization"] = f"Bearer {self.key}"
        return h

    async def send(self, index: int) -> httpx.Response:
        row = self.rows[index]
        query = "?" + row["query"] if row.get("query") else ""
        resp = await self.http.post(self.prefix + row["path"] + query, json=self.body(row), headers=self.headers(row))
        assert resp.status_code == 200, (index, resp.status_code, resp.text[:2000])
        answer = read_answer(api_of(row), resp)
        self.answers.append(answer.id)
        reply = row.get("fake_reply") or {}
        fake_calls = reply.get("tool_use_ids") or reply.get("call_ids") or []
        assert len(fake_calls) == len(answer.calls), (index, fake_calls, answer.calls)
        self.ids.update({f: o for f, o in zip(fake_calls, answer.calls) if f != o})
        if answer.compactions:
            self._map_compaction(index, answer.compactions[0])
        if role_of(row) == "compaction_summarizer":
            self._map_summary(index, answer.text)
        return resp

    def _map_summary(self, index: int, text: str) -> None:
        """The next window's summary message (cut short in the capture) -> the CLI's wording around the
        summary this gateway's model wrote."""
        if "<summary>" in text:
            text = text.split("<summary>", 1)[1].split("</summary>", 1)[0]
        thread = thread_of(self.rows[index])
        for later in self.rows[index + 1:]:
            if thread_of(later) != thread:
                continue
            for old in _texts_of(later["body"]):
                if old.startswith(CLAUDE_WINDOW[0][:60]) and "Summary:" in old:
                    self.ids[old] = CLAUDE_WINDOW[0] + text + CLAUDE_WINDOW[1]
                elif old.startswith(CODEX_WINDOW[0][:60]):
                    self.ids[old] = CODEX_WINDOW[0] + text

    def _map_compaction(self, index: int, item: Mapping[str, Any]) -> None:
        """The fake's compaction item in later requests -> the gateway's (found by its type)."""
        for later in self.rows[index + 1:]:
            for old in later["body"].get("input") or []:
                if isinstance(old, Mapping) and old.get("type") == "compaction":
                    self.ids[old["encrypted_content"]] = item["encrypted_content"]
                    if old.get("id"):
                        self.ids[old["id"]] = item["id"]
                    return

    async def run(self) -> list[str]:
        for index in range(len(self.rows)):
            await self.send(index)
        return self.answers
