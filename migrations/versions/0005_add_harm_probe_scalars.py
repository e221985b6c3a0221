"""add the harm probe's per-step scalars: loss_fp8, loss_bf16 and fp8_loss_gap

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_COLUMNS = ("loss_fp8", "loss_bf16", "fp8_loss_gap")


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        for name in _COLUMNS:
            batch.add_column(sa.Column(name, sa.Float()))


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        for name in reversed(_COLUMNS):
            batch.drop_column(name)
