"""Alembic environment. Run through ``fp8guard db upgrade`` (or ``Store`` helpers), which hand
in an open connection; a plain ``alembic`` CLI run falls back to FP8GUARD_DATABASE_URL."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import Connection

from fp8guard.service.store.models import Base

target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite needs table rebuilds for ALTER
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    from fp8guard.service.store.engine import make_engine

    url = context.config.get_main_option("sqlalchemy.url") or os.environ.get("FP8GUARD_DATABASE_URL")
    if not url:
        raise SystemExit("set FP8GUARD_DATABASE_URL or use: fp8guard db upgrade --database-url URL")
    engine = make_engine(url)
    with engine.begin() as conn:
        _run(conn)


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported; run them against a database")
run_migrations_online()
