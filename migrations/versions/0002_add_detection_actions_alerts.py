"""add detection, actions/commands, checkpoints, layer precision and the alert outbox

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_TS = sa.DateTime(timezone=True)


def _run_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(["run_pk"], ["runs.id"], ondelete="CASCADE", name=f"fk_{table}_run_pk_runs")


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("guard", sa.JSON()))
    op.create_table(
        "detector_states",
        sa.Column("run_pk", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("state", sa.JSON(), nullable=False),
        sa.Column("last_step", sa.BigInteger()),
        sa.Column("updated_at", _TS, nullable=False),
        _run_fk("detector_states"),
        sa.PrimaryKeyConstraint("run_pk", "rank", name="pk_detector_states"),
    )
    op.create_table(
        "findings",
        sa.Column("id", _BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("run_pk", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("segment", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("onset_step", sa.BigInteger(), nullable=False),
        sa.Column("rule", sa.String(48), nullable=False),
        sa.Column("severity", sa.String(16), nullable=False),
        sa.Column("explanation", sa.String(1024), nullable=False),
        sa.Column("modules", sa.JSON(), nullable=False),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        _run_fk("findings"),
        sa.PrimaryKeyConstraint("id", name="pk_findings"),
    )
    op.create_index("ix_findings_run_step", "findings", ["run_pk", "step"])
    op.create_table(
        "actions",
        sa.Column("id", _BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("run_pk", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(24), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("reason", sa.String(1024), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("finding_ids", sa.JSON(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("applied_step", sa.BigInteger()),
        sa.Column("applied_at", _TS),
        sa.Column("error", sa.String(1024)),
        _run_fk("actions"),
        sa.PrimaryKeyConstraint("id", name="pk_actions"),
    )
    op.create_index("ix_actions_run_status", "actions", ["run_pk", "status"])
    op.create_table(
        "checkpoints",
        sa.Column("run_pk", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("segment", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("path", sa.String(1024)),
        sa.Column("known_good", sa.Boolean(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        _run_fk("checkpoints"),
        sa.PrimaryKeyConstraint("run_pk", "rank", "segment", "step", name="pk_checkpoints"),
    )
    op.create_table(
        "layer_precision",
        sa.Column("run_pk", sa.Integer(), nullable=False),
        sa.Column("module", sa.String(512), nullable=False),
        sa.Column("precision", sa.String(8), nullable=False),
        sa.Column("since_step", sa.BigInteger(), nullable=False),
        sa.Column("action_id", sa.BigInteger()),
        _run_fk("layer_precision"),
        sa.PrimaryKeyConstraint("run_pk", "module", name="pk_layer_precision"),
    )
    op.create_table(
        "alert_outbox",
        sa.Column("id", _BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("run_pk", sa.Integer()),
        sa.Column("sink", sa.String(32), nullable=False),
        sa.Column("dedupe_key", sa.String(256), nullable=False),
        sa.Column("kind", sa.String(48), nullable=False),
        sa.Column("severity", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", _TS, nullable=False),
        sa.Column("last_error", sa.String(1024)),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("sent_at", _TS),
        sa.Column("active_until", _TS),
        _run_fk("alert_outbox"),
        sa.PrimaryKeyConstraint("id", name="pk_alert_outbox"),
        sa.UniqueConstraint("sink", "dedupe_key", name="uq_alert_outbox_sink"),
    )
    op.create_index("ix_alert_outbox_due", "alert_outbox", ["status", "next_attempt_at"])


def downgrade() -> None:
    op.drop_index("ix_alert_outbox_due", table_name="alert_outbox")
    op.drop_table("alert_outbox")
    op.drop_table("layer_precision")
    op.drop_table("checkpoints")
    op.drop_index("ix_actions_run_status", table_name="actions")
    op.drop_table("actions")
    op.drop_index("ix_findings_run_step", table_name="findings")
    op.drop_table("findings")
    op.drop_table("detector_states")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("guard")
