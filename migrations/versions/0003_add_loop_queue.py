"""add the closed loop's queue: stored batches waiting to be judged, per run in write order

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "loop_queue",
        sa.Column("id", _BIG_ID, autoincrement=True, nullable=False),
        sa.Column("run_pk", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("segment", sa.Integer(), nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["run_pk"], ["runs.id"], ondelete="CASCADE", name="fk_loop_queue_run_pk_runs"),
        sa.PrimaryKeyConstraint("id", name="pk_loop_queue"),
    )
    op.create_index("ix_loop_queue_run", "loop_queue", ["run_pk", "id"])


def downgrade() -> None:
    op.drop_index("ix_loop_queue_run", table_name="loop_queue")
    op.drop_table("loop_queue")
