"""``Store``: the one object the API and CLI talk to. It owns sessions and the translation of
database errors; it takes and returns domain objects only."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from fp8guard.service.domain import (
    Batch,
    EventRecord,
    IngestResult,
    RunDetail,
    RunSpec,
    RunSummary,
    ScalarSeries,
    TensorInfo,
    TensorMatrix,
    TensorSeries,
)
from fp8guard.service.errors import Conflict, InvalidPayload, ServiceError, StorageUnavailable
from fp8guard.service.store import reader, writer
from fp8guard.service.store.engine import make_engine, verify_schema
from fp8guard.service.store.guard import AlertHook, guard_batch, pending_commands
from fp8guard.service.store.models import SqlRun
from fp8guard.service.store.reader import Window

__all__ = ["Store", "Window"]

T = TypeVar("T")

log = logging.getLogger(__name__)


class Store:
    """Durable telemetry storage on SQLite or PostgreSQL.

    >>> store = Store.open("sqlite:///runs.db")      # doctest: +SKIP
    >>> store.register_run(RunSpec(run_id="gpt-1"))   # doctest: +SKIP
    """

    def __init__(self, engine: Engine, *, alert_hook: AlertHook | None = None) -> None:
        self.engine = engine
        self._cache = writer.WriteCache()
        self.alert_hook = alert_hook or AlertHook()
        self._locks_guard = threading.Lock()
        self._detector_locks: dict[tuple[int, int], threading.Lock] = {}

    @classmethod
    def open(cls, url: str, *, check_schema: bool = True) -> Store:
        engine = make_engine(url)
        if check_schema:
            try:
                verify_schema(engine)
            except BaseException:
                engine.dispose()
                raise
        return cls(engine)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def _session(self) -> Iterator[Session]:
        """Commit on success, roll back on failure, and translate database errors once, here."""
        session = Session(self.engine, expire_on_commit=False)
        try:
            yield session
            session.commit()
        except ServiceError:
            session.rollback()
            raise
        except sa.exc.OperationalError as exc:
            session.rollback()
            log.warning("database unavailable: %s", exc.orig)
            raise StorageUnavailable(f"the database is unavailable, retry later ({type(exc.orig).__name__})") from exc
        except sa.exc.IntegrityError as exc:
            session.rollback()
            raise Conflict(f"the data conflicts with what is stored: {exc.orig}") from exc
        except sa.exc.DataError as exc:
            session.rollback()
            raise InvalidPayload(f"a value does not fit the database: {exc.orig}") from exc
        finally:
            session.close()

    # -- writes ---------------------------------------------------------------------------

    def register_run(self, spec: RunSpec) -> tuple[RunSummary, bool]:
        """Create the run, or return the existing one (resume). Returns (run, created)."""
        now = datetime.now(UTC)
        with self._session() as s:
            conn = s.connection()
            created = conn.execute(
                writer.upsert_insert(conn)(SqlRun)
                .values(run_id=spec.run_id, model=spec.model, recipe=spec.recipe, world_size=spec.world_size,
                        config=spec.config, guard=spec.guard, status="running", created_at=now, updated_at=now)
                .on_conflict_do_nothing()
                .returning(SqlRun.id)
            ).first() is not None
            if not created:
                # A resumed run may come back with a new world size or config: the latest wins.
                changes = {k: v for k, v in (("model", spec.model), ("recipe", spec.recipe),
                                              ("config", spec.config), ("guard", spec.guard)) if v is not None}
                conn.execute(sa.update(SqlRun).where(SqlRun.run_id == spec.run_id)
                             .values(world_size=spec.world_size, updated_at=now, status="running", **changes))
        return self.run(spec.run_id).summary, created

    def ingest(self, batch: Batch) -> IngestResult:
        """Store a batch (one transaction), then run detection and policy over it (another),
        then answer with the run's pending commands."""
        now = datetime.now(UTC)
        with self._session() as s:
            result, run_pk, last_step = writer.ingest_batch(s.connection(), batch, now, self._cache)
        self._cache.publish()  # only facts from a committed transaction
        if result.duplicate:
            return result
        commands: list[dict[str, Any]] | None = None
        if last_step is not None:
            try:
                with self._detector_lock(run_pk, batch.rank), self._session() as s:
                    guard_batch(s.connection(), run_pk, batch, last_step, now, self.alert_hook, self._cache)
                    commands = pending_commands(s.connection(), run_pk)
                self._cache.publish()
            except Exception:  # detection is derived data: never lose a stored batch over it
                self._cache.pending.clear()
                log.exception("fp8guard: detection failed for run %s batch %s", batch.run_id, batch.batch_id)
        if commands is None:
            with self._session() as s:
                commands = pending_commands(s.connection(), run_pk)
        return dataclasses.replace(result, commands=commands)

    def _detector_lock(self, run_pk: int, rank: int) -> threading.Lock:
        """In-process order for one rank's detection (SQLite); PostgreSQL adds a row lock."""
        with self._locks_guard:
            return self._detector_locks.setdefault((run_pk, rank), threading.Lock())

    # -- reads ----------------------------------------------------------------------------

    def runs(self, *, status: str | None = None, search: str | None = None, limit: int = 100,
             offset: int = 0) -> list[RunSummary]:
        with self._session() as s:
            return reader.run_summaries(s, status=status, search=search, limit=limit, offset=offset)

    def run(self, run_id: str) -> RunDetail:
        with self._session() as s:
            return reader.run_detail(s, run_id)

    def _for_run(self, run_id: str, query: Callable[[sa.Connection, int], T]) -> T:
        """Run ``query(connection, run primary key)`` in a session; 404 for an unknown run."""
        with self._session() as s:
            conn = s.connection()
            return query(conn, reader.run_pk(conn, run_id))

    def tensors(self, run_id: str) -> list[TensorInfo]:
        return self._for_run(run_id, reader.tensor_list)

    def scalars(self, run_id: str, fields: Sequence[str], window: Window) -> ScalarSeries:
        return self._for_run(run_id, lambda conn, pk: reader.scalar_series(conn, pk, fields, window))

    def tensor_series(self, run_id: str, index: int, stat: str, window: Window) -> TensorSeries:
        return self._for_run(run_id, lambda conn, pk: reader.tensor_series(conn, pk, index, stat, window))

    def tensor_matrix(self, run_id: str, stat: str, window: Window) -> TensorMatrix:
        return self._for_run(run_id, lambda conn, pk: reader.tensor_matrix(conn, pk, stat, window))

    def events(self, run_id: str, *, kinds: Sequence[str] = (), start: int | None = None, end: int | None = None,
               limit: int = 1000) -> list[EventRecord]:
        return self._for_run(run_id, lambda conn, pk: reader.event_list(conn, pk, kinds=kinds, start=start, end=end,
                                                                         limit=limit))

    def findings(self, run_id: str) -> list[dict[str, Any]]:
        return self._for_run(run_id, reader.finding_list)

    def actions(self, run_id: str) -> list[dict[str, Any]]:
        return self._for_run(run_id, reader.action_list)

    def precision(self, run_id: str) -> list[dict[str, Any]]:
        return self._for_run(run_id, reader.precision_list)

    def checkpoints(self, run_id: str) -> list[dict[str, Any]]:
        return self._for_run(run_id, reader.checkpoint_list)

    def commands(self, run_id: str) -> list[dict[str, Any]]:
        return self._for_run(run_id, pending_commands)

    def ping(self) -> None:
        with self._session() as s:
            s.execute(sa.text("SELECT 1"))
