"""Remote compaction v2 on the Responses API: answer ``compaction_trigger`` with one ``compaction`` item.

Codex with OpenAI's built-in provider does not summarise its history itself: it sends an ordinary
``POST /v1/responses`` whose input ends with ``{"type": "compaction_trigger"}`` and requires **exactly one**
output item of type ``compaction`` (``openai.types.responses.ResponseCompactionItem``: ``id``,
``encrypted_content``, ``type``); any other answer fails its turn. Its next request's input then carries that
item verbatim in place of the history.

Here the model itself writes the summary, as an ordinary recorded turn of the episode (so it is trained
with the rest): the trigger becomes a user message asking for a hand-off summary (:data:`TRIGGER_PROMPT`),
the turn is generated with ``tool_choice: "none"`` (text only, tools still in the prompt so that the turn
continues its thread token-exact), and the answer is rendered as one ``compaction`` item whose
``encrypted_content`` is :func:`handle`: this gateway's marker, the summarizer turn's id and the summary
text (base64url). It is not encrypted (the client holds the history it stands for anyway); it is
self-contained, so any replica can expand it without a lookup. A ``compaction`` item in a later input is
expanded back into a user message holding the summary (:data:`SUMMARY_PREFIX` + text); one this gateway did
not mint is refused with 400 (there is nothing to expand it into). What the item stands for is recorded
twice: the summarizer turn (its output is the summary) and the next window's ``compacted_from`` edge, which
names that turn (``gateway.episodes.linker``).
"""

from __future__ import annotations

import base64
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from gateway.errors import GatewayError, InvalidRequest

HANDLE_PREFIX = "agentrl.compaction.v1."
TRIGGER_PROMPT = (
    "Your context window is about to be replaced by a summary that you write now. Write a hand-off summary "
    "for yourself to continue the task from: the task, what has been done so far and its results, decisions "
    "made, and the next steps. Plain text only; do not call any tool.")
SUMMARY_PREFIX = "Summary of the earlier part of this task, written before the context was compacted:\n\n"


def handle(turn_id: str, summary: str) -> str:
    """``agentrl.compaction.v1.<turn id>.<base64url of the summary>`` (the turn id stays readable, so that
    the linker finds it in the next window without decoding)."""
    return HANDLE_PREFIX + turn_id + "." + base64.urlsafe_b64encode(summary.encode()).decode().rstrip("=")


def expand(content: object, param: str) -> tuple[str, str]:
    """``(turn id, summary)`` of a handle minted by :func:`handle`; 400 for anything else."""
    if not isinstance(content, str) or not content.startswith(HANDLE_PREFIX):
        raise InvalidRequest("a compaction item's encrypted_content must be one this gateway returned (it "
                             "expands it into the summary it stands for)", param=param)
    turn_id, dot, body = content[len(HANDLE_PREFIX):].partition(".")
    try:
        if not dot or not turn_id:
            raise ValueError("no turn id")
        return turn_id, base64.b64decode(body + "=" * (-len(body) % 4), altchars=b"-_", validate=True).decode()
    except ValueError as exc:  # binascii.Error and UnicodeDecodeError are ValueErrors
        raise InvalidRequest("a compaction item's encrypted_content is damaged", param=param) from exc


def prepare(req: Any) -> tuple[Any, bool]:
    """The request with ``compaction_trigger`` / ``compaction`` input items replaced by the messages they
    stand for, and whether it is a compaction request (its answer must be one ``compaction`` item)."""
    items = req.input
    if not isinstance(items, list) or not any(isinstance(i, Mapping) and i.get("type") in
                                              ("compaction", "compaction_trigger") for i in items):
        return req, False
    out: list[Any] = []
    trigger = False
    for index, item in enumerate(items):
        kind = item.get("type") if isinstance(item, Mapping) else None
        if kind == "compaction_trigger":
            if index != len(items) - 1:
                raise InvalidRequest("compaction_trigger must be the final input item", param=f"input[{index}]")
            out.append({"type": "message", "role": "user", "content": TRIGGER_PROMPT})
            trigger = True
        elif kind == "compaction":
            _, summary = expand(item.get("encrypted_content"), f"input[{index}].encrypted_content")
            out.append({"type": "message", "role": "user", "content": SUMMARY_PREFIX + summary})
        else:
            out.append(item)
    return req.model_copy(update={"input": out}), trigger


def item(turn_id: str, message: Mapping[str, Any]) -> dict[str, Any]:
    """The one output item of a compaction request (``ResponseCompactionItem``)."""
    summary = str(message.get("content") or "")
    return {"id": "cmp_" + turn_id.split("_", 1)[-1], "type": "compaction",
            "encrypted_content": handle(turn_id, summary), "created_by": "agentrl-gateway"}


def render(fmt: Any, req: Any, run: Any, prompt_len: int, model: str, created_at: float) -> dict[str, Any]:
    """A finished compaction turn as a ``Response`` with exactly one ``compaction`` output item."""
    res = run.result
    return fmt.response_object(req, run.id, model, created_at, "completed", [item(run.id, res.message())],
                               fmt.usage(prompt_len, len(res.output_ids)))


async def stream(fmt: Any, req: Any, run: Any, prompt_len: int, model: str,
                 events: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """The compaction turn as server-sent events: ``response.created``, then (once recorded)
    ``response.output_item.added`` / ``.done`` with the item and ``response.completed``; an error ends it
    with ``response.failed``. Nothing of the summary streams before it is recorded (it is one opaque item)."""
    created = time.time()
    seq = 0

    def event(kind: str, **body: Any) -> bytes:
        nonlocal seq
        payload = {"type": kind, "sequence_number": seq, **body}
        seq += 1
        return fmt.sse(kind, payload)

    def snapshot(status: str, output: list[dict[str, Any]], usage: Any = None, error: Any = None) -> dict[str, Any]:
        return fmt.response_object(req, run.id, model, created, status, output, usage, None, error)

    try:
        yield event("response.created", response=snapshot("in_progress", []))
        yield event("response.in_progress", response=snapshot("in_progress", []))
        async for ev in events:
            if ev.kind == "recorded":
                break
        res = run.result
        out = item(run.id, res.message())
        yield event("response.output_item.added", output_index=0, item=out)
        yield event("response.output_item.done", output_index=0, item=out)
        yield event("response.completed", response=snapshot("completed", [out],
                                                            fmt.usage(prompt_len, len(res.output_ids))))
    except GatewayError as exc:
        error = {"code": "server_error" if exc.status >= 500 else "invalid_prompt", "message": exc.message}
        yield event("response.failed", response=snapshot("failed", [], error=error))
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
