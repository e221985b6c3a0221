"""Plain driver SQL for the statements every batch runs, on both backends.

Building a SQLAlchemy Core statement and its cache key costs 50-100 us in Python, more than
SQLite takes to run such a statement; the ingest path and the loop's pass run about fifteen
statements per batch. Those few are written once as SQL text with ``?`` placeholders (turned
into ``%s`` for psycopg) and run on the DB-API cursor of the SQLAlchemy connection, in its
transaction: even ``exec_driver_sql`` spent as long again as the driver on building its result
object (12 us against 2 us per SQLite statement, half a pass's database time on PostgreSQL). A
failing statement still goes through SQLAlchemy's error handling (``handle_error`` listeners such
as the database-error metric, the ``sa.exc`` wrappers the store translates, invalidation of a
dropped connection). Rows come back as plain tuples. Everything else uses SQLAlchemy.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

__all__ = ["fetch_all", "fetch_one", "insert_returning_ids", "json_value", "run", "run_many", "timestamp"]


@functools.lru_cache(maxsize=256)
def _for(dialect: str, sql: str) -> str:
    return sql.replace("?", "%s") if dialect == "postgresql" else sql


def _cursor(conn: sa.Connection, sql: str, params: Any, *, many: bool = False) -> Any:
    text = _for(conn.dialect.name, sql)
    cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        if many:
            cursor.executemany(text, params)
        else:
            cursor.execute(text, params)
    except Exception as exc:
        conn._handle_dbapi_exception(exc, text, params, cursor, None)  # raises the sa.exc wrapper
    return cursor


def run(conn: sa.Connection, sql: str, params: Sequence[Any] = ()) -> None:
    _cursor(conn, sql, tuple(params)).close()


def run_many(conn: sa.Connection, sql: str, rows: Sequence[Sequence[Any]]) -> None:
    """One statement over many parameter rows (psycopg pipelines them)."""
    if not rows:
        return
    _cursor(conn, sql, [tuple(r) for r in rows], many=True).close()


def fetch_one(conn: sa.Connection, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
    cursor = _cursor(conn, sql, tuple(params))
    try:
        row = cursor.fetchone()
    finally:
        cursor.close()
    return None if row is None else tuple(row)


def fetch_all(conn: sa.Connection, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    cursor = _cursor(conn, sql, tuple(params))
    try:
        return [tuple(r) for r in cursor.fetchall()]
    finally:
        cursor.close()


_ROWS_PER_INSERT = 500
"""Rows per multi-row INSERT on SQLite (it allows 32,766 parameters per statement)."""


def insert_returning_ids(conn: sa.Connection, table: str, columns: Sequence[tuple[str, str]],
                         rows: Sequence[Sequence[Any]]) -> list[int]:
    """Insert ``rows`` and return their new ids in the order of ``rows``. ``columns``: (name,
    PostgreSQL type) pairs. PostgreSQL: one ``INSERT .. SELECT * FROM unnest(arrays) RETURNING id``
    (a statement text of fixed size, which psycopg parses once: a multi-row VALUES list of a
    thousand placeholders cost it 7 ms a statement); SQLite: ``INSERT .. VALUES`` of up to 500
    rows. Within one statement both number the rows in the order given (an ascending sequence or
    rowid), but neither promises to return them in that order: the ids are sorted."""
    if not rows:
        return []
    names = ", ".join(name for name, _ in columns)
    if conn.dialect.name == "postgresql":
        arrays = ", ".join(f"?::{kind}[]" for _, kind in columns)
        chunks = [(f"INSERT INTO {table} ({names}) SELECT * FROM unnest({arrays}) RETURNING id",
                   [list(col) for col in zip(*rows, strict=True)], len(rows))]
    else:
        one = f"({', '.join('?' * len(columns))})"
        chunks = [(f"INSERT INTO {table} ({names}) VALUES {', '.join([one] * len(part))} RETURNING id",
                   [v for row in part for v in row], len(part))
                  for part in (rows[lo:lo + _ROWS_PER_INSERT] for lo in range(0, len(rows), _ROWS_PER_INSERT))]
    ids: list[int] = []
    for statement, params, n in chunks:
        got = fetch_all(conn, statement, params)
        if len(got) != n:
            raise RuntimeError(f"INSERT INTO {table} returned {len(got)} ids for {n} rows")
        ids += sorted(int(r[0]) for r in got)
    return ids


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
