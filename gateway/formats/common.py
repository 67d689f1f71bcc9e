"""Helpers the wire formats share: SSE framing, a stored turn's whole conversation."""

from __future__ import annotations

import logging
from typing import Any

from gateway import jsonio
from gateway.binding import Caller, load_session, may_access_session
from gateway.errors import InvalidRequest, NotFound, from_store_error
from gateway.store import Interaction, Store
from gateway.store import errors as store_errors

log = logging.getLogger("agentrl.gateway.formats")


def dumps(value: Any) -> str:
    return jsonio.dumps_str(value)


def sse(event: str, data: Any) -> bytes:
    """One server-sent event with a name (both OpenAI's Responses and Anthropic's streams name events)."""
    return f"event: {event}\ndata: {dumps(data)}\n\n".encode()


async def load_turn(store: Store, who: Caller, turn_id: str, param: str) -> Interaction:
    """A recorded turn the caller may see (404 if unknown, 403 if it is another session's)."""
    try:
        turn = await store.get_interaction(interaction_id=turn_id)
    except store_errors.NotFound:
        raise NotFound(f"no response with id {turn_id!r}", param=param) from None
    except store_errors.StoreError as exc:
        raise from_store_error(exc) from exc
    may_access_session(who, await load_session(store, turn.session_id))
    return turn


async def conversation_of(store: Store, turn: Interaction, param: str) -> list[dict[str, Any]]:
    """The whole conversation up to and including ``turn``'s returned message: its root-to-turn path's
    recorded messages (each child recorded only the messages new beyond its parent) and returned messages."""
    try:
        path = await store.path(interaction_id=turn.id)
    except store_errors.StoreError as exc:
        raise from_store_error(exc) from exc
    messages: list[dict[str, Any]] = []
    for step in path:
        new = step.request.get("messages")
        if not isinstance(new, list):
            raise InvalidRequest(f"response {turn.id!r} is a text completion; it has no conversation to continue",
                                 param=param)
        messages += new
        messages.append(step.response_message)
    return messages


def unsupported_tool(kind: object, param: str, reject: bool, dropped: list[str]) -> None:
    """A tool the gateway cannot serve (hosted/server tools): 400 with ``--unsupported-tools reject``, else
    left out of the prompt with a warning and listed in the recorded request's ``dropped``."""
    message = (f"tool type {kind!r} cannot be served by this gateway (it serves function tools, which the "
               "agent executes)")
    if reject:
        raise InvalidRequest(message + "; remove it, or run the gateway with --unsupported-tools drop",
                             param=f"{param}.type", code="unsupported_tool")
    log.warning("%s: %s; dropped from the prompt", param, message)
    dropped.append(f"{param}: tool type {kind!r}")
