"""SQLAlchemy 2 models: the ORM view of the schema that ``migrations/`` defines.

ORM rows never leave ``fp8guard.service.store``; readers convert them to the dataclasses in
``fp8guard.service.domain``. The layout is justified in ``docs/architecture.md``:
scalars get one row per (run, rank, segment, step); per-tensor statistics get one float32
blob per (stat, step) holding every tensor, plus min/max roll-ups per block of 16, 256
and 4096 steps so that any zoom level reads at most a few thousand rows.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

__all__ = [
    "Base",
    "SqlAction",
    "SqlAlert",
    "SqlBatch",
    "SqlCheckpoint",
    "SqlDetectorState",
    "SqlEvent",
    "SqlFinding",
    "SqlLayerPrecision",
    "SqlLoopQueue",
    "SqlRun",
    "SqlRunRank",
    "SqlSegment",
    "SqlSession",
    "SqlStat",
    "SqlStep",
    "SqlTensor",
    "SqlTensorSeries",
    "SqlToken",
]

# Deterministic constraint names, so Alembic can alter them and the model/migration check is exact.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

class UtcDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite hands back naive ones)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


# SQLite only auto-increments an INTEGER PRIMARY KEY, not BIGINT.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class SqlRun(Base):
    """A training run, shared by all of its ranks."""

    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(128), unique=True)
    """The client-chosen identity, the same on every rank."""
    model: Mapped[str | None] = mapped_column(String(256))
    recipe: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    world_size: Mapped[int] = mapped_column(Integer, default=1)
    config: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    guard: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """Per-run detection thresholds and policy overrides (``GuardConfig`` fields), dry_run included."""
    status: Mapped[str] = mapped_column(String(16), default="running")
    """running | finished | failed; set by run_finished / run_failed events."""
    owner_token_id: Mapped[int | None] = mapped_column(Integer)
    """The ingest token that registered the run (migration 0004): an ingest token without a run-id
    prefix may write only to runs it registered. NULL: registered without authentication."""
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime())


class SqlRunRank(Base):
    """Per-rank progress; updating it first in every ingest serialises writers of one rank."""

    __tablename__ = "run_ranks"

    run_pk: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    last_step: Mapped[int | None] = mapped_column(BigInteger)
    last_segment: Mapped[int] = mapped_column(Integer, default=0)
    last_time: Mapped[float | None] = mapped_column(Float)
    last_loss: Mapped[float | None] = mapped_column(Float)
    """NULL when unknown or NaN; ``last_loss_nan`` tells which."""
    last_loss_nan: Mapped[bool] = mapped_column(default=False)
    batches: Mapped[int] = mapped_column(BigInteger, default=0)
    samples: Mapped[int] = mapped_column(BigInteger, default=0)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime())


class SqlSegment(Base):
    """A stretch of steps between rollbacks: a rollback starts a new segment at an earlier step."""

    __tablename__ = "segments"

    run_pk: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    segment: Mapped[int] = mapped_column(Integer, primary_key=True)
    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)


class SqlBatch(Base):
    """One accepted ingest batch; its primary key is what makes a retry a no-op."""

    __tablename__ = "ingest_batches"

    run_pk: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    batch_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer)
    received_at: Mapped[datetime] = mapped_column(UtcDateTime())
    steps: Mapped[int] = mapped_column(Integer)
    samples: Mapped[int] = mapped_column(BigInteger)


class SqlTensor(Base):
    """The run's tensor table: the position of each tensor inside every stats blob."""

    __tablename__ = "tensors"
    __table_args__ = (UniqueConstraint("run_pk", "name"),)

    run_pk: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(512))
    module: Mapped[str | None] = mapped_column(String(512))
    role: Mapped[str | None] = mapped_column(String(64))
    fp8_format: Mapped[str | None] = mapped_column(String(16))
    first_step: Mapped[int] = mapped_column(BigInteger)
    """Cells before this step are "no data", not NaN."""


class SqlStat(Base):
    """Names of per-tensor statistics, numbered per run (amax, scale, saturation, ...)."""

    __tablename__ = "stats"
    __table_args__ = (UniqueConstraint("run_pk", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_pk: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(64))


class SqlStep(Base):
    """Per-step training scalars. NaN is stored as NULL plus a bit in ``nan_mask``
    (SQLite cannot store NaN), so "not reported" and "NaN" stay distinct."""

    __tablename__ = "steps"

    run_pk: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    segment: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    time: Mapped[float | None] = mapped_column(Float)
    loss: Mapped[float | None] = mapped_column(Float)
    grad_norm: Mapped[float | None] = mapped_column(Float)
    lr: Mapped[float | None] = mapped_column(Float)
    tokens: Mapped[int | None] = mapped_column(BigInteger)
    loss_fp8: Mapped[float | None] = mapped_column(Float)
    """Harm probe (migration 0005): at the steps it ran, the training forward's loss ..."""
    loss_bf16: Mapped[float | None] = mapped_column(Float)
    """... the same batch's loss with FP8 off ..."""
    fp8_loss_gap: Mapped[float | None] = mapped_column(Float)
    """... and ``(loss_fp8 - loss_bf16) / loss_bf16``."""
    nan_mask: Mapped[int] = mapped_column(SmallInteger, default=0)
    """Bit i set: ``wire.STEP_FIELDS[i]`` (loss, grad_norm, lr, loss_fp8, loss_bf16, fp8_loss_gap) was NaN."""


class SqlTensorSeries(Base):
    """Per-tensor statistics. ``level`` is the block size in steps: level 1 rows hold the raw
    float32 values of all tensors at one step; level 16/256/4096 rows hold the element-wise
    min then max over the block (NaN-propagating: a block that saw a NaN reports NaN)."""


    __tablename__ = "tensor_series"

    # The natural key is the primary key: no surrogate id, whose column and index would cost
    # bytes on every row of the largest table.
    run_pk: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    segment: Mapped[int] = mapped_column(Integer, primary_key=True)
    stat_id: Mapped[int] = mapped_column(ForeignKey("stats.id", ondelete="CASCADE"), primary_key=True)
    level: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    block: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    """step // level"""
    data: Mapped[bytes] = mapped_column(LargeBinary)


class SqlEvent(Base):
    """Run events: started/resumed/finished, checkpoints, fallbacks, rollbacks, acks."""

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run_step", "run_pk", "step"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_pk: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    segment: Mapped[int] = mapped_column(Integer)
    step: Mapped[int | None] = mapped_column(BigInteger)
    time: Mapped[float | None] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(32))
    data: Mapped[dict[str, Any]] = mapped_column(JSON)


# -- closing the loop (migration 0002) --------------------------------------------------------------


class SqlDetectorState(Base):
    """The detector's checkpointable state per (run, rank): windows, EMAs, counters."""

    __tablename__ = "detector_states"

    run_pk: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    state: Mapped[dict[str, Any]] = mapped_column(JSON)
    last_step: Mapped[int | None] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime())


class SqlFinding(Base):
    """Something a detection rule saw, with its evidence and a one-sentence explanation."""

    __tablename__ = "findings"
    __table_args__ = (Index("ix_findings_run_step", "run_pk", "step"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_pk: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    segment: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(BigInteger)
    onset_step: Mapped[int] = mapped_column(BigInteger)
    rule: Mapped[str] = mapped_column(String(48))
    severity: Mapped[str] = mapped_column(String(16))
    explanation: Mapped[str] = mapped_column(String(1024))
    modules: Mapped[list[str]] = mapped_column(JSON)
    evidence: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())


class SqlAction(Base):
    """A policy decision (stored with its reason) and, unless dry-run, the command to the agent."""

    __tablename__ = "actions"
    __table_args__ = (Index("ix_actions_run_status", "run_pk", "status"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_pk: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(24))
    """fallback | promote | rollback | page"""
    status: Mapped[str] = mapped_column(String(16))
    """recommended (dry run) | pending | applied | failed | superseded"""
    step: Mapped[int] = mapped_column(BigInteger)
    """The step at which the service decided."""
    reason: Mapped[str] = mapped_column(String(1024))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    finding_ids: Mapped[list[int]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    applied_step: Mapped[int | None] = mapped_column(BigInteger)
    applied_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    error: Mapped[str | None] = mapped_column(String(1024))


class SqlCheckpoint(Base):
    """Checkpoints the agent reported; ``known_good`` once no finding touched their window."""

    __tablename__ = "checkpoints"

    run_pk: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    segment: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    path: Mapped[str | None] = mapped_column(String(1024))
    known_good: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())


class SqlLayerPrecision(Base):
    """Each module's precision and since when, as the agent reported it applied (``*_applied``
    events): the one source of truth. Decisions never write here."""

    __tablename__ = "layer_precision"

    run_pk: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    module: Mapped[str] = mapped_column(String(512), primary_key=True)
    precision: Mapped[str] = mapped_column(String(8))
    since_step: Mapped[int] = mapped_column(BigInteger)
    action_id: Mapped[int | None] = mapped_column(BigInteger)


class SqlLoopQueue(Base):
    """Stored batches the closed loop has not judged yet (migration 0003). Ingest inserts a row in
    the batch's own transaction, under the rank's lock, so ids grow in each rank's write order;
    the loop deletes the rows it judged in the transaction that stores its findings and
    decisions, so every acknowledged batch is judged exactly once, even across a crash."""

    __tablename__ = "loop_queue"
    __table_args__ = (Index("ix_loop_queue_run", "run_pk", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_pk: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    segment: Mapped[int] = mapped_column(Integer)
    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)


class SqlAlert(Base):
    """Alert outbox: one row per (sink, alert); retried with backoff until delivered, so no
    alert is lost across restarts; ``dedupe_key`` suppresses duplicates."""

    __tablename__ = "alert_outbox"
    __table_args__ = (
        UniqueConstraint("sink", "dedupe_key"),
        Index("ix_alert_outbox_due", "status", "next_attempt_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_pk: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    sink: Mapped[str] = mapped_column(String(32))
    dedupe_key: Mapped[str] = mapped_column(String(256))
    kind: Mapped[str] = mapped_column(String(48))
    severity: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    """pending | sent | failed (gave up) | resolved"""
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(UtcDateTime())
    last_error: Mapped[str | None] = mapped_column(String(1024))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    sent_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    active_until: Mapped[datetime | None] = mapped_column(UtcDateTime())
    """Alertmanager alerts are re-sent while active and resolved (endsAt=now) after."""


# -- authentication (migration 0004) ----------------------------------------------------------------


class SqlToken(Base):
    """An API token. Only the SHA-256 of the secret is stored: the token is shown once, at creation.
    Revoked tokens stay (with ``revoked_at``) so the audit trail keeps naming them."""

    __tablename__ = "tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    """Who or what holds it; audit events name it. Unique among tokens not revoked."""
    role: Mapped[str] = mapped_column(String(16))
    """``kinds.Role``"""
    run_prefix: Mapped[str | None] = mapped_column(String(128))
    """Ingest tokens only: the run ids it may write (every run under the prefix)."""
    secret_hash: Mapped[str] = mapped_column(String(64), unique=True)
    hint: Mapped[str] = mapped_column(String(16))
    """The token's first characters, to recognise it in a list."""
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime())


class SqlSession(Base):
    """A browser session opened with a token on the login page; it dies with its token."""

    __tablename__ = "sessions"

    secret_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_id: Mapped[int] = mapped_column(ForeignKey("tokens.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime())
