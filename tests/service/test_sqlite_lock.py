"""``take_sqlite_lock`` on a connection that breaks while it takes the lock: the caller hears
the error that broke it, not the one of restoring the busy timeout on the broken connection."""

from __future__ import annotations

import sqlite3
from types import SimpleNamespace

import pytest

from fp8guard.service.store.sqlite_lock import take_sqlite_lock


class _BreakingCursor:
    """A DB-API cursor whose connection fails at the first statement and is closed afterwards."""

    def __init__(self) -> None:
        self.statements: list[str] = []

    def execute(self, statement: str) -> None:
        self.statements.append(statement)
        if len(self.statements) == 1:
            raise sqlite3.OperationalError("disk I/O error")
        raise sqlite3.ProgrammingError("Cannot operate on a closed database.")

    def close(self) -> None:
        pass


def test_the_error_that_broke_the_connection_is_the_one_raised() -> None:
    cursor = _BreakingCursor()
    conn = SimpleNamespace(connection=SimpleNamespace(dbapi_connection=SimpleNamespace(cursor=lambda: cursor)))
    with pytest.raises(sqlite3.OperationalError, match="disk I/O error"):
        take_sqlite_lock(conn, at_once=False)  # type: ignore[arg-type]
    assert len(cursor.statements) == 2  # and the busy timeout's restore was tried
