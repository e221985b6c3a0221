"""From the loop's decisions to alerts: every action, and every critical finding, pages the
configured sinks (the rows go into the outbox in the transaction that stores the decision), once
per incident: a run's alert of a kind already sent to a sink within ``incident_window_s`` is not
queued again (``store.outbox``), so a storm of bad batches pages once; every decision is stored."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from fp8guard.service.alerts.config import AlertSettings
from fp8guard.service.alerts.model import Alert, dedupe_key_for
from fp8guard.service.alerts.outbox import outbox_rows
from fp8guard.service.domain import Decision
from fp8guard.service.kinds import ActionKind, Severity
from fp8guard.service.store.outbox import OutboxRow

__all__ = ["ALERT_KIND", "alert_for", "alert_rows"]

ALERT_KIND: dict[ActionKind, str] = {ActionKind.ROLLBACK: "rollback", ActionKind.FALLBACK: "bf16_fallback",
                                     ActionKind.PROMOTE: "promotion", ActionKind.PAGE: "escalation"}
"""The alert kind of each action; an ``alert`` decision becomes a ``finding`` alert if critical."""


def alert_for(run_id: str, action_id: int, decision: Decision, step: int) -> Alert | None:
    """The alert a stored decision raises, or None (a non-critical finding with nothing to do)."""
    kind = ALERT_KIND.get(decision.kind)
    if decision.kind is ActionKind.FALLBACK and decision.escalation:
        kind = "escalation"
    if kind is None:
        if decision.severity is not Severity.CRITICAL:
            return None
        kind = "finding"
    return Alert(run_id=run_id, kind=kind, severity=decision.severity.value,
                 summary=decision.reason[:500], dedupe_key=dedupe_key_for(run_id, kind, action_id), step=step,
                 details={"action_id": action_id, "decision": str(decision.kind), **decision.details()})


def alert_rows(settings: AlertSettings, run_id: str, stored: Sequence[tuple[int, Decision, int]],
               now: datetime) -> list[OutboxRow]:
    """Outbox rows for ``(action id, decision, step)`` triples just stored."""
    alerts = [a for a in (alert_for(run_id, i, d, step) for i, d, step in stored) if a is not None]
    return outbox_rows(alerts, settings, now)
