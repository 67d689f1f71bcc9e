"""Groups admitted as a whole: the staleness budget is charged for every place of a GRPO group at once.

Revision ID: 0004_groups
Revises: 0003_session_browse_indexes
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_groups"
down_revision: str | None = "0003_session_browse_indexes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "session_groups",
        sa.Column("id", sa.String(255), primary_key=True),
        sa.Column("size", sa.Integer, nullable=False),
        sa.Column("places", sa.Integer, nullable=False),
        sa.Column("created", sa.Integer, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("task_id", sa.String(255), nullable=True),
        sa.Column("metadata", sa.JSON, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("session_groups")
