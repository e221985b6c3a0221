"""Engines, migrations and the startup schema check."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine, make_url

from fp8guard.service.errors import SchemaNotAtHead
from fp8guard.service.store import sql

__all__ = [
    "PING_AFTER_IDLE_S",
    "SQLITE_BUSY_TIMEOUT_MS",
    "alembic_config",
    "current_revision",
    "downgrade",
    "head_revision",
    "make_engine",
    "normalize_url",
    "upgrade",
    "verify_schema",
]

log = logging.getLogger(__name__)

# SQLite's default page of 4 KiB (only effective on a new database file, before WAL is enabled).
# Calibration (docs/benchmarks.md, "sixth session"): a small batch (200 tensors x 4 stats x 10
# steps) touches a few dozen pages (raw rows per stat, roll-up rows per stat and level, steps,
# queue) and WAL writes whole pages, so with the 16 KiB pages used before, a 32 KB batch wrote
# several hundred KB to the WAL, and the request whose commit crossed the auto-checkpoint (1,000
# pages: 16 MB) copied it into the database file: periodic stalls of 20-25 ms. With 4 KiB pages
# one agent sent 177-200 batches/s against 138-160 (p99 16 against 22-28 ms), side by side;
# large batches (rows of 4 KB, a page each; roll-ups in overflow pages) and the heatmap query
# measured the same with either size.
SQLITE_BUSY_TIMEOUT_MS = 10_000
"""How long a SQLite statement waits for another connection's (or process's) write lock."""

_SQLITE_PRAGMAS = (
    f"busy_timeout={SQLITE_BUSY_TIMEOUT_MS}",  # first: switching to WAL may itself return BUSY
    "page_size=4096",
    "journal_mode=WAL",
    "synchronous=NORMAL",
    "foreign_keys=ON",
    "cache_size=-65536",
)


def normalize_url(url: str) -> str:
    """Use psycopg 3 for ``postgresql://`` URLs and create the directory of a SQLite file."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    return parsed.render_as_string(hide_password=False)


def make_engine(url: str, **kwargs: Any) -> Engine:
    url = normalize_url(url)
    if url.startswith("sqlite"):
        engine = sa.create_engine(url, connect_args={"check_same_thread": False, "timeout": 10}, **kwargs)

        @sa.event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _: Any) -> None:
            cur = dbapi_conn.cursor()
            for pragma in _SQLITE_PRAGMAS:
                cur.execute(f"PRAGMA {pragma}")
            cur.close()

        return engine
    ping_after_idle_s = kwargs.pop("ping_after_idle_s", PING_AFTER_IDLE_S)
    kwargs.setdefault("pool_size", 8)
    engine = sa.create_engine(url, **kwargs)
    _Liveness(engine, ping_after_idle_s).install()
    sa.event.listen(engine, "checkin", _end_pipeline_transaction)
    return engine


def _end_pipeline_transaction(dbapi_conn: Any, record: Any) -> None:
    """A transaction begun in a pipeline (``sql.pipeline``) switched its connection to
    autocommit; the pool's reset has ended it by now: switch back. A connection that cannot be
    brought back is not handed out again (the pool reconnects it)."""
    if dbapi_conn is None:
        return
    try:
        sql.end_unsynced(dbapi_conn, discard=True)
    except Exception as exc:
        log.warning("closing a pooled connection left in autocommit: %s", exc)
        record.invalidate(exc)


PING_AFTER_IDLE_S = 2.0
"""A pooled PostgreSQL connection is pinged at checkout only after this long unused.
SQLAlchemy's ``pool_pre_ping`` pinged at every checkout: one more round trip for each ingest
transaction and each loop pass (two of a small batch's eight round trips), each a wake-up of a
server process and of the waiting thread on a busy host. A connection used within the last 2 s
was alive then; a server restart inside that window costs the one transaction that meets a dead
connection (503: the agent retries the same batch; a loop pass is retried by the sweep). Its failed rollback makes SQLAlchemy invalidate the whole pool, so
the next checkouts reconnect. Idle connections (a quiet service, a dashboard's reads) keep their
ping (``tests/service/test_pool_liveness.py``)."""

_IDLE_SINCE = "fp8guard_idle_since"


class _Liveness:
    """Checkout-time liveness for one engine's pool (PostgreSQL): ping what was idle."""

    def __init__(self, engine: sa.Engine, idle_s: float) -> None:
        self.engine = engine
        self.idle_s = idle_s

    def install(self) -> None:
        sa.event.listen(self.engine, "checkin", self.checkin)
        sa.event.listen(self.engine, "checkout", self.checkout)

    def checkin(self, dbapi_conn: Any, record: Any) -> None:
        if dbapi_conn is not None:
            record.info[_IDLE_SINCE] = time.monotonic()

    def checkout(self, dbapi_conn: Any, record: Any, proxy: Any) -> None:
        since = record.info.get(_IDLE_SINCE)
        if since is None or time.monotonic() - since < self.idle_s:
            return  # connected just now (a reconnect clears ``info``), or used moments ago
        try:
            self.engine.dialect.do_ping(dbapi_conn)
        except Exception as exc:
            # As ``pool_pre_ping`` does: a dead idle connection most likely means the server
            # restarted, so every pooled connection is replaced, this one at once.
            raise sa.exc.InvalidatePoolError(f"connection failed its liveness ping: {exc}") from exc


def _migrations_dir() -> str:
    import fp8guard.migrations as migrations

    return str(Path(migrations.__file__).parent)


def alembic_config(connection: sa.Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", _migrations_dir())
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    with engine.begin() as conn:
        command.upgrade(alembic_config(conn), revision)


def downgrade(engine: Engine, revision: str) -> None:
    with engine.begin() as conn:
        command.downgrade(alembic_config(conn), revision)


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def verify_schema(engine: Engine) -> str:
    """Refuse to serve on a schema that is not at head; return the head revision."""
    head = head_revision()
    try:
        current = current_revision(engine)
    except sa.exc.OperationalError as exc:
        raise SchemaNotAtHead(f"cannot open the database {engine.url!r}: {exc.orig}") from exc
    if current != head:
        url = engine.url.render_as_string(hide_password=True)
        state = "is empty" if current is None else f"is at revision {current}"
        raise SchemaNotAtHead(
            f"the database schema {state}, but this fp8guard needs revision {head}. "
            f"Back it up, then run: fp8guard db upgrade --database-url '{url}'"
        )
    return head
