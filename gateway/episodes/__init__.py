"""Episodes of real agents: sub-agent threads, compaction segments and their typed edges (issue 33).

``signals`` reads what a request says (Claude Code's and Codex's own headers and bodies, or this gateway's
``X-AgentRL-*`` headers); ``linker`` places the request in its episode (session, thread, edge) and records
the threads in ``episode_threads`` (``table``); ``compaction`` serves Codex's remote compaction v2;
``export`` gives every row of an episode the episode's reward. See ``docs/coding-agents.md``.

The routes call :func:`link_request` before the conversation core and the returned link's ``recorded`` /
``watch`` after it; nothing else of the gateway depends on this package.
"""

from __future__ import annotations

from typing import Any

from gateway.episodes.linker import EpisodeLink


async def link_request(request: Any, svc: Any, who: Any, session: Any, req: Any, api: str) -> EpisodeLink:
    """The episode link of a Messages (``api="messages"``), Responses (``"responses"``) or chat completions
    (``"chat"``: only the ``X-AgentRL-*`` headers are read there) request."""
    body = {"input": req.input} if api == "responses" else {"messages": req.messages}
    return await svc.episodes.link(request.headers, body, api, session=session, owner=who.owner,
                             implicit_allowed=session is None and who.role in ("agent", "admin"))


__all__ = ["EpisodeLink", "link_request"]
