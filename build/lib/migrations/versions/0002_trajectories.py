"""Trajectory export: the SQL trajectory queue, its leases, and the trainer state for staleness control.

The queue tables are used when the gateway runs without Redis (with Redis the queue is a Redis stream);
``trainer_state`` is used in both cases (admission is one atomic UPDATE on it).

Revision ID: 0002_trajectories
Revises: 0001_initial
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_trajectories"
down_revision: str | None = "0001_initial"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "trajectory_queue",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("group_key", sa.String(64), nullable=False),
        sa.Column("group_id", sa.String(255), nullable=False),
        sa.Column("session_ids", sa.JSON, nullable=False),
        sa.Column("payload", sa.LargeBinary, nullable=False),
        sa.Column("n_rows", sa.Integer, nullable=False),
        sa.Column("n_tokens", sa.Integer, nullable=False),
        sa.Column("min_version", sa.Integer, nullable=False),
        sa.Column("complete", sa.Boolean, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("lease_id", sa.String(64), nullable=True),
        sa.Column("lease_deadline", sa.Float, nullable=True),
        sa.Column("deliveries", sa.Integer, nullable=False),
        sa.Column("held_at", sa.Float, nullable=True),
        sa.UniqueConstraint("group_key", name="uq_trajectory_queue_group_key"),
    )
    op.create_index("ix_trajectory_queue_status_id", "trajectory_queue", ["status", "id"])
    op.create_index("ix_trajectory_queue_lease_id", "trajectory_queue", ["lease_id"])
    op.create_table(
        "trajectory_leases",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("deadline", sa.Float, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("n_groups", sa.Integer, nullable=False),
        sa.Column("acked_at", sa.Float, nullable=True),
    )
    op.create_index("ix_trajectory_leases_status", "trajectory_leases", ["status", "deadline"])
    op.create_table(
        "trainer_state",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("batch_size", sa.Integer, nullable=False),
        sa.Column("staleness_bound", sa.Integer, nullable=False),
        sa.Column("group_size", sa.Integer, nullable=False),
        sa.Column("base_version", sa.Integer, nullable=False),
        sa.Column("admitted", sa.Integer, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("trainer_state")
    op.drop_index("ix_trajectory_leases_status", table_name="trajectory_leases")
    op.drop_table("trajectory_leases")
    op.drop_index("ix_trajectory_queue_lease_id", table_name="trajectory_queue")
    op.drop_index("ix_trajectory_queue_status_id", table_name="trajectory_queue")
    op.drop_table("trajectory_queue")
