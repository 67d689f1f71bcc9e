"""Indexes for the lifecycle tick, so that its cost follows the live sessions, not the history.

The tick (``gateway.lifecycle``) selects the sessions of groups that have a finished or a quiet active
session (``Store.lifecycle_sessions``: the ``status`` and ``group_id`` indexes of 0001 serve it; the new
``(status, last_activity_at)`` index finds quiet active sessions without reading every active one) and the
open groups older than the group timeout (``Store.open_groups``: ``session_groups`` had no index, so every
tick read every group ever admitted).

Revision ID: 0005_lifecycle_indexes
Revises: 0004_groups
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005_lifecycle_indexes"
down_revision: str | None = "0004_groups"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_sessions_status_activity", "sessions", ["status", "last_activity_at"])
    op.create_index("ix_session_groups_status_created", "session_groups", ["status", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_session_groups_status_created", table_name="session_groups")
    op.drop_index("ix_sessions_status_activity", table_name="sessions")
