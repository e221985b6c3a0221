"""Plain driver SQL for the statements every batch runs, on both backends.

Building a SQLAlchemy Core statement and its cache key costs 50-100 us in Python, more than
SQLite takes to run such a statement; the ingest path and the loop's pass run about fifteen
statements per batch. Those few are written once as SQL text with ``?`` placeholders (turned
into ``%s`` for psycopg) and run on the DB-API cursor of the SQLAlchemy connection, in its
transaction: even ``exec_driver_sql`` spent as long again as the driver on building its result
object (12 us against 2 us per SQLite statement, half a pass's database time on PostgreSQL).
Rows come back as plain tuples. Arrays of numbers go to PostgreSQL as
array literals (``array_literal``, cast in the statement): psycopg dumps a list element by element
in Python, in text (quoting each: 0.67 ms for a small batch's raw rows) or binary alike (a small
batch's sixteen arrays were a third of its ingest CPU). PostgreSQL-only statements may write ``%b``
for a parameter sent in binary (``bytea`` and its arrays). A failing statement raises the driver's own (DB-API) exception,
its cursor closed; ``Store`` translates those and SQLAlchemy's in one place. Everything else
uses SQLAlchemy.

On PostgreSQL each statement that waits for its answer is a round trip to the server, and on a
busy host every round trip is also a wake-up of the server process and of the waiting thread
(measured: a small batch's ingest made 16 of them and spent half its time waiting). ``pipeline``
sends statements without waiting (psycopg's pipeline mode, the extended protocol's Sync): rows
are read where they are needed (``fetch_one``/``fetch_all`` flush the pipeline up to their
statement) or later (``fetch_later``), and with ``commit=True`` the COMMIT rides with the queued
statements; a pipeline that opens the transaction sends its BEGIN too (``_begin_unsynced``).
Inside a pipeline only this module's statements and SQLAlchemy DML without RETURNING may run:
SQLAlchemy reads a result's description at once, before a pipelined answer arrives.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

__all__ = ["Later", "array_literal", "end_unsynced", "fetch_all", "fetch_later", "fetch_one", "insert_returning_ids", "json_value", "pipeline", "run",
           "run_many", "timestamp"]


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
    except BaseException:
        cursor.close()
        raise
    return cursor


@contextmanager
def pipeline(conn: sa.Connection, *, commit: bool = False) -> Iterator[None]:
    """PostgreSQL: statements of the block are sent without waiting for their answers, which
    arrive at the block's end (or where a row is fetched); with ``commit``, the transaction
    commits at the end of the block in the same round trip, and the caller's own commit finds
    nothing left to do. SQLite: nothing changes (no round trips to save; the caller commits)."""
    if conn.dialect.name != "postgresql":
        yield
        return
    raw = conn.connection.driver_connection
    assert raw is not None
    own_begin = _begin_unsynced(raw)
    with raw.pipeline():
        if own_begin:
            raw.execute("BEGIN")
        yield
        if commit:
            # A COMMIT statement rather than ``raw.commit()``, which syncs at once: the block's end
            # syncs anyway, and a second sync would be a second round trip. The driver learns
            # the transaction ended from the server's answer; the caller's commit is then a no-op.
            raw.execute("COMMIT")
    end_unsynced(raw)


def _begin_unsynced(raw: Any) -> bool:
    """Make the transaction's BEGIN ride in the pipeline. Outside autocommit, psycopg sends its
    own BEGIN with a Sync and waits for the answer: a round trip of its own before the first
    statement (one of a small batch's three). For the transaction, the connection is switched to
    autocommit and this module sends BEGIN itself, queued with what follows. The switch is undone
    as soon as the transaction has ended (``end_unsynced``: after the pipeline's COMMIT, or when
    the pool takes the connection back, whose reset rolls back what is left). True if the caller
    must send BEGIN."""
    from psycopg import pq

    if raw.autocommit or raw.info.transaction_status != pq.TransactionStatus.IDLE:
        return False  # a transaction is open already
    raw.autocommit = True
    return True


def end_unsynced(raw: Any, *, discard: bool = False) -> None:
    """Back to psycopg's own transactions once the transaction ``_begin_unsynced`` began has
    ended (the service's connections are never autocommit otherwise). With ``discard`` (the pool
    taking the connection back), a transaction still open is rolled back first."""
    from psycopg import pq

    if not raw.autocommit or raw.closed:
        return
    if raw.info.transaction_status != pq.TransactionStatus.IDLE:
        if not discard:
            return  # the transaction goes on after the pipeline
        raw.rollback()
    raw.autocommit = False


class Later:
    """The rows of a statement sent now and read later: in a pipeline, after its answer came."""

    __slots__ = ("_cursor", "_rows")

    def __init__(self, cursor: Any, *, now: bool) -> None:
        self._cursor: Any = None
        self._rows: list[tuple[Any, ...]] | None = None
        if now:
            self._rows = _drain(cursor)
        else:
            self._cursor = cursor

    def rows(self) -> list[tuple[Any, ...]]:
        if self._rows is None:
            self._rows, self._cursor = _drain(self._cursor), None
        return self._rows


def _drain(cursor: Any) -> list[tuple[Any, ...]]:
    try:
        return [tuple(r) for r in cursor.fetchall()]
    finally:
        cursor.close()


def array_literal(values: Iterable[int | float | None]) -> str:
    """A PostgreSQL array literal of Python ints and floats (None is NULL; ``repr`` writes floats
    exactly and infinities as ``inf``, which PostgreSQL reads), e.g. ``{1,2.5,NULL,inf}``."""
    items = list(values)
    if None in items:
        return "{" + ",".join("NULL" if v is None else repr(v) for v in items) + "}"
    return "{" + ",".join(map(repr, items)) + "}"


def fetch_later(conn: sa.Connection, sql: str, params: Sequence[Any] = ()) -> Later:
    """Send a statement; its rows are read by ``Later.rows()`` (at once on SQLite, whose cursors
    do not outlive the next statement's commit)."""
    return Later(_cursor(conn, sql, tuple(params)), now=conn.dialect.name != "postgresql")


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
    """Insert ``rows`` and return their new ids, ascending in the order of ``rows``. ``columns``:
    (name, PostgreSQL type) pairs. Neither database promises the order of ``RETURNING`` rows, so
    the ids are allocated first and inserted explicitly. PostgreSQL: one statement of fixed text
    (psycopg parses it once; a multi-row VALUES list of a thousand placeholders cost it 7 ms a
    statement) that draws ``len(rows)`` values from the table's sequence, numbers them in
    ascending order and pairs them with the rows by ``unnest(...) WITH ORDINALITY``. SQLite: the
    ids after the largest stored one, in ``INSERT .. VALUES`` of up to 500 rows; the caller holds
    the database's write lock (the loop's pass takes it first), so nobody else allocates meanwhile."""
    if not rows:
        return []
    names = ", ".join(name for name, _ in columns)
    if conn.dialect.name == "postgresql":
        arrays = ", ".join(f"%b::{kind}[]" for _, kind in columns)
        picked = ", ".join(f"r.{name}" for name, _ in columns)
        statement = (
            f"WITH ids AS (SELECT nextval(pg_get_serial_sequence('{table}', 'id')) AS id FROM generate_series(1, ?)), "
            "numbered AS (SELECT id, row_number() OVER (ORDER BY id) AS ord FROM ids), "
            f"ins AS (INSERT INTO {table} (id, {names}) SELECT n.id, {picked} "
            f"FROM unnest({arrays}) WITH ORDINALITY AS r({names}, ord) JOIN numbered n USING (ord)) "
            "SELECT id FROM numbered ORDER BY ord")
        ids = [int(r[0]) for r in fetch_all(conn, statement, [len(rows), *(list(c) for c in zip(*rows, strict=True))])]
        if len(ids) != len(rows):
            raise RuntimeError(f"INSERT INTO {table} allocated {len(ids)} ids for {len(rows)} rows")
        return ids
    row = fetch_one(conn, f"SELECT max(id) FROM {table}")
    first = 1 + int(row[0]) if row is not None and row[0] is not None else 1
    ids = list(range(first, first + len(rows)))
    for lo in range(0, len(rows), _ROWS_PER_INSERT):
        part = rows[lo:lo + _ROWS_PER_INSERT]
        one = f"({', '.join('?' * (len(columns) + 1))})"
        run(conn, f"INSERT INTO {table} (id, {names}) VALUES {', '.join([one] * len(part))}",
            [v for k, r in enumerate(part) for v in (ids[lo + k], *r)])
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
