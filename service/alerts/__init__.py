"""Alerting: a transactional outbox in the service database and a dispatcher that delivers it to
signed webhooks (Standard Webhooks 1.0), Slack incoming webhooks and Prometheus Alertmanager (API v2).

Usage from the service::

    with engine.begin() as conn:                   # the transaction that stores the action
        ...insert the action...
        enqueue(conn, [Alert(...)], settings.alerts, now, run_pk)

    dispatcher = AlertDispatcher(engine, settings.alerts)
    dispatcher.start()   # in the app's lifespan; dispatcher.close() on shutdown

Never imports torch.
"""

from __future__ import annotations

from fp8guard.service.alerts.config import (
    AlertmanagerSink,
    AlertSettings,
    SinkConfig,
    SlackSink,
    WebhookSink,
    decode_webhook_secret,
    run_link,
)
from fp8guard.service.alerts.dispatcher import OUTCOMES, AlertDispatcher
from fp8guard.service.alerts.model import KINDS, SEVERITIES, Alert, Severity, dedupe_key_for
from fp8guard.service.alerts.outbox import STATUSES, backlog, enqueue, resolve
from fp8guard.service.alerts.sinks import (
    Delivery,
    OutboundRequest,
    SendResult,
    alertmanager_alert,
    build_request,
    sign,
    slack_payload,
)

__all__ = [
    "KINDS",
    "OUTCOMES",
    "SEVERITIES",
    "STATUSES",
    "Alert",
    "AlertDispatcher",
    "AlertSettings",
    "AlertmanagerSink",
    "Delivery",
    "OutboundRequest",
    "SendResult",
    "Severity",
    "SinkConfig",
    "SlackSink",
    "WebhookSink",
    "alertmanager_alert",
    "backlog",
    "build_request",
    "decode_webhook_secret",
    "dedupe_key_for",
    "enqueue",
    "resolve",
    "run_link",
    "sign",
    "slack_payload",
]
