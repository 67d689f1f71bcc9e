"""Initial store: sessions, interactions (turn tree with packed token arrays), reward audit.

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001_initial"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("group_id", sa.String(255), nullable=False),
        sa.Column("task_id", sa.String(255), nullable=True),
        sa.Column("metadata", sa.JSON, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("is_eval", sa.Boolean, nullable=False),
        sa.Column("reward", sa.Float, nullable=True),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("finished_at", sa.Float, nullable=True),
        sa.Column("last_activity_at", sa.Float, nullable=False),
        sa.UniqueConstraint("key_hash", name="uq_sessions_key_hash"),
    )
    op.create_index("ix_sessions_group_id", "sessions", ["group_id"])
    op.create_index("ix_sessions_status", "sessions", ["status"])

    op.create_table(
        "interactions",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column(
            "session_id",
            sa.String(64),
            sa.ForeignKey("sessions.id", ondelete="CASCADE", name="fk_interactions_session"),
            nullable=False,
        ),
        sa.Column(
            "parent_id", sa.String(64), sa.ForeignKey("interactions.id", name="fk_interactions_parent"), nullable=True
        ),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("request", sa.JSON, nullable=False),
        sa.Column("response_message", sa.JSON, nullable=False),
        sa.Column("prompt_ids", sa.LargeBinary, nullable=False),
        sa.Column("bridge_len", sa.Integer, nullable=False),
        sa.Column("output_ids", sa.LargeBinary, nullable=False),
        sa.Column("output_logprobs", sa.LargeBinary, nullable=False),
        sa.Column("output_versions", sa.LargeBinary, nullable=False),
        sa.Column("finish_reason", sa.String(16), nullable=False),
        sa.Column("reward", sa.Float, nullable=True),
        sa.Column("chain_hash", sa.String(128), nullable=False),
        sa.Column("request_hash", sa.String(128), nullable=False),
        sa.Column("root_reason", sa.String(64), nullable=True),
        sa.Column("timings", sa.JSON, nullable=False),
    )
    op.create_index("ix_interactions_parent_id", "interactions", ["parent_id"])
    op.create_index("ix_interactions_session_chain", "interactions", ["session_id", "chain_hash"])
    op.create_index("ix_interactions_session_created", "interactions", ["session_id", "created_at"])
    op.create_index("ix_interactions_chain_hash", "interactions", ["chain_hash"])  # implicit-mode lookups

    op.create_table(
        "reward_events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column(
            "session_id",
            sa.String(64),
            sa.ForeignKey("sessions.id", ondelete="CASCADE", name="fk_reward_events_session"),
            nullable=False,
        ),
        sa.Column(
            "interaction_id",
            sa.String(64),
            sa.ForeignKey("interactions.id", name="fk_reward_events_interaction"),
            nullable=True,
        ),
        sa.Column("reward", sa.Float, nullable=False),
        sa.Column("source", sa.String(255), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_index("ix_reward_events_session", "reward_events", ["session_id"])
    op.create_index("ix_reward_events_interaction", "reward_events", ["interaction_id"])


def downgrade() -> None:
    op.drop_table("reward_events")
    op.drop_table("interactions")
    op.drop_table("sessions")
