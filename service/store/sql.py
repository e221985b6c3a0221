"""Plain driver SQL for the statements every batch runs, on both backends.

Building a SQLAlchemy Core statement and its cache key costs 50-100 us in Python, more than
SQLite takes to run such a statement; the ingest path and the loop's pass run about fifteen
statements per batch. Those few are written once as SQL text with ``?`` placeholders (turned
into ``%s`` for psycopg) and run with ``exec_driver_sql``, which skips statement compilation but
keeps SQLAlchemy's error translation and events (the database-error metric counts them). Rows
come back as plain tuples. Everything else uses SQLAlchemy.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

__all__ = ["fetch_all", "fetch_one", "json_value", "run", "run_many", "timestamp"]


@functools.lru_cache(maxsize=256)
def _for(dialect: str, sql: str) -> str:
    return sql.replace("?", "%s") if dialect == "postgresql" else sql


def run(conn: sa.Connection, sql: str, params: Sequence[Any] = ()) -> None:
    conn.exec_driver_sql(_for(conn.dialect.name, sql), tuple(params))


def run_many(conn: sa.Connection, sql: str, rows: Sequence[Sequence[Any]]) -> None:
    """One statement over many parameter rows (psycopg pipelines them)."""
    if not rows:
        return
    conn.exec_driver_sql(_for(conn.dialect.name, sql), [tuple(r) for r in rows])


def fetch_one(conn: sa.Connection, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
    row = conn.exec_driver_sql(_for(conn.dialect.name, sql), tuple(params)).first()
    return None if row is None else tuple(row)


def fetch_all(conn: sa.Connection, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in conn.exec_driver_sql(_for(conn.dialect.name, sql), tuple(params)).all()]


def timestamp(conn: sa.Connection, when: datetime) -> datetime | str:
    """A UTC timestamp as the ``UtcDateTime`` column stores it (SQLite: SQLAlchemy's text format)."""
    if conn.dialect.name == "postgresql":
        return when
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


def json_value(conn: sa.Connection, value: Any) -> Any:
    """A JSON column's value as the driver reads it back (psycopg parses json, SQLite gives text)."""
    if value is None or not isinstance(value, str | bytes):
        return value
    return json.loads(value)
