"""Plain driver SQL for the statements every batch runs, on both backends.

Building a SQLAlchemy Core statement and its cache key costs 50-100 us in Python, and even
``exec_driver_sql`` spends about 100 us setting up its execution context and result, more than
SQLite takes to run such a statement; the ingest path and the loop's pass run about fifteen
statements per batch. Those few are written once as SQL text with ``?`` placeholders (turned
into ``%s`` for psycopg) and run on the driver's own cursor, inside the SQLAlchemy connection's
transaction. Rows come back as plain tuples (``fetch_row`` names their columns). Driver errors
are translated by ``Store._session`` like SQLAlchemy's. Everything else uses SQLAlchemy.
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


def _cursor(conn: sa.Connection) -> Any:
    raw = conn.connection.driver_connection
    assert raw is not None
    return raw.cursor()


def run(conn: sa.Connection, sql: str, params: Sequence[Any] = ()) -> None:
    cur = _cursor(conn)
    try:
        cur.execute(_for(conn.dialect.name, sql), tuple(params))
    finally:
        cur.close()


def run_many(conn: sa.Connection, sql: str, rows: Sequence[Sequence[Any]]) -> None:
    """One statement over many parameter rows (psycopg pipelines them)."""
    if not rows:
        return
    cur = _cursor(conn)
    try:
        cur.executemany(_for(conn.dialect.name, sql), rows)
    finally:
        cur.close()


def fetch_one(conn: sa.Connection, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
    cur = _cursor(conn)
    try:
        cur.execute(_for(conn.dialect.name, sql), tuple(params))
        row = cur.fetchone()
        return None if row is None else tuple(row)
    finally:
        cur.close()


def fetch_all(conn: sa.Connection, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    cur = _cursor(conn)
    try:
        cur.execute(_for(conn.dialect.name, sql), tuple(params))
        return [tuple(r) for r in cur.fetchall()]
    finally:
        cur.close()


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
