"""Indexes for browsing sessions newest first (the trace viewer's list, keyset pagination).

``ix_sessions_created_id`` serves the unfiltered list and the time filters; ``ix_sessions_status_created``
serves a status filter (which is most of what people ask for) without sorting. Both end in ``id`` so
that the keyset ``(created_at, id) < (:c, :id)`` is one index range scan. A group filter uses the
existing ``ix_sessions_group_id`` (a group holds few sessions).

Revision ID: 0003_session_browse_indexes
Revises: 0002_trajectories
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0003_session_browse_indexes"
down_revision: str | None = "0002_trajectories"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_sessions_created_id", "sessions", ["created_at", "id"])
    op.create_index("ix_sessions_status_created", "sessions", ["status", "created_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_sessions_status_created", table_name="sessions")
    op.drop_index("ix_sessions_created_id", table_name="sessions")
