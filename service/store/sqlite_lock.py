"""SQLite's one write lock, taken by a write transaction before anything else.

Several writers share a SQLite database: the ingest writer, the loop's passes (in threads of the
serving process, or in a loop process of their own), the alert dispatcher. A write transaction
takes the lock with its first statement (``take_sqlite_lock``), retrying every
``SQLITE_LOCK_POLL_S`` instead of SQLite's 1-2-5-10 ms busy sleeps; the inline ingest attempt takes
it at once or not at all (``DatabaseBusy``); ``WriteTurn`` gives waiting ingest writes priority over
a loop process's next pass. Within one process, ``Store``'s process lock orders the writers first.
"""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from fp8guard.service.store.engine import SQLITE_BUSY_TIMEOUT_MS

__all__ = ["SQLITE_LOCK_POLL_S", "DatabaseBusy", "WriteTurn", "take_sqlite_lock"]


class DatabaseBusy(Exception):
    """SQLite's write lock is held by another connection, and the transaction was not to wait."""


class WriteTurn:
    """Priority on SQLite's one write lock between the serving process and its loop process, in a
    shared integer (``multiprocessing.RawValue``): while the ingest writer waits for the lock
    (``ingest`` side) the loop process starts no pass (``loop`` side), up to ``LOOP_DEFERS_S``.
    Without it, the loop process's passes followed each other with gaps too short for the writer's
    retries to meet, and 50 agents' first batches (each a long first pass) waited up to 0.7 s."""

    LOOP_DEFERS_S = 0.05
    """Longest a loop pass waits for waiting ingest writes (the loop is never starved)."""

    def __init__(self, shared: Any, *, loop: bool) -> None:
        self.shared = shared
        self.loop = loop


def take_sqlite_lock(unit: Session | sa.Connection, *, at_once: bool, turn: WriteTurn | None = None) -> None:
    """Take SQLite's write lock with the transaction's first statement (a write that changes
    nothing), before any read: the transaction's snapshot then starts under the lock, and a write
    of another process (the loop's) never comes between a read of this transaction and its first
    write (in WAL that is SQLITE_BUSY_SNAPSHOT, an error no busy timeout waits out). ``at_once``:
    raising ``DatabaseBusy`` at once if another connection holds the lock; otherwise it retries
    every ``SQLITE_LOCK_POLL_S`` for up to SQLite's busy timeout. Runs on the driver's cursor, so a
    refusal is not counted as a database error."""
    conn = unit.connection() if isinstance(unit, Session) else unit
    dbapi_conn = conn.connection.dbapi_connection
    assert dbapi_conn is not None
    cursor = dbapi_conn.cursor()
    now = time.monotonic()
    deadline = now + SQLITE_BUSY_TIMEOUT_MS / 1000
    if turn is not None and turn.loop:
        defer_until = now + WriteTurn.LOOP_DEFERS_S
        while turn.shared.value and time.monotonic() < defer_until:
            time.sleep(SQLITE_LOCK_POLL_S / 2)
    announced = False
    taken = False
    try:
        cursor.execute("PRAGMA busy_timeout=0")
        while True:
            try:
                cursor.execute(_LOCK_STATEMENT)
                taken = True
                return
            except Exception as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise
                dbapi_conn.rollback()  # nothing of it held: the next try begins afresh
                if at_once:
                    raise DatabaseBusy(str(exc)) from exc
                if time.monotonic() > deadline:
                    raise
            if turn is not None and not turn.loop and not announced:
                turn.shared.value = 1  # one writer at a time per process: the process lock
                announced = True
            time.sleep(SQLITE_LOCK_POLL_S)
    finally:
        if announced and turn is not None:
            turn.shared.value = 0
        try:
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cursor.close()
        except Exception:
            if taken:
                raise  # the lock is held on a connection that would no longer wait for SQLite's locks
            # else the connection broke while taking the lock: that error, the one raised
            # above, is what the caller reports (a second error here would hide it)


SQLITE_LOCK_POLL_S = 0.0005
"""How often a write transaction retries SQLite's write lock while another process holds it.
SQLite's own busy handler sleeps 1, 2, 5, 10, ... ms between tries, so a writer of the serving
process that met a 2 ms pass of the loop's process waited 8 ms; a try costs microseconds."""


_LOCK_STATEMENT = "DELETE FROM loop_queue WHERE 0"
