"""The alert outbox table: rows written in the caller's transaction, claimed and updated by the
dispatcher. Persistence only: which alerts exist and where they go is decided by
``service/alerts``.

Row life cycle (``status``):

- ``pending``: due at ``next_attempt_at``.
- ``sent``: delivered. Alertmanager rows (``active_until`` set) stay due while the alert is active,
  because Alertmanager expects active alerts to be re-sent; the last send carries ``endsAt`` = now.
- ``resolved``: an Alertmanager row whose final, resolving send was accepted.
- ``failed``: given up (``max_attempts`` failures in a row, or HTTP 410 Gone).

Claiming works the same on both backends: one ``UPDATE ... WHERE id IN (SELECT ... LIMIT n)
RETURNING`` moves the chosen rows' ``next_attempt_at`` to a lease deadline and commits. On
PostgreSQL the inner SELECT is ``FOR UPDATE SKIP LOCKED``, so several service processes claim
disjoint rows without waiting on each other; on SQLite the UPDATE takes the database's single
write lock, which serialises claims just as well.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fp8guard.service.store.models import SqlAlert
from fp8guard.service.store.telemetry_writer import upsert_insert

__all__ = [
    "RESOLVED_SUFFIX",
    "STATUSES",
    "OutboxEntry",
    "OutboxRow",
    "backlog",
    "claim_due",
    "insert_rows",
    "new_message_id",
    "record",
    "record_active",
    "renew",
    "resolve",
    "utc",
]

STATUSES = ("pending", "sent", "failed", "resolved")
RESOLVED_SUFFIX = ":resolved"
"""Appended to the dedupe key of the resolution notice sent to webhook and Slack sinks."""
_T = cast(sa.Table, SqlAlert.__table__)


def utc(when: datetime) -> datetime:
    """``when`` in UTC. Naive datetimes are refused: SQLite stores datetimes as text without an
    offset, so mixing zones would silently break the ``next_attempt_at <= now`` comparisons."""
    if when.tzinfo is None:
        raise ValueError("naive datetime: pass a timezone-aware one, e.g. datetime.now(UTC)")
    return when.astimezone(UTC)


def new_message_id() -> str:
    """A globally unique ``webhook-id``; stored in the row so every retry reuses it."""
    return f"msg_{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """One alert for one sink, to be inserted (``payload`` holds the alert's JSON)."""

    sink: str
    dedupe_key: str
    kind: str
    severity: str
    payload: dict[str, Any]
    now: datetime
    active_until: datetime | None = None
    quiet_s: float = 0.0
    """One page per incident: skipped when the run already has a row of this sink and kind
    created within the last ``quiet_s`` seconds (not given up, not a resolution notice, and
    no resolution since)."""


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    """A claimed row, as the dispatcher delivers it."""

    id: int
    sink: str
    status: str
    payload: dict[str, Any]
    attempts: int
    created_at: datetime
    next_attempt_at: datetime
    active_until: datetime | None


def insert_rows(conn: sa.Connection, rows: Sequence[OutboxRow], *, run_pk: int | None) -> int:
    """Insert in the caller's transaction; a (sink, dedupe_key) already queued is skipped with
    ``ON CONFLICT DO NOTHING`` (which, unlike catching an IntegrityError, leaves a PostgreSQL
    transaction usable). Returns how many rows were new."""
    rows = _outside_open_incidents(conn, rows, run_pk)
    if not rows:
        return 0
    values = [{"run_pk": run_pk, "sink": r.sink, "dedupe_key": r.dedupe_key, "kind": r.kind, "severity": r.severity,
               "status": "pending", "payload": r.payload, "attempts": 0, "next_attempt_at": utc(r.now),
               "last_error": None, "created_at": utc(r.now), "sent_at": None, "active_until": r.active_until}
              for r in rows]
    stmt = (upsert_insert(conn)(SqlAlert).values(values)
            .on_conflict_do_nothing(index_elements=[SqlAlert.sink, SqlAlert.dedupe_key])
            # rowcount is not portable for INSERT .. ON CONFLICT; RETURNING lists only the new rows.
            .returning(SqlAlert.id))
    return len(conn.execute(stmt).all())


def _outside_open_incidents(conn: sa.Connection, rows: Sequence[OutboxRow], run_pk: int | None) -> list[OutboxRow]:
    """``rows`` less those whose (run, sink, kind) already paged within their ``quiet_s``: one
    read per such row, and alerts are rare (a storm of them is what this bounds)."""
    kept: list[OutboxRow] = []
    opened: set[tuple[str, str]] = set()
    for r in rows:
        if r.quiet_s > 0 and run_pk is not None:
            if (r.sink, r.kind) in opened:
                continue
            since = utc(r.now) - timedelta(seconds=r.quiet_s)
            recent = sa.select(_T.c.dedupe_key, _T.c.status).where(
                _T.c.run_pk == run_pk, _T.c.sink == r.sink, _T.c.kind == r.kind, _T.c.created_at >= since,
                _T.c.status != "failed").order_by(_T.c.created_at.desc(), _T.c.id.desc()).limit(1)
            last = conn.execute(recent).first()
            if last is not None and not str(last.dedupe_key).endswith(RESOLVED_SUFFIX):
                continue  # the incident this alert belongs to already paged this sink
            opened.add((r.sink, r.kind))
        kept.append(r)
    return kept


def resolve(conn: sa.Connection, dedupe_key: str, now: datetime, *, notify: bool = True) -> int:
    """Mark the alert ``dedupe_key`` resolved on every sink; return how many rows changed or were added.

    Alertmanager rows still pending or active become due now with ``active_until`` = now, so the
    dispatcher's next send carries ``endsAt`` = now and then marks them resolved. For webhook and
    Slack rows not given up, a resolution notice (``fp8guard.<kind>.resolved``) is queued under
    ``dedupe_key + ":resolved"`` unless ``notify`` is false. Idempotent; runs in the caller's
    transaction. Delivery order between the original and its notice is not guaranteed.
    """
    now = utc(now)
    changed = conn.execute(
        sa.update(_T)
        .where(_T.c.dedupe_key == dedupe_key, _T.c.active_until.is_not(None), _T.c.status.in_(("pending", "sent")))
        .values(active_until=now, next_attempt_at=now)
        .returning(_T.c.id)
    ).all()
    if not notify:
        return len(changed)
    originals = conn.execute(
        sa.select(_T.c.run_pk, _T.c.sink, _T.c.kind, _T.c.severity, _T.c.payload)
        .where(_T.c.dedupe_key == dedupe_key, _T.c.active_until.is_(None), _T.c.status.in_(("pending", "sent")))
    ).all()
    added = 0
    for row in originals:
        payload = dict(row.payload)
        if payload["alert"].get("resolved"):
            continue  # already a notice of something over: nothing left to resolve
        payload["alert"] = {**payload["alert"], "resolved": True}
        payload["message_id"] = new_message_id()
        added += insert_rows(conn, [OutboxRow(sink=row.sink, dedupe_key=dedupe_key + RESOLVED_SUFFIX, kind=row.kind,
                                              severity=row.severity, payload=payload, now=now)], run_pk=row.run_pk)
    return len(changed) + added


def claim_due(engine: Engine, sinks: Sequence[str], now: datetime, lease_until: datetime, limit: int) -> list[OutboxEntry]:
    """Claim up to ``limit`` rows due at ``now`` for ``sinks`` until ``lease_until`` (committed)."""
    due = (
        sa.select(_T.c.id)
        .where(
            _T.c.sink.in_(list(sinks)),
            _T.c.next_attempt_at <= utc(now),
            sa.or_(_T.c.status == "pending",
                   # an active Alertmanager alert awaiting its periodic re-send or final resolve
                   sa.and_(_T.c.status == "sent", _T.c.active_until.is_not(None))),
        )
        .order_by(_T.c.next_attempt_at, _T.c.id)
        .limit(limit)
    )
    # A read-only probe first: on SQLite every UPDATE takes the database's only write lock,
    # and an idle outbox should not contend with ingest once per poll interval.
    with engine.connect() as conn:
        if conn.execute(due.limit(1)).first() is None:
            return []
    if engine.dialect.name == "postgresql":
        due = due.with_for_update(skip_locked=True)
    with engine.begin() as conn:
        rows = conn.execute(
            sa.update(_T).where(_T.c.id.in_(due.scalar_subquery())).values(next_attempt_at=lease_until)
            .returning(_T.c.id, _T.c.sink, _T.c.status, _T.c.payload, _T.c.attempts, _T.c.created_at,
                       _T.c.next_attempt_at, _T.c.active_until)
        ).all()
    entries = [OutboxEntry(id=int(r.id), sink=str(r.sink), status=str(r.status), payload=dict(r.payload),
                           attempts=int(r.attempts), created_at=_aware(r.created_at),
                           next_attempt_at=_aware(r.next_attempt_at),
                           active_until=None if r.active_until is None else _aware(r.active_until)) for r in rows]
    return sorted(entries, key=lambda e: (e.next_attempt_at, e.id))


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def renew(engine: Engine, row_id: int, held: datetime, until: datetime) -> bool:
    """Move a claimed row's lease from ``held`` (the lease this claim holds) to ``until``; False
    when the row no longer carries that lease (another process claimed it since, or it was
    delivered), and then this claim must not send it."""
    with engine.begin() as conn:
        moved = conn.execute(sa.update(_T).where(_T.c.id == row_id, _T.c.next_attempt_at == utc(held))
                             .values(next_attempt_at=utc(until)).returning(_T.c.id)).first()
    return moved is not None


def record(engine: Engine, row_id: int, **values: Any) -> None:
    """Write a delivery outcome (status, attempts, last_error, sent_at, next_attempt_at)."""
    with engine.begin() as conn:
        conn.execute(sa.update(_T).where(_T.c.id == row_id).values(**values))


def record_active(engine: Engine, row_id: int, now: datetime, next_at: datetime) -> None:
    """An active Alertmanager alert was (re)sent: due again at ``next_at``, or at ``active_until`` if
    sooner. ``active_until`` is read in SQL: ``resolve()`` may have moved it while sending."""
    with engine.begin() as conn:
        conn.execute(sa.update(_T).where(_T.c.id == row_id).values(
            status="sent", attempts=0, last_error=None, sent_at=now,
            next_attempt_at=sa.case((_T.c.active_until < next_at, _T.c.active_until), else_=next_at)))


def backlog(conn: sa.Connection) -> dict[str, dict[str, int]]:
    """Rows per sink and status, e.g. ``{"slack": {"pending": 2, "sent": 40}}`` (for gauges)."""
    out: dict[str, dict[str, int]] = {}
    for sink, status, n in conn.execute(sa.select(_T.c.sink, _T.c.status, sa.func.count()).group_by(_T.c.sink,
                                                                                                   _T.c.status)):
        out.setdefault(sink, {})[status] = int(n)
    return out
