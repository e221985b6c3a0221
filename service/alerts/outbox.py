"""Alerts into the transactional outbox: which rows an alert becomes (one per configured sink).

Writing the alert in the same transaction as the action that caused it means an action is never
stored without its alerts nor alerted without being stored; the dispatcher delivers the rows
afterwards, retrying until they get through, so a crash or restart loses nothing. The rows
themselves are persisted by ``fp8guard.service.store.outbox``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

import sqlalchemy as sa

from fp8guard.service.alerts.config import AlertSettings
from fp8guard.service.alerts.model import Alert
from fp8guard.service.store import outbox as table
from fp8guard.service.store.outbox import RESOLVED_SUFFIX, STATUSES, OutboxRow, backlog, new_message_id, utc

__all__ = ["RESOLVED_SUFFIX", "STATUSES", "backlog", "enqueue", "new_message_id", "outbox_rows", "resolve", "utc"]


def outbox_rows(alerts: Sequence[Alert], settings: AlertSettings, now: datetime) -> list[OutboxRow]:
    """One row per (alert, configured sink); none when no sink is configured. Each row carries the
    incident window, so a run's repeated alerts of one kind page once (``incident_window_s``)."""
    now = utc(now)
    rows: list[OutboxRow] = []
    seen: set[tuple[str, str]] = set()
    for alert in alerts:
        for sink in settings.sinks():
            if (sink.name, alert.dedupe_key) in seen:
                continue
            seen.add((sink.name, alert.dedupe_key))
            active_until = None
            if sink.type == "alertmanager":
                # An already-resolved alert goes out once with endsAt=now; others stay active a while.
                active_until = now if alert.resolved else now + timedelta(seconds=settings.active_for_s)
            rows.append(OutboxRow(sink=sink.name, dedupe_key=alert.dedupe_key, kind=alert.kind,
                                  severity=alert.severity, now=now, active_until=active_until,
                                  quiet_s=0.0 if alert.resolved else settings.incident_window_s,
                                  payload={"alert": alert.to_json(), "sink_type": sink.type,
                                           "message_id": new_message_id()}))
    return rows


def enqueue(conn: sa.Connection, alerts: Sequence[Alert], settings: AlertSettings, now: datetime,
            run_pk: int | None) -> int:
    """Queue each alert for every configured sink in the caller's transaction (nothing is
    committed here); return how many rows were new. A (sink, dedupe_key) already queued is
    skipped. With no sinks configured this is a no-op."""
    return table.insert_rows(conn, outbox_rows(alerts, settings, now), run_pk=run_pk)


resolve = table.resolve
