"""Payload builders and the HTTP send for each sink kind.

Builders are pure functions of (sink, delivery, settings, now), so tests can check the exact
bytes; ``send`` turns one request into a ``SendResult`` and never raises for HTTP trouble.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from fp8guard import __version__
from fp8guard.service.alerts.config import (
    AlertmanagerSink,
    AlertSettings,
    SinkConfig,
    SlackSink,
    WebhookSink,
    run_link,
)
from fp8guard.service.alerts.model import Alert

__all__ = [
    "Delivery",
    "OutboundRequest",
    "SendResult",
    "alertmanager_alert",
    "alertmanager_request",
    "alertname",
    "build_request",
    "parse_retry_after",
    "rfc3339",
    "send",
    "sign",
    "slack_payload",
    "slack_request",
    "webhook_request",
]

USER_AGENT = f"fp8guard/{__version__}"
# Alertmanager resolves an alert it has not heard of by endsAt; several resend periods ahead keeps
# one late or lost re-send from making it flap (Grafana's fix, grafana/grafana#38648).
ENDS_AT_RESENDS = 4
_SEVERITY_EMOJI = {"info": ":information_source:", "warning": ":warning:", "critical": ":rotating_light:"}


@dataclass(frozen=True)
class Delivery:
    """One outbox row as a sink sees it."""

    row_id: int
    message_id: str
    """The ``webhook-id``: stored with the row, identical on every retry (receivers dedupe on it)."""
    alert: Alert
    created_at: datetime
    active_until: datetime | None
    """Alertmanager only: the alert fires until then; at or after it a send resolves it."""


@dataclass(frozen=True)
class OutboundRequest:
    """A built HTTP request."""

    url: str
    body: bytes
    headers: dict[str, str]
    final: bool
    """Alertmanager: this send resolves the alert (endsAt = now). Always true for other sinks."""


@dataclass(frozen=True)
class SendResult:
    """The outcome of one HTTP attempt."""

    ok: bool
    status_code: int | None = None
    error: str | None = None
    retry_after_s: float | None = None
    gone: bool = False
    """HTTP 410: the receiver asks us to stop; no retries."""


def rfc3339(when: datetime) -> str:
    """UTC timestamp with milliseconds and a ``Z``, as Alertmanager and most receivers expect."""
    return when.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _title(kind: str) -> str:
    return " ".join(part.upper() if part in ("bf16", "fp8") else part.capitalize() for part in kind.split("_"))


def alertname(kind: str) -> str:
    """``bf16_fallback`` -> ``FP8GuardBf16Fallback``."""
    return "FP8Guard" + "".join(part.capitalize() for part in kind.split("_"))


def sign(key: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    """Standard Webhooks v1 signature: ``v1,`` + base64(HMAC-SHA256(key, "id.ts.body"))."""
    mac = hmac.new(key, f"{message_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def webhook_request(sink: WebhookSink, delivery: Delivery, settings: AlertSettings, now: datetime) -> OutboundRequest:
    """A signed Standard Webhooks request. The body depends only on the row, so retries resend the
    same bytes under the same ``webhook-id``; only the timestamp and signature change."""
    alert = delivery.alert
    event = f"fp8guard.{alert.kind}" + (".resolved" if alert.resolved else "")
    data = {**alert.to_json(), "dashboard_url": run_link(settings.dashboard_url, alert.run_id)}
    body = _dumps({"type": event, "timestamp": rfc3339(delivery.created_at), "data": data})
    ts = int(now.timestamp())
    headers = {
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        "webhook-id": delivery.message_id,
        "webhook-timestamp": str(ts),
        "webhook-signature": sign(sink.key(), delivery.message_id, ts, body),
    }
    return OutboundRequest(url=sink.url, body=body, headers=headers, final=True)


def _mrkdwn_escape(text: str, limit: int = 2000) -> str:
    # Slack's three control characters; everything else is literal in mrkdwn text objects. Block
    # text is capped (3000 characters per section), so long input is clipped rather than rejected.
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def slack_payload(alert: Alert, link: str | None) -> dict[str, Any]:
    """Slack incoming-webhook JSON: plain ``text`` for notifications plus mrkdwn blocks."""
    state = "Resolved: " if alert.resolved else ""
    where = f"run {alert.run_id}" + ("" if alert.step is None else f", step {alert.step}")
    text = f"{state}FP8Guard {_title(alert.kind)} ({alert.severity}) {where}: {alert.summary}"
    emoji = ":white_check_mark:" if alert.resolved else _SEVERITY_EMOJI[alert.severity]
    head = f"{emoji} *{state}FP8Guard {_title(alert.kind)}* ({alert.severity})"
    fields = [{"type": "mrkdwn", "text": f"*Run*\n`{_mrkdwn_escape(alert.run_id, 200)}`"}]
    if alert.step is not None:
        fields.append({"type": "mrkdwn", "text": f"*Step*\n{alert.step}"})
    blocks: list[dict[str, Any]] = [
        {"type": "section", "text": {"type": "mrkdwn", "text": f"{head}\n{_mrkdwn_escape(alert.summary)}"}},
        {"type": "section", "fields": fields},
    ]
    if link is not None:
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": f"<{link}|Open the run dashboard>"}})
    return {"text": text, "blocks": blocks}


def slack_request(sink: SlackSink, delivery: Delivery, settings: AlertSettings, now: datetime) -> OutboundRequest:
    """A Slack incoming-webhook post (success is 200 ``ok``; 429 carries ``Retry-After``)."""
    payload = slack_payload(delivery.alert, run_link(settings.dashboard_url, delivery.alert.run_id))
    return OutboundRequest(
        url=sink.url, body=_dumps(payload),
        headers={"content-type": "application/json", "user-agent": USER_AGENT}, final=True,
    )


def _description(alert: Alert) -> str:
    lines = [alert.summary]
    if alert.step is not None:
        lines.append(f"step: {alert.step}")
    for key, value in alert.details.items():
        lines.append(f"{key}: {value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}")
    text = "\n".join(lines)
    return text if len(text) <= 2000 else text[:1997] + "..."


def alertmanager_alert(alert: Alert, *, created_at: datetime, ends_at: datetime, link: str | None) -> dict[str, Any]:
    """One ``postableAlert`` (Alertmanager API v2)."""
    annotations = {"summary": alert.summary, "description": _description(alert)}
    if link is not None:
        annotations["dashboard_url"] = link
    body: dict[str, Any] = {
        "labels": {
            "alertname": alertname(alert.kind),
            "severity": alert.severity,
            "run": alert.run_id,
            "service": "fp8guard",
            # Labels are an alert's identity in Alertmanager: without this, two rollbacks of one run
            # would merge and resolving one would resolve both.
            "alert_key": alert.dedupe_key,
        },
        "annotations": annotations,
        "startsAt": rfc3339(created_at),
        "endsAt": rfc3339(ends_at),
    }
    if link is not None:
        body["generatorURL"] = link  # format uri: omitted rather than empty when unknown
    return body


def alertmanager_request(sink: AlertmanagerSink, delivery: Delivery, settings: AlertSettings,
                         now: datetime) -> OutboundRequest:
    """``POST {url}/api/v2/alerts``. While active, ``endsAt`` lies a few resend periods ahead (capped
    at ``active_until``); the final send has ``endsAt`` = now, which resolves the alert."""
    final = delivery.alert.resolved or delivery.active_until is None or now >= delivery.active_until
    if final:
        ends_at = now
    else:
        assert delivery.active_until is not None
        ends_at = min(delivery.active_until, now + timedelta(seconds=ENDS_AT_RESENDS * settings.resend_interval_s))
    # Alertmanager rejects endsAt before startsAt (possible with a skewed or injected clock).
    ends_at = max(ends_at, delivery.created_at)
    body = alertmanager_alert(delivery.alert, created_at=delivery.created_at, ends_at=ends_at,
                              link=run_link(settings.dashboard_url, delivery.alert.run_id))
    return OutboundRequest(
        url=f"{sink.url}/api/v2/alerts", body=_dumps([body]),
        headers={"content-type": "application/json", "user-agent": USER_AGENT}, final=final,
    )


def build_request(sink: SinkConfig, delivery: Delivery, settings: AlertSettings, now: datetime) -> OutboundRequest:
    """The request for any sink kind."""
    if isinstance(sink, WebhookSink):
        return webhook_request(sink, delivery, settings, now)
    if isinstance(sink, SlackSink):
        return slack_request(sink, delivery, settings, now)
    return alertmanager_request(sink, delivery, settings, now)


def parse_retry_after(value: str | None, now: datetime) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date), or None."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - now).total_seconds())


def send(client: httpx.Client, request: OutboundRequest, *, timeout_s: float, now: datetime) -> SendResult:
    """POST once. 2xx is success; 3xx is a failure (redirects are not followed, which also keeps a
    signed body from being replayed elsewhere); 410 is final; anything else may be retried."""
    try:
        response = client.post(request.url, content=request.body, headers=request.headers,
                               timeout=timeout_s, follow_redirects=False)
    except Exception as exc:  # transport errors, invalid URLs...: a failed attempt, never a crash
        return SendResult(ok=False, error=f"{type(exc).__name__}: {exc}"[:1000])
    code = response.status_code
    if 200 <= code < 300:
        return SendResult(ok=True, status_code=code)
    detail = response.text.strip().replace("\n", " ")[:300]
    return SendResult(
        ok=False, status_code=code, error=f"HTTP {code}" + (f": {detail}" if detail else ""),
        retry_after_s=parse_retry_after(response.headers.get("retry-after"), now), gone=code == 410,
    )
