"""Plain driver SQL for the statements every batch runs, on both backends.

Building a SQLAlchemy Core statement and its cache key costs 50-100 us in Python, more than
SQLite takes to run it; the ingest path and the loop's pass run about fifteen statements per
batch, so those few are written once as SQL text with ``?`` placeholders (turned into ``%s`` for
psycopg) and executed with ``exec_driver_sql``. Everything else uses SQLAlchemy.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

__all__ = ["fetch_all", "fetch_one", "json_value", "run", "timestamp"]


@functools.lru_cache(maxsize=256)
def _for(dialect: str, sql: str) -> str:
    return sql.replace("?", "%s") if dialect == "postgresql" else sql


def run(conn: sa.Connection, sql: str, params: Sequence[Any] = ()) -> sa.CursorResult[Any]:
    return conn.exec_driver_sql(_for(conn.dialect.name, sql), tuple(params))


def fetch_one(conn: sa.Connection, sql: str, params: Sequence[Any] = ()) -> sa.Row[Any] | None:
    return run(conn, sql, params).first()


def fetch_all(conn: sa.Connection, sql: str, params: Sequence[Any] = ()) -> Sequence[sa.Row[Any]]:
    return run(conn, sql, params).all()


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
