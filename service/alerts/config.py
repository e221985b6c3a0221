"""Alert settings: where alerts go and how hard to try.

``AlertSettings`` is meant to be nested in the service ``Settings`` as ``alerts``, so a deployment
configures it with ``FP8GUARD_ALERTS__...`` variables, for example::

    FP8GUARD_ALERTS__ALERTMANAGER='[{"url": "http://127.0.0.1:9093"}]'
    FP8GUARD_ALERTS__WEBHOOKS='[{"url": "https://hooks.example.com/fp8", "secret": "whsec_..."}]'
    FP8GUARD_ALERTS__SLACK='[{"url": "https://hooks.slack.com/services/T/B/X"}]'
    FP8GUARD_ALERTS__DASHBOARD_URL=https://fp8guard.example.com

Every sink has a ``name``; it is stored in each outbox row, so it must be unique and stable:
renaming a sink orphans its undelivered rows (they stay pending until a sink of that name exists).
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Literal
from urllib.parse import quote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

__all__ = [
    "AlertSettings",
    "AlertmanagerSink",
    "SinkConfig",
    "SlackSink",
    "WebhookSink",
    "decode_webhook_secret",
    "run_link",
]

# The outbox's ``sink`` column is VARCHAR(32); a conservative alphabet keeps names usable as
# Prometheus label values and log fields without quoting.
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")
_SECRET_PREFIX = "whsec_"
_GENERATE_SECRET = (
    "python -c \"import base64,os; print('whsec_' + base64.b64encode(os.urandom(32)).decode())\""
)


def _check_http_url(value: str, what: str) -> str:
    """Accept absolute http(s) URLs only: a typo should fail at start-up, not at the first alert."""
    value = value.strip()
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what} must be an absolute http:// or https:// URL with a host, got {value!r}")
    return value


def _check_name(value: str) -> str:
    if not _NAME_RE.fullmatch(value):
        raise ValueError(
            f"sink name {value!r} must be 1-32 characters of letters, digits, '_', '.' or '-' "
            "(it is stored with every queued alert)"
        )
    return value


def decode_webhook_secret(secret: str) -> bytes:
    """The HMAC key of a Standard Webhooks secret ``whsec_<base64>``; ValueError if malformed."""
    if not secret.startswith(_SECRET_PREFIX):
        raise ValueError(
            f"webhook secret must start with {_SECRET_PREFIX!r} followed by base64 "
            f"(Standard Webhooks format); generate one with: {_GENERATE_SECRET}"
        )
    try:
        key = base64.b64decode(secret[len(_SECRET_PREFIX):], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(
            f"webhook secret after {_SECRET_PREFIX!r} is not valid base64; generate one with: {_GENERATE_SECRET}"
        ) from exc
    if not 24 <= len(key) <= 64:
        raise ValueError(
            f"webhook secret decodes to {len(key)} bytes; Standard Webhooks needs 24 to 64 random bytes. "
            f"Generate one with: {_GENERATE_SECRET}"
        )
    return key


class _Sink(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    name: str

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        return _check_name(value)


class WebhookSink(_Sink):
    """A generic JSON webhook, signed per Standard Webhooks 1.0 (``webhook-id``,
    ``webhook-timestamp``, ``webhook-signature: v1,<base64 HMAC-SHA256>``)."""

    type: Literal["webhook"] = "webhook"
    name: str = "webhook"
    secret: SecretStr
    """``whsec_`` + base64 of 24-64 random bytes, shared with the receiver."""

    @field_validator("url")
    @classmethod
    def _valid_url(cls, value: str) -> str:
        return _check_http_url(value, "webhook url")

    @field_validator("secret")
    @classmethod
    def _valid_secret(cls, value: SecretStr) -> SecretStr:
        decode_webhook_secret(value.get_secret_value().strip())
        return SecretStr(value.get_secret_value().strip())

    def key(self) -> bytes:
        """The HMAC key the secret encodes."""
        return decode_webhook_secret(self.secret.get_secret_value())


class SlackSink(_Sink):
    """A Slack incoming webhook (``https://hooks.slack.com/services/...``)."""

    type: Literal["slack"] = "slack"
    name: str = "slack"

    @field_validator("url")
    @classmethod
    def _valid_url(cls, value: str) -> str:
        return _check_http_url(value, "Slack incoming-webhook url")


class AlertmanagerSink(_Sink):
    """A Prometheus Alertmanager, base URL such as ``http://127.0.0.1:9093`` (API v2)."""

    type: Literal["alertmanager"] = "alertmanager"
    name: str = "alertmanager"

    @field_validator("url")
    @classmethod
    def _valid_url(cls, value: str) -> str:
        value = _check_http_url(value, "Alertmanager url").rstrip("/")
        if value.endswith("/api/v2/alerts") or value.endswith("/api/v2"):
            raise ValueError(
                f"Alertmanager url must be the base URL (e.g. http://127.0.0.1:9093), not the API path: {value!r}"
            )
        return value


SinkConfig = WebhookSink | SlackSink | AlertmanagerSink


class AlertSettings(BaseModel):
    """Alert routing and delivery policy (nested in the service settings as ``alerts``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    webhooks: list[WebhookSink] = Field(default_factory=list)
    slack: list[SlackSink] = Field(default_factory=list)
    alertmanager: list[AlertmanagerSink] = Field(default_factory=list)
    resend_interval_s: float = Field(default=60.0, gt=0)
    """Alertmanager wants active alerts re-sent every 30 s to 3 min."""
    active_for_s: float = Field(default=600.0, gt=0)
    """How long an action alert stays active (firing) in Alertmanager before it is resolved."""
    max_attempts: int = Field(default=12, ge=1)
    """Consecutive failed deliveries of one alert to one sink before giving up (status failed)."""
    backoff_base_s: float = Field(default=5.0, gt=0)
    """Delay after the first failure; it doubles per failure (with +-20% jitter)."""
    backoff_max_s: float = Field(default=3600.0, gt=0)
    """Upper bound of the retry delay (before jitter); a longer ``Retry-After`` is still honoured."""
    request_timeout_s: float = Field(default=15.0, gt=0)
    """Per-request HTTP timeout (Standard Webhooks suggests 15-30 s)."""
    dashboard_url: str | None = None
    """External base URL of the dashboard for links in alerts. ``{run_id}`` in it is replaced by the
    run id; otherwise ``/runs/<run_id>`` is appended."""
    poll_interval_s: float = Field(default=1.0, gt=0)
    """How often the dispatcher thread looks for due deliveries."""
    notify_resolved: bool = True
    """Send a ``.resolved`` notice to webhook and Slack sinks when an alert is resolved."""
    incident_window_s: float = Field(default=3600.0, ge=0)
    """One page per incident: an alert of a kind (rollback, escalation, finding...) that a run
    already raised to a sink in this window is not sent again; the decision behind it is still
    stored and shown on the run page. Ten NaN batches posted a few seconds apart sent ten pages;
    now one. 0 sends every alert (a resolution ends the incident: the next alert pages again)."""

    @field_validator("dashboard_url")
    @classmethod
    def _valid_dashboard(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        return _check_http_url(value, "dashboard_url")

    @model_validator(mode="after")
    def _consistent(self) -> AlertSettings:
        if self.backoff_max_s < self.backoff_base_s:
            raise ValueError(
                f"backoff_max_s ({self.backoff_max_s}) must be >= backoff_base_s ({self.backoff_base_s})"
            )
        seen: dict[str, str] = {}
        for sink in self.sinks():
            if sink.name in seen:
                raise ValueError(
                    f"two sinks are named {sink.name!r} ({seen[sink.name]} and {sink.type}); give each a "
                    "distinct name, e.g. {\"name\": \"ops-slack\", ...}"
                )
            seen[sink.name] = sink.type
        return self

    def sinks(self) -> list[SinkConfig]:
        """Every configured sink, in a stable order."""
        return [*self.webhooks, *self.slack, *self.alertmanager]

    def sink(self, name: str) -> SinkConfig | None:
        """The configured sink of that name, or None."""
        return next((s for s in self.sinks() if s.name == name), None)


def run_link(dashboard_url: str | None, run_id: str) -> str | None:
    """The dashboard page of a run, or None when no dashboard URL is configured."""
    if dashboard_url is None:
        return None
    quoted = quote(run_id, safe="")
    if "{run_id}" in dashboard_url:
        return dashboard_url.replace("{run_id}", quoted)
    return f"{dashboard_url.rstrip('/')}/runs/{quoted}"
