"""add API tokens (hashed, with roles), browser sessions and the owner token of each run

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "tokens",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("run_prefix", sa.String(128)),
        sa.Column("secret_hash", sa.String(64), nullable=False),
        sa.Column("hint", sa.String(16), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("revoked_at", _TS),
        sa.PrimaryKeyConstraint("id", name="pk_tokens"),
        sa.UniqueConstraint("secret_hash", name="uq_tokens_secret_hash"),
    )
    op.create_table(
        "sessions",
        sa.Column("secret_hash", sa.String(64), nullable=False),
        sa.Column("token_id", sa.Integer(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("expires_at", _TS, nullable=False),
        sa.ForeignKeyConstraint(["token_id"], ["tokens.id"], ondelete="CASCADE", name="fk_sessions_token_id_tokens"),
        sa.PrimaryKeyConstraint("secret_hash", name="pk_sessions"),
    )
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("owner_token_id", sa.Integer()))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("owner_token_id")
    op.drop_table("sessions")
    op.drop_table("tokens")
