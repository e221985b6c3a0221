"""``Store``: the one object the stages talk to for persistence. It owns sessions and the
translation of database errors; it takes and returns domain objects only, and decides nothing:
detection and policy live in ``service/loop``, which reads and writes through ``loop_pass``."""

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

from fp8guard import wire
from fp8guard.service.domain import (
    ActionRecord,
    Batch,
    CheckpointRecord,
    EventRecord,
    FindingRecord,
    IngestResult,
    PrecisionRecord,
    RunDetail,
    RunSpec,
    RunSummary,
    ScalarSeries,
    TensorInfo,
    TensorMatrix,
    TensorSeries,
    TokenRecord,
)
from fp8guard.service.errors import Conflict, InvalidPayload, ServiceError, StorageUnavailable
from fp8guard.service.kinds import Role
from fp8guard.service.store import records, sql
from fp8guard.service.store import series_reader as reader
from fp8guard.service.store import telemetry_writer as writer
from fp8guard.service.store import tokens as token_rows
from fp8guard.service.store.engine import make_engine, verify_schema
from fp8guard.service.store.loop_state import LoopTxn
from fp8guard.service.store.models import SqlLoopQueue, SqlRun
from fp8guard.service.store.series_reader import Window
from fp8guard.service.store.sqlite_lock import DatabaseBusy, WriteTurn, take_sqlite_lock
from fp8guard.service.store.write_cache import CacheTxn, WriteCache

__all__ = ["DatabaseBusy", "Store", "Window", "WriteTurn"]

T = TypeVar("T")
_Unit = TypeVar("_Unit", Session, sa.Connection)
"""What a store transaction runs on: an ORM session, or (the ingest path) a Core connection."""

WRITE_LOCK_TIMEOUT_S = 10.0
"""How long a SQLite write waits for this process's write lock (SQLite's own ``busy_timeout``)."""

log = logging.getLogger(__name__)


class Store:
    """Durable telemetry storage on SQLite or PostgreSQL.

    >>> store = Store.open("sqlite:///runs.db")      # doctest: +SKIP
    >>> store.register_run(RunSpec(run_id="gpt-1"))   # doctest: +SKIP
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cache = WriteCache()
        self.on_database_error: list[Callable[[BaseException], None]] = []
        """Called with each driver (DB-API) error a transaction of this store raised (the metrics)."""
        self._write_lock: threading.Lock | None = threading.Lock() if engine.dialect.name == "sqlite" else None
        """SQLite has one write lock per database, and a connection that finds it taken sleeps and
        retries (1, 2, 5, ... up to 100 ms between tries): the ingest writer and the loop threads
        missed each other's commits by tens of milliseconds, hundreds under load. Every write
        transaction of this store queues on this lock instead, handed over at once, and gives up
        after ``WRITE_LOCK_TIMEOUT_S`` as SQLite's own busy timeout would; other processes (and the
        alert dispatcher, which writes through the engine) still wait on SQLite's."""
        self._holding = threading.local()  # .lock: this thread took the write lock (try_ingest_now)
        self.write_turn: WriteTurn | None = None
        """SQLite: this process's side of the write-lock priority it shares with a loop process."""

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
    def _session(self, *, write: bool = False) -> Iterator[Session]:
        """An ORM session in a transaction: committed on success, rolled back on failure, database
        errors translated once, here. ``write``: a transaction that writes (on SQLite it first
        takes the process's write lock, then the database's: see ``sqlite_lock.take_sqlite_lock``)."""
        with self._transaction(lambda: Session(self.engine, expire_on_commit=False), write=write) as session:
            yield session

    @contextmanager
    def _connection(self, *, write: bool = False) -> Iterator[sa.Connection]:
        """``_session`` without the ORM: a Core connection in a transaction, for the ingest path,
        whose statements all run on the driver's cursor (the session's bookkeeping cost ~0.1 ms
        of CPU per transaction on the bench host, a few % of a small batch)."""
        def begin() -> sa.Connection:
            conn = self.engine.connect()
            try:
                conn.begin()
            except BaseException:
                conn.close()
                raise
            return conn

        with self._transaction(begin, write=write) as conn:
            yield conn

    @contextmanager
    def _transaction(self, open_unit: Callable[[], _Unit], *, write: bool) -> Iterator[_Unit]:
        if write and self._write_lock is not None:
            if getattr(self._holding, "lock", False):  # try_ingest_now holds the process's lock
                with self._transaction(open_unit, write=False) as unit:
                    take_sqlite_lock(unit, at_once=True, turn=self.write_turn)
                    yield unit
                return
            if not self._write_lock.acquire(timeout=WRITE_LOCK_TIMEOUT_S):
                raise StorageUnavailable(f"the database stayed busy for {WRITE_LOCK_TIMEOUT_S:g} s; retry later")
            try:
                with self._transaction(open_unit, write=False) as unit:
                    take_sqlite_lock(unit, at_once=False, turn=self.write_turn)
                    yield unit
            finally:
                self._write_lock.release()
            return
        session: _Unit | None = None
        try:
            session = open_unit()
            yield session
            session.commit()
        except ServiceError:
            self._rollback(session)
            raise
        except sa.exc.OperationalError as exc:
            self._rollback(session)
            _raise_if_stale(exc.orig)
            log.warning("database unavailable: %s", exc.orig)
            raise StorageUnavailable(f"the database is unavailable, retry later ({type(exc.orig).__name__})") from exc
        except sa.exc.IntegrityError as exc:
            self._rollback(session)
            raise Conflict(f"the data conflicts with what is stored: {exc.orig}") from exc
        except sa.exc.DataError as exc:
            self._rollback(session)
            raise InvalidPayload(f"a value does not fit the database: {exc.orig}") from exc
        except Exception as exc:
            # Statements of ``store/sql.py`` run on the driver's cursor: its (DB-API) errors are
            # translated here too, and reported to ``on_database_error`` (SQLAlchemy's own errors
            # reach its ``handle_error`` listeners).
            self._rollback(session)
            dbapi = self.engine.dialect.dbapi
            if dbapi is None or not isinstance(exc, dbapi.Error):
                raise
            _raise_if_stale(exc)
            for hook in self.on_database_error:
                hook(exc)
            if isinstance(exc, dbapi.IntegrityError):
                raise Conflict(f"the data conflicts with what is stored: {exc}") from exc
            if isinstance(exc, dbapi.DataError):
                raise InvalidPayload(f"a value does not fit the database: {exc}") from exc
            log.warning("database unavailable: %s", exc)
            raise StorageUnavailable(f"the database is unavailable, retry later ({type(exc).__name__})") from exc
        finally:
            if session is not None:
                session.close()

    def _rollback(self, session: Session | sa.Connection | None) -> None:
        """Roll back after a failure; a rollback that fails too (the connection was lost: the
        server restarted, or killed it) is not what the caller reports. SQLAlchemy has invalidated
        the pool (its connections reconnect at their next checkout)."""
        if session is None:  # the failure was opening it
            return
        try:
            session.rollback()
        except sa.exc.DBAPIError as exc:
            log.warning("database connection lost: %s", exc.orig)

    # -- writes ---------------------------------------------------------------------------

    def register_run(self, spec: RunSpec, *, owner_token_id: int | None = None,
                     actor: str = "anonymous") -> tuple[RunSummary, bool]:
        """Create the run, or return the existing one (resume). Returns (run, created).

        A guard set or changed here is recorded as a ``guard_changed`` event naming ``actor``,
        in the same transaction; a resume without a guard keeps the stored one."""
        now = datetime.now(UTC)
        with self._session(write=True) as s:
            conn = s.connection()
            created_pk = conn.execute(
                writer.upsert_insert(conn)(SqlRun)
                .values(run_id=spec.run_id, model=spec.model, recipe=spec.recipe, world_size=spec.world_size,
                        config=spec.config, guard=spec.guard, status="running", created_at=now, updated_at=now,
                        owner_token_id=owner_token_id)
                .on_conflict_do_nothing()
                .returning(SqlRun.id)
            ).scalar()
            if created_pk is not None:
                if spec.guard is not None:
                    token_rows.audit_guard(conn, int(created_pk), None, spec.guard, actor, now)
            else:
                # A resumed run may come back with a new world size or config: the latest wins.
                pk, old_guard = conn.execute(sa.select(SqlRun.id, SqlRun.guard)
                                             .where(SqlRun.run_id == spec.run_id)).one()
                changes = {k: v for k, v in (("model", spec.model), ("recipe", spec.recipe),
                                              ("config", spec.config), ("guard", spec.guard)) if v is not None}
                conn.execute(sa.update(SqlRun).where(SqlRun.id == pk)
                             .values(world_size=spec.world_size, updated_at=now, status="running", **changes))
                if spec.guard is not None and spec.guard != old_guard:
                    token_rows.audit_guard(conn, int(pk), old_guard, spec.guard, actor, now)
        return self.run(spec.run_id).summary, created_pk is not None

    def set_guard(self, run_id: str, guard: dict[str, Any], actor: str) -> dict[str, Any] | None:
        """Replace the run's guard overrides (audited as ``guard_changed``); returns the old ones."""
        now = datetime.now(UTC)
        with self._session(write=True) as s:
            conn = s.connection()
            pk = reader.run_pk(conn, run_id)
            old: dict[str, Any] | None = conn.scalar(sa.select(SqlRun.guard).where(SqlRun.id == pk))
            if old != guard:
                conn.execute(sa.update(SqlRun).where(SqlRun.id == pk).values(guard=guard, updated_at=now))
                token_rows.audit_guard(conn, pk, old, guard, actor, now)
        return old

    # -- tokens, sessions, run ownership --------------------------------------------------------

    def create_token(self, *, name: str, role: Role, run_prefix: str | None, secret_hash: str,
                     hint: str) -> TokenRecord:
        with self._session(write=True) as s:
            return token_rows.insert_token(s, name=name, role=role, run_prefix=run_prefix, secret_hash=secret_hash,
                                       hint=hint, now=datetime.now(UTC))

    def tokens(self, *, include_revoked: bool = False) -> list[TokenRecord]:
        with self._session() as s:
            return token_rows.token_list(s, include_revoked=include_revoked)

    def revoke_token(self, name: str) -> TokenRecord:
        with self._session(write=True) as s:
            return token_rows.revoke_token(s, name, datetime.now(UTC))

    def token_by_hash(self, secret_hash: str) -> TokenRecord | None:
        with self._session() as s:
            return token_rows.token_by_hash(s.connection(), secret_hash)

    def open_session(self, secret_hash: str, token_id: int, expires_at: datetime) -> None:
        with self._session(write=True) as s:
            token_rows.insert_session(s, secret_hash=secret_hash, token_id=token_id, now=datetime.now(UTC),
                                  expires_at=expires_at)

    def session_token(self, secret_hash: str) -> TokenRecord | None:
        with self._session() as s:
            return token_rows.session_token(s.connection(), secret_hash, datetime.now(UTC))

    def close_session(self, secret_hash: str) -> None:
        with self._session(write=True) as s:
            token_rows.delete_session(s, secret_hash)

    def run_owner(self, run_id: str) -> tuple[bool, int | None]:
        """(the run exists, the token that registered it)."""
        with self._session() as s:
            return token_rows.run_owner(s.connection(), run_id)

    def ingest(self, batch: Batch) -> IngestResult:
        """Store one batch in its own transaction (with the run's pending commands)."""
        result = self.ingest_many([batch])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def try_ingest_now(self, batch: Batch) -> list[IngestResult | ServiceError] | None:
        """``ingest_many([batch])`` if no write holds the database this instant, else None at once,
        without waiting (the ingest committer's event-loop path: it must never wait on a closed-loop
        pass, of this process or of the loop's own process). Always stores on PostgreSQL, which has
        no database-wide write lock."""
        if self._write_lock is None:
            return self.ingest_many([batch])
        if not self._write_lock.acquire(blocking=False):
            return None
        self._holding.lock = True
        try:
            return self.ingest_many([batch])
        except DatabaseBusy:
            return None  # another process's write holds SQLite's lock: nothing was written
        finally:
            self._holding.lock = False
            self._write_lock.release()

    def ingest_many(self, batches: Sequence[Batch]) -> list[IngestResult | ServiceError]:
        """Group commit: store every batch in one transaction, each answered with the run's
        pending commands. If the group fails, each batch is retried in a transaction of its
        own, so one bad batch is refused alone and the others are stored.

        On PostgreSQL the transaction is one pipeline: BEGIN, its batches' writes, their answers'
        reads and the COMMIT go out together, one round trip for ranks this process wrote last
        (``_store_checked``; 16 when each statement waited)."""
        now = datetime.now(UTC)
        # One lock order for every process: ranks are locked in (run, rank) order, never crosswise.
        order = sorted(range(len(batches)), key=lambda i: (batches[i].run_id, batches[i].rank))
        if len(batches) > 1:
            try:
                results = self._store_checked([batches[i] for i in order], now)
                by_index = dict(zip(order, results, strict=True))
                return [by_index[i] for i in range(len(batches))]
            except ServiceError:
                pass  # nothing of the failed transaction is published; retry batch by batch
        out: list[IngestResult | ServiceError] = []
        for batch in batches:
            try:
                out += self._store_checked([batch], now)
            except ServiceError as exc:
                out.append(exc)
        return out

    def _store_checked(self, batches: Sequence[Batch], now: datetime) -> list[IngestResult]:
        """``_store_group``, first against the ranks' progress as this process last wrote it (no
        wait to read it, PostgreSQL), then, if another process wrote a rank meanwhile or a batch
        is a duplicate, again reading it (``writer.StaleProgress``: the first try wrote nothing)."""
        txn = self._cache.begin()
        try:
            results = self._store_group(batches, now, txn)
        except writer.StaleProgress:
            txn = self._cache.begin(optimistic=False)
            results = self._store_group(batches, now, txn)
        self._cache.publish(txn)
        return results

    def _store_group(self, batches: Sequence[Batch], now: datetime, txn: CacheTxn) -> list[IngestResult]:
        """Write ``batches`` in one transaction and commit; their results once committed."""
        with self._connection(write=True) as conn, sql.pipeline(conn, commit=True):
            stored = [self._write(conn, batch, now, txn) for batch in batches]
        return [done() for done in stored]

    def _write(self, conn: sa.Connection, batch: Batch, now: datetime,
               txn: CacheTxn) -> Callable[[], IngestResult]:
        result, run_pk, queue_row = writer.ingest_batch(conn, batch, now, txn)
        commands = records.pending_commands_later(conn, run_pk)

        def done() -> IngestResult:
            queue_id = None if queue_row is None else int(queue_row.rows()[0][0])
            return dataclasses.replace(result, queue_id=queue_id, commands=commands())
        return done

    def run_pk(self, run_id: str) -> int:
        """The run's primary key (404 for an unknown run); cached once known."""
        pk = self._cache.run_pks.get(run_id)
        if pk is None:
            with self._session() as s:
                pk = reader.run_pk(s.connection(), run_id)
        return pk

    # -- the closed loop ----------------------------------------------------------------------

    def loop_pass(self, run_pk: int, judge: Callable[[LoopTxn], T]) -> T:
        """Run ``judge`` on the run's loop state in one transaction, under the run's loop lock
        (``LoopTxn`` takes it before the transaction's first statement)."""
        with self._session(write=True) as s:
            return judge(LoopTxn(s.connection(), run_pk, datetime.now(UTC)))

    def queued_runs(self, limit: int = 1000) -> list[int]:
        """Runs with stored batches the loop has not judged (a crash's or another process's)."""
        with self._session() as s:
            return [int(pk) for pk in s.scalars(sa.select(SqlLoopQueue.run_pk).distinct().limit(limit))]

    def drop_queued(self, queue_ids: Sequence[int]) -> None:
        """Give up on queued batches the loop cannot judge (logged by the caller)."""
        with self._session(write=True) as s:
            s.execute(sa.delete(SqlLoopQueue).where(SqlLoopQueue.id.in_(list(queue_ids))))

    # -- reads ----------------------------------------------------------------------------

    def runs(self, *, status: str | None = None, search: str | None = None, limit: int = 100,
             offset: int = 0) -> list[RunSummary]:
        with self._session(write=True) as s:
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
               limit: int = 1000, after: int | None = None) -> list[EventRecord]:
        return self._for_run(run_id, lambda conn, pk: reader.event_list(conn, pk, kinds=kinds, start=start, end=end,
                                                                         limit=limit, after=after))

    def findings(self, run_id: str) -> list[FindingRecord]:
        return self._for_run(run_id, records.finding_list)

    def actions(self, run_id: str) -> list[ActionRecord]:
        return self._for_run(run_id, records.action_list)

    def precision(self, run_id: str) -> list[PrecisionRecord]:
        return self._for_run(run_id, records.precision_list)

    def checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        return self._for_run(run_id, records.checkpoint_list)

    def commands(self, run_id: str) -> list[wire.Command]:
        return self._for_run(run_id, records.pending_commands)

    def run_metrics(self, max_runs: int) -> tuple[list[records.RunMetrics], int]:
        """Active runs' figures for ``/metrics`` (at most ``max_runs``) and the number of active runs."""
        with self.engine.connect() as conn:
            return records.active_run_metrics(conn, max_runs)

    def outbox_backlog(self) -> dict[str, dict[str, int]]:
        from fp8guard.service.store.outbox import backlog

        with self.engine.connect() as conn:
            return backlog(conn)

    def ping(self) -> None:
        with self._session() as s:
            s.execute(sa.text("SELECT 1"))


def _raise_if_stale(exc: BaseException | None) -> None:
    """A failed progress check (``writer.StaleProgress``) is not a database error: the caller
    writes the batch again."""
    if getattr(exc, "sqlstate", None) == writer.STALE_PROGRESS_SQLSTATE:
        raise writer.StaleProgress(str(exc).splitlines()[0]) from exc
