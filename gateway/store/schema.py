"""SQLAlchemy Core tables of the store, as created by Alembic revisions ``0001_initial``,
``0002_trajectories`` (the trajectory queue and the staleness budget), ``0003_session_browse_indexes``
(browsing indexes), ``0004_groups`` and ``0005_lifecycle_indexes``: one ``MetaData`` for every table the
gateway's SQL touches.

The migration, not ``metadata.create_all``, creates them; these definitions are what the queries use and
must match the migration (a test compares them). Times are unix seconds (float); token arrays are packed
bytes (see ``packing``); ``request``/``response_message``/``metadata`` are JSON (not JSONB: the assistant
message is kept exactly as returned, key order included).
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

sessions = sa.Table(
    "sessions",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
    sa.Column("group_id", sa.String(255), nullable=False, index=True),
    sa.Column("task_id", sa.String(255), nullable=True),
    sa.Column("metadata", sa.JSON, nullable=False, key="meta"),
    sa.Column("status", sa.String(16), nullable=False, index=True),
    sa.Column("is_eval", sa.Boolean, nullable=False),
    sa.Column("reward", sa.Float, nullable=True),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("finished_at", sa.Float, nullable=True),
    sa.Column("last_activity_at", sa.Float, nullable=False),
    sa.Index("ix_sessions_created_id", "created_at", "id"),  # 0003: newest-first keyset browsing
    sa.Index("ix_sessions_status_created", "status", "created_at", "id"),
    sa.Index("ix_sessions_status_activity", "status", "last_activity_at"),  # 0005: the lifecycle tick
)

interactions = sa.Table(
    "interactions",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("session_id", sa.String(64), sa.ForeignKey("sessions.id", ondelete="CASCADE"), nullable=False),
    sa.Column("parent_id", sa.String(64), sa.ForeignKey("interactions.id"), nullable=True, index=True),
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
    sa.Index("ix_interactions_session_chain", "session_id", "chain_hash"),
    sa.Index("ix_interactions_session_created", "session_id", "created_at"),
    sa.Index("ix_interactions_chain_hash", "chain_hash"),
)

reward_events = sa.Table(
    "reward_events",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("session_id", sa.String(64), sa.ForeignKey("sessions.id", ondelete="CASCADE"), nullable=False),
    sa.Column("interaction_id", sa.String(64), sa.ForeignKey("interactions.id"), nullable=True),
    sa.Column("reward", sa.Float, nullable=False),
    sa.Column("source", sa.String(255), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Index("ix_reward_events_session", "session_id"),
    sa.Index("ix_reward_events_interaction", "interaction_id"),
)

# GRPO groups admitted as a whole (``POST /v1/groups``, or the first session of a group id): ``places``
# sessions were charged to the staleness budget, ``created`` of them exist. Alembic ``0004_groups``.
groups = sa.Table(
    "session_groups",
    metadata,
    sa.Column("id", sa.String(255), primary_key=True),
    sa.Column("size", sa.Integer, nullable=False),
    sa.Column("places", sa.Integer, nullable=False),
    sa.Column("created", sa.Integer, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("task_id", sa.String(255), nullable=True),
    sa.Column("metadata", sa.JSON, nullable=False, key="meta"),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Index("ix_session_groups_status_created", "status", "created_at"),  # 0005: open groups per tick
)

# The trajectory queue without Redis (``gateway.queue.SqlQueue``) and its leases, and the SQL outbox of the Redis
# queue (``gateway.queue.RedisQueue``). Alembic ``0002_trajectories``.
trajectory_queue = sa.Table(
    "trajectory_queue",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("group_key", sa.String(64), nullable=False, unique=True),
    sa.Column("group_id", sa.String(255), nullable=False),
    sa.Column("session_ids", sa.JSON, nullable=False),
    sa.Column("payload", sa.LargeBinary, nullable=False),
    sa.Column("n_rows", sa.Integer, nullable=False),
    sa.Column("n_tokens", sa.Integer, nullable=False),
    sa.Column("min_version", sa.Integer, nullable=False),
    sa.Column("complete", sa.Boolean, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    # SqlQueue: ready | leased | held; RedisQueue (the table is its SQL outbox): outbox (staged in the claim's
    # transaction, not yet in the stream) | published (in the stream; kept until the ack or the drop, so that a
    # Redis that lost its data gets it again)
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("lease_id", sa.String(64), nullable=True),
    sa.Column("lease_deadline", sa.Float, nullable=True),
    sa.Column("deliveries", sa.Integer, nullable=False),
    sa.Column("held_at", sa.Float, nullable=True),
    sa.Index("ix_trajectory_queue_status_id", "status", "id"),
    sa.Index("ix_trajectory_queue_lease_id", "lease_id"),
)

trajectory_leases = sa.Table(
    "trajectory_leases",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("deadline", sa.Float, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),  # open | acked | expired
    sa.Column("n_groups", sa.Integer, nullable=False),
    sa.Column("acked_at", sa.Float, nullable=True),
    sa.Index("ix_trajectory_leases_status", "status", "deadline"),
)

# The staleness budget (``gateway.staleness``): one row, id 1. Alembic ``0002_trajectories``.
trainer_state = sa.Table(
    "trainer_state",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("batch_size", sa.Integer, nullable=False),
    sa.Column("staleness_bound", sa.Integer, nullable=False),
    sa.Column("group_size", sa.Integer, nullable=False),
    sa.Column("base_version", sa.Integer, nullable=False),
    sa.Column("admitted", sa.Integer, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)
