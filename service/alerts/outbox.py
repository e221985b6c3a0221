"""The transactional outbox: alerts are rows in ``alert_outbox``, written in the caller's transaction.

Writing the alert in the same transaction as the action that caused it means an action is never
stored without its alerts nor alerted without being stored; the dispatcher delivers the rows
afterwards, retrying until they get through, so a crash or restart loses nothing.

Row life cycle (``status``):

- ``pending``: due at ``next_attempt_at``.
- ``sent``: delivered. Alertmanager rows (``active_until`` set) stay due while the alert is active,
  because Alertmanager expects active alerts to be re-sent; the last send carries ``endsAt`` = now.
- ``resolved``: an Alertmanager row whose final, resolving send was accepted.
- ``failed``: given up (``max_attempts`` failures in a row, or HTTP 410 Gone).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from fp8guard.service.alerts.config import AlertSettings, SinkConfig
from fp8guard.service.alerts.model import Alert
from fp8guard.service.store.models import SqlAlert

__all__ = [
    "RESOLVED_SUFFIX",
    "STATUSES",
    "backlog",
    "enqueue",
    "new_message_id",
    "resolve",
    "utc",
]

STATUSES = ("pending", "sent", "failed", "resolved")
RESOLVED_SUFFIX = ":resolved"
"""Appended to the dedupe key of the resolution notice sent to webhook and Slack sinks."""


def utc(when: datetime) -> datetime:
    """``when`` in UTC. Naive datetimes are refused: SQLite stores datetimes as text without an
    offset, so mixing zones would silently break the ``next_attempt_at <= now`` comparisons."""
    if when.tzinfo is None:
        raise ValueError("naive datetime: pass a timezone-aware one, e.g. datetime.now(UTC)")
    return when.astimezone(UTC)


def new_message_id() -> str:
    """A globally unique ``webhook-id``; stored in the row so every retry reuses it."""
    return f"msg_{uuid.uuid4().hex}"


def _insert(conn: sa.Connection) -> Callable[..., Any]:
    # Both dialect INSERT constructs offer on_conflict_do_nothing; the generic one does not.
    return postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert


def _row(alert: Alert, sink: SinkConfig, settings: AlertSettings, now: datetime,
         run_pk: int | None, dedupe_key: str) -> dict[str, Any]:
    active_until: datetime | None = None
    if sink.type == "alertmanager":
        # An already-resolved alert goes out once with endsAt=now; others stay active a while.
        active_until = now if alert.resolved else now + timedelta(seconds=settings.active_for_s)
    return {
        "run_pk": run_pk,
        "sink": sink.name,
        "dedupe_key": dedupe_key,
        "kind": alert.kind,
        "severity": alert.severity,
        "status": "pending",
        "payload": {"alert": alert.to_json(), "sink_type": sink.type, "message_id": new_message_id()},
        "attempts": 0,
        "next_attempt_at": now,
        "last_error": None,
        "created_at": now,
        "sent_at": None,
        "active_until": active_until,
    }


def _insert_rows(conn: sa.Connection, rows: list[dict[str, Any]]) -> int:
    if not rows:
        return 0
    stmt = (
        _insert(conn)(SqlAlert)
        .values(rows)
        .on_conflict_do_nothing(index_elements=[SqlAlert.sink, SqlAlert.dedupe_key])
        # rowcount is not portable for INSERT .. ON CONFLICT; RETURNING lists only the new rows.
        .returning(SqlAlert.id)
    )
    return len(conn.execute(stmt).all())


def enqueue(conn: sa.Connection, alerts: Sequence[Alert], settings: AlertSettings, now: datetime,
            run_pk: int | None) -> int:
    """Queue each alert for every configured sink; return how many rows were new.

    Runs inside the caller's transaction (nothing is committed here), so the caller can store an
    action and its alerts atomically. A (sink, dedupe_key) already queued is skipped with
    ``ON CONFLICT DO NOTHING``, which, unlike catching an IntegrityError, leaves a PostgreSQL
    transaction usable. With no sinks configured this is a no-op.
    """
    now = utc(now)
    rows: list[dict[str, Any]] = []
    seen: set[tuple[str, str]] = set()
    for alert in alerts:
        for sink in settings.sinks():
            if (sink.name, alert.dedupe_key) in seen:
                continue
            seen.add((sink.name, alert.dedupe_key))
            rows.append(_row(alert, sink, settings, now, run_pk, alert.dedupe_key))
    return _insert_rows(conn, rows)


def resolve(conn: sa.Connection, dedupe_key: str, now: datetime, *, notify: bool = True) -> int:
    """Mark the alert ``dedupe_key`` resolved on every sink; return how many rows changed or were added.

    Alertmanager rows still pending or active become due now with ``active_until`` = now, so the
    dispatcher's next send carries ``endsAt`` = now and then marks them resolved. For webhook and
    Slack rows not given up, a resolution notice (``fp8guard.<kind>.resolved``) is queued under
    ``dedupe_key + ":resolved"`` unless ``notify`` is false. Idempotent; runs in the caller's
    transaction. Delivery order between the original and its notice is not guaranteed.
    """
    now = utc(now)
    t = cast(sa.Table, SqlAlert.__table__)
    changed = conn.execute(
        sa.update(t)
        .where(t.c.dedupe_key == dedupe_key, t.c.active_until.is_not(None),
               t.c.status.in_(("pending", "sent")))
        .values(active_until=now, next_attempt_at=now)
        .returning(t.c.id)
    ).all()
    if not notify:
        return len(changed)
    originals = conn.execute(
        sa.select(t.c.run_pk, t.c.sink, t.c.kind, t.c.severity, t.c.payload)
        .where(t.c.dedupe_key == dedupe_key, t.c.active_until.is_(None), t.c.status.in_(("pending", "sent")))
    ).all()
    rows: list[dict[str, Any]] = []
    for row in originals:
        payload = dict(row.payload)
        if payload["alert"].get("resolved"):
            continue  # already a notice of something over: nothing left to resolve
        payload["alert"] = {**payload["alert"], "resolved": True}
        payload["message_id"] = new_message_id()
        rows.append({
            "run_pk": row.run_pk, "sink": row.sink, "dedupe_key": dedupe_key + RESOLVED_SUFFIX,
            "kind": row.kind, "severity": row.severity, "status": "pending", "payload": payload,
            "attempts": 0, "next_attempt_at": now, "last_error": None, "created_at": now,
            "sent_at": None, "active_until": None,
        })
    return len(changed) + _insert_rows(conn, rows)


def backlog(conn: sa.Connection) -> dict[str, dict[str, int]]:
    """Rows per sink and status, e.g. ``{"slack": {"pending": 2, "sent": 40}}`` (for gauges)."""
    t = cast(sa.Table, SqlAlert.__table__)
    out: dict[str, dict[str, int]] = {}
    for sink, status, n in conn.execute(
        sa.select(t.c.sink, t.c.status, sa.func.count()).group_by(t.c.sink, t.c.status)
    ):
        out.setdefault(sink, {})[status] = int(n)
    return out
