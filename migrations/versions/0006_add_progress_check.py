"""add fp8guard_expect(ok, what): a statement that fails its transaction (PostgreSQL only)

The ingest path writes a rank's batch without first waiting to read the rank's progress when
this process knows it from its own last write (one round trip instead of two): the statement
that bumps the rank's counter checks what it finds with this function, and a mismatch (another
process wrote the rank meanwhile, or the batch is a duplicate) fails the whole transaction
with SQLSTATE F8G01, after which the batch is written again the careful way
(``service/store/telemetry_writer.py``). SQLite has no round trips to save and no function.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        "CREATE FUNCTION fp8guard_expect(ok boolean, what text) RETURNS void LANGUAGE plpgsql VOLATILE AS $$ "
        "BEGIN IF ok IS NOT TRUE THEN RAISE EXCEPTION USING ERRCODE = 'F8G01', MESSAGE = what; END IF; END $$")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP FUNCTION fp8guard_expect(boolean, text)")
