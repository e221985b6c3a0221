"""Alert delivery to each sink against a real local HTTP receiver, on SQLite and PostgreSQL: signed
Standard Webhooks, Slack's payload, the retry policy (backoff, Retry-After, giving up, connection
errors, a row that cannot be built), and Alertmanager's resend-while-active and resolve semantics.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fp8guard.service.alerts import AlertmanagerSink, AlertSettings, SlackSink, WebhookSink, resolve
from fp8guard.service.store.models import SqlAlert
from tests.service.alerting_helpers import (
    SECRET,
    T0,
    Clock,
    Received,
    Receiver,
    alert,
    dispatcher,
    engine_fixture,  # noqa: F401 - fixture
    outbox,
    put,
    receiver_fixture,  # noqa: F401 - fixture
    webhook_settings,
)


def verify_standard_webhook(req: Received, secret: str, now: datetime, tolerance_s: int = 300) -> None:
    """What a receiver does, written independently of fp8guard's signer."""
    msg_id, ts = req.headers["webhook-id"], req.headers["webhook-timestamp"]
    assert abs(int(ts) - now.timestamp()) <= tolerance_s
    key = base64.b64decode(secret.removeprefix("whsec_"))
    expected = base64.b64encode(hmac.new(key, msg_id.encode() + b"." + ts.encode() + b"." + req.body,
                                         hashlib.sha256).digest()).decode()
    versions = dict(sig.split(",", 1) for sig in req.headers["webhook-signature"].split(" "))
    assert hmac.compare_digest(versions["v1"], expected)


# -- delivery ------------------------------------------------------------------------------------


def test_signed_webhook_delivery(engine: Engine, receiver: Receiver) -> None:
    settings = webhook_settings(receiver)
    clock = Clock()
    assert put(engine, settings, alert()) == 1
    d = dispatcher(engine, settings, clock)
    assert d.run_once() == 1
    assert d.run_once() == 0
    d.close()
    [req] = receiver.received("/hook")
    verify_standard_webhook(req, SECRET, clock.now)
    assert req.headers["content-type"] == "application/json"
    assert req.headers["webhook-id"].startswith("msg_")
    body = req.json()
    assert body["type"] == "fp8guard.rollback"
    assert body["timestamp"] == "2026-03-01T12:00:00.000Z"
    assert body["data"]["run_id"] == "r-42" and body["data"]["step"] == 1200
    assert body["data"]["dashboard_url"] == "https://fp8.example.com/runs/r-42"
    assert body["data"]["details"]["checkpoint_step"] == 1000
    [row] = outbox(engine)
    assert (row.status, row.attempts, row.last_error, row.sent_at) == ("sent", 1, None, T0)
    assert d.stats() == {"webhook": {"sent": 1, "resent": 0, "resolved": 0, "retry": 0, "failed": 0}}


def test_retries_back_off_and_reuse_the_webhook_id(engine: Engine, receiver: Receiver) -> None:
    receiver.respond("/hook", (500, {}, b"boom"), (503, {}, b""))
    settings = webhook_settings(receiver, backoff_base_s=5, backoff_max_s=3600)
    clock = Clock()
    put(engine, settings, alert())
    d = dispatcher(engine, settings, clock)

    assert d.run_once() == 1
    [row] = outbox(engine)
    assert (row.status, row.attempts) == ("pending", 1)
    assert row.last_error.startswith("HTTP 500: boom")
    assert T0 + timedelta(seconds=4) <= row.next_attempt_at <= T0 + timedelta(seconds=6)  # 5 s +-20%
    clock.advance(3)
    assert d.run_once() == 0, "not due yet"

    clock.to(row.next_attempt_at)
    assert d.run_once() == 1
    [row2] = outbox(engine)
    assert (row2.status, row2.attempts, row2.last_error) == ("pending", 2, "HTTP 503")
    delay = (row2.next_attempt_at - clock.now).total_seconds()
    assert 8 <= delay <= 12, "the delay doubles"

    clock.to(row2.next_attempt_at)
    assert d.run_once() == 1
    d.close()
    [row3] = outbox(engine)
    assert (row3.status, row3.attempts, row3.last_error) == ("sent", 3, None)
    reqs = receiver.received("/hook")
    assert len(reqs) == 3
    assert len({r.headers["webhook-id"] for r in reqs}) == 1, "retries keep the idempotency key"
    assert len({r.body for r in reqs}) == 1, "and the same body"
    assert len({r.headers["webhook-timestamp"] for r in reqs}) == 3
    for r in reqs:
        verify_standard_webhook(r, SECRET, clock.now, tolerance_s=60)
    assert d.stats()["webhook"]["retry"] == 2 and d.stats()["webhook"]["sent"] == 1


def test_slack_payload_and_retry_after(engine: Engine, receiver: Receiver) -> None:
    receiver.respond("/slack", (429, {"Retry-After": "120"}, b"rate_limited"))
    settings = AlertSettings(slack=[SlackSink(url=receiver.url("/slack"))],
                             dashboard_url="https://fp8.example.com/d/abc?var-run={run_id}")
    clock = Clock()
    put(engine, settings, alert(summary="FP8 amax overflow in <layers.3> & friends."))
    d = dispatcher(engine, settings, clock)
    assert d.run_once() == 1
    [row] = outbox(engine)
    assert row.next_attempt_at >= T0 + timedelta(seconds=120), "Retry-After beats the 5 s backoff"
    clock.advance(119)
    assert d.run_once() == 0
    clock.advance(1)
    assert d.run_once() == 1
    d.close()
    assert outbox(engine)[0].status == "sent"
    first, second = receiver.received("/slack")
    assert first.body == second.body
    msg = second.json()
    assert "r-42" in msg["text"] and "1200" in msg["text"] and "FP8 amax overflow" in msg["text"]
    mrkdwn = "\n".join(json.dumps(b) for b in msg["blocks"])
    assert "&lt;layers.3&gt; &amp; friends" in mrkdwn, "Slack control characters are escaped"
    assert "`r-42`" in mrkdwn and "*Step*\\n1200" in mrkdwn
    assert "<https://fp8.example.com/d/abc?var-run=r-42|Open the run dashboard>" in mrkdwn
    assert all(b["type"] == "section" for b in msg["blocks"])


def test_http_date_retry_after(engine: Engine, receiver: Receiver) -> None:
    receiver.respond("/hook", (503, {"Retry-After": "Sun, 01 Mar 2026 13:00:00 GMT"}, b""))
    settings = webhook_settings(receiver)
    put(engine, settings, alert())
    d = dispatcher(engine, settings, Clock())
    d.run_once()
    d.close()
    assert outbox(engine)[0].next_attempt_at >= T0 + timedelta(hours=1)


def test_410_gives_up_at_once(engine: Engine, receiver: Receiver) -> None:
    receiver.respond("/hook", (410, {}, b"gone"))
    settings = webhook_settings(receiver)
    clock = Clock()
    put(engine, settings, alert())
    d = dispatcher(engine, settings, clock)
    assert d.run_once() == 1
    clock.advance(10**6)
    assert d.run_once() == 0
    d.close()
    [row] = outbox(engine)
    assert (row.status, row.attempts, row.last_error) == ("failed", 1, "HTTP 410: gone")
    assert len(receiver.received("/hook")) == 1
    assert d.stats()["webhook"]["failed"] == 1


def test_gives_up_after_max_attempts(engine: Engine, receiver: Receiver) -> None:
    receiver.respond("/hook", *[(500, {}, b"")] * 3)
    settings = webhook_settings(receiver, max_attempts=3)
    clock = Clock()
    put(engine, settings, alert())
    d = dispatcher(engine, settings, clock)
    for _ in range(5):
        d.run_once()
        clock.advance(10**5)
    d.close()
    [row] = outbox(engine)
    assert (row.status, row.attempts) == ("failed", 3)
    assert len(receiver.received("/hook")) == 3


def test_connection_errors_are_retried(engine: Engine, receiver: Receiver) -> None:
    dead = Receiver()
    url = dead.url("/hook")
    dead.close()  # nothing listens there any more
    settings = AlertSettings(webhooks=[WebhookSink(url=url, secret=SECRET)], request_timeout_s=5)
    put(engine, settings, alert())
    d = dispatcher(engine, settings, Clock())
    assert d.run_once() == 1
    d.close()
    [row] = outbox(engine)
    assert row.status == "pending" and row.attempts == 1 and "ConnectError" in row.last_error


def test_a_corrupt_row_fails_without_stopping_the_others(engine: Engine, receiver: Receiver) -> None:
    settings = webhook_settings(receiver)
    put(engine, settings, alert(1), alert(2))
    with engine.begin() as conn:
        first = conn.scalar(sa.select(sa.func.min(SqlAlert.id)))
        conn.execute(sa.update(SqlAlert).where(SqlAlert.id == first).values(payload={"alert": {"kind": 1}}))
    d = dispatcher(engine, settings, Clock())
    assert d.run_once() == 2
    d.close()
    assert [r.status for r in outbox(engine)] == ["failed", "sent"]
    assert outbox(engine)[0].last_error.startswith("cannot build the request")


# -- Alertmanager semantics (against the recording receiver; a real one in test_alertmanager.py) --


def am_settings(receiver: Receiver, **kw: Any) -> AlertSettings:
    return AlertSettings(alertmanager=[AlertmanagerSink(url=receiver.url(""))],
                         dashboard_url="https://fp8.example.com", **kw)


def test_alertmanager_resends_while_active_then_resolves(engine: Engine, receiver: Receiver) -> None:
    settings = am_settings(receiver, resend_interval_s=60, active_for_s=600)
    clock = Clock()
    put(engine, settings, alert())
    d = dispatcher(engine, settings, clock)
    assert d.run_once() == 1
    [first] = receiver.received("/api/v2/alerts")
    [am] = first.json()
    assert am["labels"] == {"alertname": "FP8GuardRollback", "severity": "critical", "run": "r-42",
                            "service": "fp8guard", "alert_key": "r-42:rollback:1"}
    assert am["annotations"]["summary"].startswith("Loss spiked")
    assert "checkpoint_step: 1000" in am["annotations"]["description"]
    assert am["annotations"]["dashboard_url"] == am["generatorURL"] == "https://fp8.example.com/runs/r-42"
    assert am["startsAt"] == "2026-03-01T12:00:00.000Z"
    assert am["endsAt"] == "2026-03-01T12:04:00.000Z", "4 resend periods ahead"
    [row] = outbox(engine)
    assert (row.status, row.next_attempt_at) == ("sent", T0 + timedelta(seconds=60))

    clock.advance(30)
    assert d.run_once() == 0
    clock.advance(30)
    assert d.run_once() == 1
    assert receiver.received("/api/v2/alerts")[-1].json()[0]["endsAt"] == "2026-03-01T12:05:00.000Z"
    clock.to(T0 + timedelta(seconds=590))
    assert d.run_once() == 1
    assert receiver.received("/api/v2/alerts")[-1].json()[0]["endsAt"] == "2026-03-01T12:10:00.000Z", \
        "capped at active_until"
    assert outbox(engine)[0].next_attempt_at == T0 + timedelta(seconds=600)

    clock.to(T0 + timedelta(seconds=600))
    assert d.run_once() == 1
    final = receiver.received("/api/v2/alerts")[-1].json()[0]
    assert final["endsAt"] == "2026-03-01T12:10:00.000Z" and final["startsAt"] == am["startsAt"]
    [row] = outbox(engine)
    assert row.status == "resolved"
    clock.advance(10**5)
    assert d.run_once() == 0
    d.close()
    assert d.stats()["alertmanager"] == {"sent": 1, "resent": 2, "resolved": 1, "retry": 0, "failed": 0}


def test_resolve_sends_ends_at_now_and_notifies_webhooks(engine: Engine, receiver: Receiver) -> None:
    settings = AlertSettings(alertmanager=[AlertmanagerSink(url=receiver.url(""))],
                             webhooks=[WebhookSink(url=receiver.url("/hook"), secret=SECRET)])
    clock = Clock()
    put(engine, settings, alert())
    d = dispatcher(engine, settings, clock)
    assert d.run_once() == 2
    clock.advance(10)
    with engine.begin() as conn:
        assert resolve(conn, "r-42:rollback:1", clock.now) == 2  # the AM row + a webhook notice
    with engine.begin() as conn:
        assert resolve(conn, "r-42:rollback:1", clock.now) == 1, "idempotent: no second notice"
    assert d.run_once() == 2
    d.close()
    final = receiver.received("/api/v2/alerts")[-1].json()[0]
    assert final["endsAt"] == "2026-03-01T12:00:10.000Z"
    notice = receiver.received("/hook")[-1]
    verify_standard_webhook(notice, SECRET, clock.now)
    assert notice.json()["type"] == "fp8guard.rollback.resolved"
    assert notice.json()["data"]["resolved"] is True
    assert {(r.sink, r.dedupe_key, r.status) for r in outbox(engine)} == {
        ("alertmanager", "r-42:rollback:1", "resolved"),
        ("webhook", "r-42:rollback:1", "sent"),
        ("webhook", "r-42:rollback:1:resolved", "sent"),
    }


def test_resolve_during_a_send_is_not_delayed(engine: Engine, receiver: Receiver) -> None:
    settings = am_settings(receiver)
    clock = Clock()
    put(engine, settings, alert())

    def resolve_now(_: Received) -> None:
        receiver.on_request = None
        with engine.begin() as conn:
            resolve(conn, "r-42:rollback:1", clock.now)

    receiver.on_request = resolve_now
    d = dispatcher(engine, settings, clock)
    assert d.run_once() == 1  # the firing send, during which resolve() ran
    assert outbox(engine)[0].next_attempt_at == T0, "due at once, not after resend_interval_s"
    assert d.run_once() == 1
    d.close()
    assert outbox(engine)[0].status == "resolved"
    assert receiver.received("/api/v2/alerts")[-1].json()[0]["endsAt"] == "2026-03-01T12:00:00.000Z"


def test_an_already_resolved_alert_goes_out_once(engine: Engine, receiver: Receiver) -> None:
    settings = am_settings(receiver)
    clock = Clock()
    put(engine, settings, alert(kind="promotion", severity="info", resolved=True))
    d = dispatcher(engine, settings, clock)
    assert d.run_once() == 1
    clock.advance(10**5)
    assert d.run_once() == 0
    d.close()
    [req] = receiver.received("/api/v2/alerts")
    assert req.json()[0]["endsAt"] == req.json()[0]["startsAt"]
    assert req.json()[0]["labels"]["alertname"] == "FP8GuardPromotion"
    assert outbox(engine)[0].status == "resolved"
