"""The trace viewer's session page: the episode's threads and segments, drawn as a tree of edges.

A segment hangs under the segment its edge comes from: a sub-agent thread under the segment whose turn
spawned it (``spawned_by``, with that turn and tool call), a compacted window under the window it replaced
(``compacted_from``, with the summarizer turn). Segments whose edge could not be made stand at the top,
marked unlinked with the reason. Rendered by ``templates/_threads.html`` on ``/ui/sessions/{id}``.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from gateway.episodes import table


def thread_tree(rows: list[table.ThreadRow]) -> list[dict[str, Any]]:
    nodes = {(r.thread, r.segment): {**r.as_dict(), "children": []} for r in rows}
    top: list[dict[str, Any]] = []
    for r in rows:
        node = nodes[(r.thread, r.segment)]
        parent = nodes.get((r.from_thread or "", r.from_segment or "")) if r.edge else None
        if parent is not None and parent is not node:
            parent["children"].append(node)
        else:
            top.append(node)
    return top


async def with_threads(store: Any, session_id: str, detail: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """The session page's data (``gateway.ui.views.session_detail``) plus its threads."""
    data = await detail
    rows = await table.session_threads(store, session_id)
    data["threads"] = thread_tree(rows)
    data["threads_unlinked"] = sum(r.status == table.UNLINKED for r in rows)
    return data
