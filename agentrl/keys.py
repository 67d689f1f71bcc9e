"""Keys that `agentrl up`, `serve` and `eval` make for the processes they start.

A key travels on a child's command line. ``secrets.token_urlsafe`` draws from ``A-Z a-z 0-9 - _``, so one
key in 64 starts with ``-``, and argparse then reads it as an option (``agentrl gateway: error: argument
--admin-key: expected one argument``, seen on 2026-12-04). Every key made here starts with its role, a
word of letters, so it can never look like an option; the command lines pass it as ``--flag=value`` too
(:func:`agentrl.procs.flags`), which also holds for a key a user chose.
"""

from __future__ import annotations

import secrets

ROLES = ("admin", "agent", "runner")


def new_key(role: str) -> str:
    """``<role>-<22 random URL-safe characters>`` (128 bits); ``role`` is one of :data:`ROLES`."""
    if role not in ROLES:
        raise ValueError(f"unknown key role {role!r}; one of {ROLES}")
    return f"{role}-{secrets.token_urlsafe(16)}"
