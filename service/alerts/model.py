"""The alert as the rest of the service hands it over: sink-independent and JSON-friendly."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["KINDS", "SEVERITIES", "Alert", "Severity", "dedupe_key_for"]

Severity = Literal["info", "warning", "critical"]
SEVERITIES: tuple[Severity, ...] = ("info", "warning", "critical")
KINDS = ("rollback", "bf16_fallback", "promotion", "escalation", "finding")
"""The kinds the service emits today; others are allowed if they fit ``_KIND_RE``."""

# ``kind`` ends up in a VARCHAR(48) column, an Alertmanager alertname and a webhook event type,
# so it is kept to a snake_case identifier.
_KIND_RE = re.compile(r"^[a-z][a-z0-9_]{0,47}$")
# ``dedupe_key`` is VARCHAR(256); resolution notices append ":resolved", so leave room for it.
MAX_DEDUPE_KEY = 240
# Standard Webhooks asks for payloads under 20 kB; details bigger than this are replaced.
MAX_DETAILS_BYTES = 12_000


def dedupe_key_for(run_id: str, kind: str, ident: object) -> str:
    """The conventional dedupe key: one alert per (run, kind, action or finding id)."""
    return f"{run_id}:{kind}:{ident}"


@dataclass(frozen=True, kw_only=True)
class Alert:
    """One alert. Enqueuing the same ``dedupe_key`` twice delivers it once per sink.

    ``resolved=True`` enqueues a notice of something already over: Alertmanager receives it with
    ``endsAt`` = now (so it never stays firing) and webhooks see ``fp8guard.<kind>.resolved``.
    """

    run_id: str
    kind: str
    severity: Severity
    summary: str
    """One sentence, shown as the Slack text and the Alertmanager summary."""
    dedupe_key: str
    step: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable evidence (modules, thresholds, action payload...)."""
    resolved: bool = False

    def __post_init__(self) -> None:
        if not self.run_id:
            raise ValueError("Alert.run_id must not be empty")
        if not _KIND_RE.fullmatch(self.kind):
            raise ValueError(f"Alert.kind {self.kind!r} must be snake_case ([a-z][a-z0-9_]*, at most 48 chars)")
        if self.severity not in SEVERITIES:
            raise ValueError(f"Alert.severity {self.severity!r} must be one of {', '.join(SEVERITIES)}")
        if not self.summary.strip():
            raise ValueError("Alert.summary must be a non-empty sentence")
        if not self.dedupe_key or len(self.dedupe_key) > MAX_DEDUPE_KEY:
            raise ValueError(f"Alert.dedupe_key must be 1-{MAX_DEDUPE_KEY} characters, got {len(self.dedupe_key)}")
        try:
            json.dumps(self.details, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"Alert.details must be JSON-serialisable without NaN/inf: {exc}") from exc

    def to_json(self) -> dict[str, Any]:
        """The stored form (inside the outbox row's payload); ``from_json`` inverts it."""
        details = self.details
        size = len(json.dumps(details, allow_nan=False))
        if size > MAX_DETAILS_BYTES:
            # Keep the alert deliverable; the full evidence stays in the findings/actions tables.
            details = {"truncated": True, "original_bytes": size}
        return {
            "run_id": self.run_id,
            "kind": self.kind,
            "severity": self.severity,
            "summary": self.summary,
            "dedupe_key": self.dedupe_key,
            "step": self.step,
            "details": details,
            "resolved": self.resolved,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Alert:
        """Rebuild an alert from ``to_json`` output."""
        return cls(
            run_id=str(data["run_id"]),
            kind=str(data["kind"]),
            severity=data["severity"],
            summary=str(data["summary"]),
            dedupe_key=str(data["dedupe_key"]),
            step=None if data.get("step") is None else int(data["step"]),
            details=dict(data.get("details") or {}),
            resolved=bool(data.get("resolved", False)),
        )
