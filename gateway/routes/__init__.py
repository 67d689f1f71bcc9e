"""HTTP routes: thin functions that parse, call a service and render JSON or SSE.

``ROUTER_MODULES`` is the one list of route modules the app includes (each exposes ``router``); a
component that adds routes (trajectory leasing) appends its module here. ``openai`` is also mounted under
``/sessions/{session_id}`` so that a session can be addressed by base URL.
"""

from __future__ import annotations

import importlib

from fastapi import APIRouter

ROUTER_MODULES: list[str] = [
    "gateway.routes.openai",
    "gateway.routes.responses",
    "gateway.routes.messages",
    "gateway.routes.sessions",
    "gateway.routes.groups",
    "gateway.routes.rewards",
    "gateway.routes.admin",
    "gateway.routes.health",
    "gateway.routes.trajectories",
    "gateway.routes.ui",
    "gateway.episodes.routes",  # an episode's threads and edges (issue 33)
]

SESSION_PREFIX = "/sessions/{session_id}"  # the same OpenAI routes, bound to one session by URL
SESSION_MOUNTED = ("gateway.routes.openai", "gateway.routes.responses", "gateway.routes.messages")


def routers() -> list[tuple[APIRouter, str]]:
    """(router, prefix) pairs in inclusion order."""
    out: list[tuple[APIRouter, str]] = []
    for name in ROUTER_MODULES:
        router = importlib.import_module(name).router
        out.append((router, ""))
        if name in SESSION_MOUNTED:
            out.append((router, SESSION_PREFIX))
    return out
