"""Turns policy decisions into alerts, inside the transaction that stores the decision, so an
action is never recorded without its alert (nor alerted without being recorded)."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa

from fp8guard.service.alerts.config import AlertSettings
from fp8guard.service.alerts.model import Alert, dedupe_key_for
from fp8guard.service.alerts.outbox import enqueue
from fp8guard.service.detect import Decision
from fp8guard.service.store.guard import AlertHook

__all__ = ["OutboxAlerts"]

_KIND = {"rollback": "rollback", "fallback": "bf16_fallback", "promote": "promotion", "page": "escalation"}


class OutboxAlerts(AlertHook):
    """Every action, and every critical finding, becomes one alert per configured sink."""

    def __init__(self, settings: AlertSettings) -> None:
        self.settings = settings

    def __call__(self, conn: sa.Connection, run_pk: int, run_id: str, action_id: int, decision: Decision,
                 step: int, now: datetime) -> None:
        kind = _KIND.get(decision.kind)
        if kind == "bf16_fallback" and decision.payload.get("escalation"):
            kind = "escalation"
        if kind is None:  # a finding without an action: only critical ones page people
            if str(decision.severity) != "critical":
                return
            kind = "finding"
        alert = Alert(run_id=run_id, kind=kind, severity=str(decision.severity),  # type: ignore[arg-type]
                      summary=decision.reason[:500], dedupe_key=dedupe_key_for(run_id, kind, action_id), step=step,
                      details={"action_id": action_id, "decision": decision.kind, **decision.payload})
        enqueue(conn, [alert], self.settings, now, run_pk)
