"""create telemetry tables: runs, ranks, segments, batches, tensors, stats, steps, series, events

Revision ID: 0001
Revises:
Create Date: 2026-11-29

Written by hand, importing no ORM model, so it keeps working when the models change.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")



def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(128), nullable=False),
        sa.Column("model", sa.String(256)),
        sa.Column("recipe", sa.JSON()),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("config", sa.JSON()),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
        sa.UniqueConstraint("run_id", name="uq_runs_run_id"),
    )
    op.create_table(
        "run_ranks",
        sa.Column("run_pk", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("last_step", sa.BigInteger()),
        sa.Column("last_segment", sa.Integer(), nullable=False),
        sa.Column("last_time", sa.Float()),
        sa.Column("last_loss", sa.Float()),
        sa.Column("last_loss_nan", sa.Boolean(), nullable=False),
        sa.Column("batches", sa.BigInteger(), nullable=False),
        sa.Column("samples", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_pk"], ["runs.id"], ondelete="CASCADE", name="fk_run_ranks_run_pk_runs"),
        sa.PrimaryKeyConstraint("run_pk", "rank", name="pk_run_ranks"),
    )
    op.create_table(
        "segments",
        sa.Column("run_pk", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("segment", sa.Integer(), nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["run_pk"], ["runs.id"], ondelete="CASCADE", name="fk_segments_run_pk_runs"),
        sa.PrimaryKeyConstraint("run_pk", "rank", "segment", name="pk_segments"),
    )
    op.create_table(
        "ingest_batches",
        sa.Column("run_pk", sa.Integer(), nullable=False),
        sa.Column("batch_id", sa.String(128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("samples", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["run_pk"], ["runs.id"], ondelete="CASCADE",
                                name="fk_ingest_batches_run_pk_runs"),
        sa.PrimaryKeyConstraint("run_pk", "batch_id", name="pk_ingest_batches"),
    )
    op.create_table(
        "tensors",
        sa.Column("run_pk", sa.Integer(), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(512), nullable=False),
        sa.Column("module", sa.String(512)),
        sa.Column("role", sa.String(64)),
        sa.Column("fp8_format", sa.String(16)),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["run_pk"], ["runs.id"], ondelete="CASCADE", name="fk_tensors_run_pk_runs"),
        sa.PrimaryKeyConstraint("run_pk", "idx", name="pk_tensors"),
        sa.UniqueConstraint("run_pk", "name", name="uq_tensors_run_pk"),
    )
    op.create_table(
        "stats",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_pk", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.ForeignKeyConstraint(["run_pk"], ["runs.id"], ondelete="CASCADE", name="fk_stats_run_pk_runs"),
        sa.PrimaryKeyConstraint("id", name="pk_stats"),
        sa.UniqueConstraint("run_pk", "name", name="uq_stats_run_pk"),
    )
    op.create_table(
        "steps",
        sa.Column("run_pk", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("segment", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("time", sa.Float()),
        sa.Column("loss", sa.Float()),
        sa.Column("grad_norm", sa.Float()),
        sa.Column("lr", sa.Float()),
        sa.Column("tokens", sa.BigInteger()),
        sa.Column("nan_mask", sa.SmallInteger(), nullable=False),
        sa.ForeignKeyConstraint(["run_pk"], ["runs.id"], ondelete="CASCADE", name="fk_steps_run_pk_runs"),
        sa.PrimaryKeyConstraint("run_pk", "rank", "segment", "step", name="pk_steps"),
    )
    op.create_table(
        "tensor_series",
        sa.Column("run_pk", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("segment", sa.Integer(), nullable=False),
        sa.Column("stat_id", sa.Integer(), nullable=False),
        sa.Column("level", sa.SmallInteger(), nullable=False),
        sa.Column("block", sa.BigInteger(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["run_pk"], ["runs.id"], ondelete="CASCADE",
                                name="fk_tensor_series_run_pk_runs"),
        sa.ForeignKeyConstraint(["stat_id"], ["stats.id"], ondelete="CASCADE",
                                name="fk_tensor_series_stat_id_stats"),
        sa.PrimaryKeyConstraint("run_pk", "rank", "segment", "stat_id", "level", "block", name="pk_tensor_series"),
    )
    if op.get_bind().dialect.name == "postgresql":
        # float32 blobs do not compress: skip pglz (EXTERNAL) and keep rows up to a page inline
        # instead of TOASTing every 4 KiB row into 2 KiB chunks (which doubled size and halved speed).
        op.execute("ALTER TABLE tensor_series ALTER COLUMN data SET STORAGE EXTERNAL")
        op.execute("ALTER TABLE tensor_series SET (toast_tuple_target = 8160)")
    op.create_table(
        "events",
        sa.Column("id", _BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("run_pk", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("segment", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger()),
        sa.Column("time", sa.Float()),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["run_pk"], ["runs.id"], ondelete="CASCADE", name="fk_events_run_pk_runs"),
        sa.PrimaryKeyConstraint("id", name="pk_events"),
    )
    op.create_index("ix_events_run_step", "events", ["run_pk", "step"])


def downgrade() -> None:
    op.drop_index("ix_events_run_step", table_name="events")
    op.drop_table("events")
    op.drop_table("tensor_series")
    for table in ("steps", "stats", "tensors", "ingest_batches", "segments", "run_ranks", "runs"):
        op.drop_table(table)
