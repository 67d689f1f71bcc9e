"""Threads of real agents' episodes: one row per thread segment, with its typed edge (issue 33).

A coding CLI's run is one episode made of several token-exact chains: the main agent, its sub-agents
(``spawned_by`` the turn and tool call that started them) and, after a compaction, a new window
(``compacted_from`` the segment the summary replaced). Each turn records its own thread label with its
request; this table holds the segments and edges (``gateway.episodes.table``).

Revision ID: 0006_episode_threads
Revises: 0005_lifecycle_indexes
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_episode_threads"
down_revision: str | None = "0005_lifecycle_indexes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "episode_threads",
        sa.Column("session_id", sa.String(64), sa.ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("thread", sa.String(255), primary_key=True),
        sa.Column("segment", sa.String(64), primary_key=True),
        sa.Column("client", sa.String(32), nullable=False),
        sa.Column("episode_key", sa.String(255), nullable=True),
        sa.Column("owner", sa.String(64), nullable=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("first_turn", sa.String(64), nullable=False),
        sa.Column("edge", sa.String(16), nullable=True),
        sa.Column("from_thread", sa.String(255), nullable=True),
        sa.Column("from_segment", sa.String(64), nullable=True),
        sa.Column("from_turn", sa.String(64), nullable=True),
        sa.Column("from_call", sa.String(255), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("detail", sa.JSON, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_index("ix_episode_threads_key", "episode_threads", ["episode_key", "owner"])


def downgrade() -> None:
    op.drop_index("ix_episode_threads_key", table_name="episode_threads")
    op.drop_table("episode_threads")
