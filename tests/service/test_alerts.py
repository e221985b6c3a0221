"""Alert outbox and dispatcher against a real local HTTP receiver, on SQLite and PostgreSQL."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import random
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import numpy as np
import pytest
import sqlalchemy as sa
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import Engine

from fp8guard.service.alerts import (
    Alert,
    AlertDispatcher,
    AlertmanagerSink,
    AlertSettings,
    SlackSink,
    WebhookSink,
    backlog,
    dedupe_key_for,
    enqueue,
    resolve,
)
from fp8guard.service.alerts.dispatcher import LEASE_MARGIN_S
from fp8guard.service.store import make_engine
from fp8guard.service.store.models import SqlAlert, SqlRun

SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


# -- a real HTTP receiver ------------------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


Response = tuple[int, dict[str, str], bytes]


class Receiver:
    """A ThreadingHTTPServer on 127.0.0.1 that records every POST and answers from a per-path
    script (then 200 ``ok``)."""

    def __init__(self) -> None:
        self.requests: list[Received] = []
        self.script: dict[str, list[Response]] = defaultdict(list)
        self.delay_s = 0.0
        self.on_request: Callable[[Received], None] | None = None
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                rec = Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                with receiver.lock:
                    receiver.requests.append(rec)
                    queue = receiver.script[self.path]
                    status, headers, reply = queue.pop(0) if queue else (200, {}, b"ok")
                if receiver.on_request is not None:
                    receiver.on_request(rec)
                if receiver.delay_s:
                    time.sleep(receiver.delay_s)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # keep the test output clean

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="receiver", daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}{path}"

    def respond(self, path: str, *responses: Response) -> None:
        with self.lock:
            self.script[path].extend(responses)

    def received(self, path: str) -> list[Received]:
        with self.lock:
            return [r for r in self.requests if r.path == path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def engine(migrated_url: str) -> Iterator[Engine]:
    eng = make_engine(migrated_url)
    yield eng
    eng.dispose()


class Clock:
    def __init__(self, start: datetime = T0) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    def to(self, when: datetime) -> None:
        self.now = when


def alert(n: int = 1, kind: str = "rollback", **kw: Any) -> Alert:
    fields: dict[str, Any] = {
        "run_id": "r-42", "kind": kind, "severity": "critical", "step": 1200,
        "summary": "Loss spiked 40x at step 1200; rolled back to the checkpoint at step 1000.",
        "details": {"checkpoint_step": 1000, "modules": ["layers.3.mlp.fc1"]},
        "dedupe_key": dedupe_key_for("r-42", kind, n),
    }
    fields.update(kw)
    return Alert(**fields)


def webhook_settings(receiver: Receiver, **kw: Any) -> AlertSettings:
    return AlertSettings(webhooks=[WebhookSink(url=receiver.url("/hook"), secret=SECRET)],
                         dashboard_url="https://fp8.example.com", **kw)


def put(engine: Engine, settings: AlertSettings, *alerts: Alert, now: datetime = T0) -> int:
    with engine.begin() as conn:
        return enqueue(conn, alerts, settings, now, None)


def outbox(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(SqlAlert.__table__).order_by(SqlAlert.id)).all())


def dispatcher(engine: Engine, settings: AlertSettings, clock: Clock, **kw: Any) -> AlertDispatcher:
    return AlertDispatcher(engine, settings, clock=clock, rng=random.Random(0), **kw)


def verify_standard_webhook(req: Received, secret: str, now: datetime, tolerance_s: int = 300) -> None:
    """What a receiver does, written independently of fp8guard's signer."""
    msg_id, ts = req.headers["webhook-id"], req.headers["webhook-timestamp"]
    assert abs(int(ts) - now.timestamp()) <= tolerance_s
    key = base64.b64decode(secret.removeprefix("whsec_"))
    expected = base64.b64encode(hmac.new(key, msg_id.encode() + b"." + ts.encode() + b"." + req.body,
                                         hashlib.sha256).digest()).decode()
    versions = dict(sig.split(",", 1) for sig in req.headers["webhook-signature"].split(" "))
    assert hmac.compare_digest(versions["v1"], expected)


# -- configuration and model ---------------------------------------------------------------------


def test_settings_validation_messages_are_actionable() -> None:
    with pytest.raises(ValidationError, match=r"must start with 'whsec_'.*generate one with"):
        WebhookSink(url="https://x.example/h", secret="hunter2")
    with pytest.raises(ValidationError, match="not valid base64"):
        WebhookSink(url="https://x.example/h", secret="whsec_@@@")
    with pytest.raises(ValidationError, match="decodes to 8 bytes"):
        WebhookSink(url="https://x.example/h", secret="whsec_" + base64.b64encode(b"12345678").decode())
    with pytest.raises(ValidationError, match="absolute http"):
        SlackSink(url="hooks.slack.com/services/x")
    with pytest.raises(ValidationError, match="base URL"):
        AlertmanagerSink(url="http://127.0.0.1:9093/api/v2/alerts")
    with pytest.raises(ValidationError, match="two sinks are named 'ops'"):
        AlertSettings(slack=[SlackSink(url="https://a.example", name="ops")],
                      alertmanager=[AlertmanagerSink(url="http://b.example", name="ops")])
    with pytest.raises(ValidationError, match="sink name"):
        SlackSink(url="https://a.example", name="has space")
    with pytest.raises(ValidationError, match="backoff_max_s"):
        AlertSettings(backoff_base_s=10, backoff_max_s=1)
    # the secret never shows up in reprs or logs
    assert SECRET not in repr(WebhookSink(url="https://x.example/h", secret=SECRET))


def test_settings_nest_under_service_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    class ServiceLike(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="FP8GUARD_", env_nested_delimiter="__", extra="forbid")
        alerts: AlertSettings = Field(default_factory=AlertSettings)

    monkeypatch.setenv("FP8GUARD_ALERTS__WEBHOOKS", json.dumps([{"url": "https://h.example/x", "secret": SECRET}]))
    monkeypatch.setenv("FP8GUARD_ALERTS__ALERTMANAGER", '[{"url": "http://127.0.0.1:9093/"}]')
    monkeypatch.setenv("FP8GUARD_ALERTS__RESEND_INTERVAL_S", "30")
    s = ServiceLike().alerts
    assert [x.name for x in s.sinks()] == ["webhook", "alertmanager"]
    assert s.alertmanager[0].url == "http://127.0.0.1:9093"
    assert s.resend_interval_s == 30


def test_alert_validation() -> None:
    with pytest.raises(ValueError, match="snake_case"):
        alert(kind="Roll Back")
    with pytest.raises(ValueError, match="severity"):
        alert(severity="fatal")
    with pytest.raises(ValueError, match="JSON"):
        alert(details={"x": float("nan")})
    with pytest.raises(ValueError, match="dedupe_key"):
        alert(dedupe_key="k" * 241)
    a = alert(details={"blob": "x" * 20_000})
    assert a.to_json()["details"]["truncated"] is True
    assert Alert.from_json(alert().to_json()) == alert()


def test_the_alerts_package_never_imports_torch() -> None:
    code = "import sys, fp8guard.service.alerts; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"


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


def test_duplicates_are_suppressed(engine: Engine, receiver: Receiver) -> None:
    settings = webhook_settings(receiver)
    assert put(engine, settings, alert(), alert()) == 1, "twice in one call"
    assert put(engine, settings, alert(summary="The same alert, worded differently.")) == 0, "and again later"
    assert put(engine, settings, alert(2)) == 1
    d = dispatcher(engine, settings, Clock())
    assert d.run_once() == 2
    d.close()
    assert len(receiver.received("/hook")) == 2
    # one row per (sink, alert): a second sink gets its own copy
    both = AlertSettings(webhooks=settings.webhooks, slack=[SlackSink(url=receiver.url("/slack"))])
    assert put(engine, both, alert(), alert(3)) == 3


def test_enqueue_joins_the_callers_transaction(engine: Engine, receiver: Receiver) -> None:
    settings = webhook_settings(receiver)
    with pytest.raises(RuntimeError), engine.begin() as conn:
        enqueue(conn, [alert()], settings, T0, None)
        raise RuntimeError("the action failed to store")
    assert outbox(engine) == [], "rolled back with the caller"

    with engine.begin() as conn:
        run_pk = conn.execute(sa.insert(SqlRun).values(run_id="r-42", world_size=1, status="running",
                                                       created_at=T0, updated_at=T0).returning(SqlRun.id)).scalar_one()
        assert enqueue(conn, [alert()], settings, T0, run_pk) == 1
        # a duplicate inside the same transaction must not poison it (PostgreSQL aborts a
        # transaction on an IntegrityError; ON CONFLICT DO NOTHING does not)
        assert enqueue(conn, [alert()], settings, T0, run_pk) == 0
        conn.execute(sa.update(SqlRun).where(SqlRun.id == run_pk).values(status="finished"))
    [row] = outbox(engine)
    assert row.run_pk == run_pk and row.kind == "rollback" and row.severity == "critical"
    with engine.connect() as conn:
        assert backlog(conn) == {"webhook": {"pending": 1}}


def test_no_sinks_is_a_no_op(engine: Engine) -> None:
    settings = AlertSettings()
    assert put(engine, settings, alert()) == 0
    d = dispatcher(engine, settings, Clock())
    assert d.run_once() == 0
    d.close()


def test_rows_of_unconfigured_sinks_wait(engine: Engine, receiver: Receiver) -> None:
    settings = webhook_settings(receiver)
    put(engine, settings, alert())
    other = AlertSettings(slack=[SlackSink(url=receiver.url("/slack"))])
    d = dispatcher(engine, other, Clock())
    assert d.run_once() == 0
    d.close()
    assert outbox(engine)[0].status == "pending"


def test_a_restart_delivers_what_the_old_process_could_not(migrated_url: str, receiver: Receiver) -> None:
    receiver.respond("/hook", (500, {}, b""), (500, {}, b""))
    settings = webhook_settings(receiver)
    clock = Clock()
    first = make_engine(migrated_url)
    put(first, settings, alert(1), alert(2))
    d1 = dispatcher(first, settings, clock)
    assert d1.run_once() == 2
    d1.close()
    first.dispose()  # the process "dies"

    clock.advance(3600)
    second = make_engine(migrated_url)
    d2 = dispatcher(second, settings, clock)
    assert d2.run_once() == 2
    d2.close()
    rows = outbox(second)
    second.dispose()
    assert [(r.status, r.attempts) for r in rows] == [("sent", 2), ("sent", 2)]
    ids = [r.headers["webhook-id"] for r in receiver.received("/hook")]
    assert len(ids) == 4 and len(set(ids)) == 2, "the new process reuses the stored webhook-ids"


def test_two_dispatchers_never_double_send(migrated_url: str, receiver: Receiver) -> None:
    """On PostgreSQL the claim is SELECT ... FOR UPDATE SKIP LOCKED; on SQLite the claiming UPDATE
    takes the single write lock. Either way each row goes out exactly once."""
    receiver.delay_s = 0.005
    settings = webhook_settings(receiver)
    n = 40
    seed = make_engine(migrated_url)
    put(seed, settings, *[alert(i) for i in range(n)], now=datetime.now(UTC))
    seed.dispose()

    engines = [make_engine(migrated_url) for _ in range(2)]
    dispatchers = [AlertDispatcher(e, settings, batch_size=3) for e in engines]
    counts = [0, 0]
    errors: list[BaseException] = []
    go = threading.Barrier(2)

    def work(k: int) -> None:
        try:
            go.wait(10)
            while True:
                done = dispatchers[k].run_once()
                counts[k] += done
                if done == 0:
                    return
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for d in dispatchers:
        d.close()
    rows = outbox(engines[0])
    for e in engines:
        e.dispose()
    assert errors == []
    assert sum(counts) == n
    ids = [r.headers["webhook-id"] for r in receiver.received("/hook")]
    assert len(ids) == n and len(set(ids)) == n
    assert {r.status for r in rows} == {"sent"}


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


# -- the background thread -----------------------------------------------------------------------


def wait_for(predicate: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_background_thread_survives_errors(engine: Engine, receiver: Receiver,
                                           caplog: pytest.LogCaptureFixture) -> None:
    settings = webhook_settings(receiver, poll_interval_s=0.05)
    failures = [2]

    def flaky_clock() -> datetime:
        if failures[0] > 0:
            failures[0] -= 1
            raise OSError("clock source unavailable")
        return datetime.now(UTC)

    put(engine, settings, alert(), now=datetime.now(UTC))
    d = AlertDispatcher(engine, settings, clock=flaky_clock)
    with caplog.at_level(logging.ERROR, logger="fp8guard.service.alerts.dispatcher"):
        d.start()
        d.start()  # idempotent
        try:
            wait_for(lambda: len(receiver.received("/hook")) == 1)
            # alerts queued while it runs are picked up too
            put(engine, settings, alert(2), now=datetime.now(UTC))
            wait_for(lambda: len(receiver.received("/hook")) == 2)
        finally:
            d.close()
    assert "alert dispatcher pass failed" in caplog.text
    assert d._thread is None
    assert [r.status for r in outbox(engine)] == ["sent", "sent"]


# -- leases: an interrupted delivery is retried within a minute ----------------------------------


class Crash(BaseException):
    """The process dying mid-send (not an error the dispatcher may catch)."""


def test_a_delivery_interrupted_by_a_crash_is_retried_within_a_minute(migrated_url: str,
                                                                        receiver: Receiver) -> None:
    settings = webhook_settings(receiver)
    clock = Clock()
    first = make_engine(migrated_url)
    put(first, settings, alert(1), alert(2), alert(3))

    def die(_: httpx.Request) -> httpx.Response:
        raise Crash

    d1 = AlertDispatcher(first, settings, clock=clock, client=httpx.Client(transport=httpx.MockTransport(die)))
    with pytest.raises(Crash):
        d1.run_once()
    first.dispose()  # the process is gone, its first row leased mid-send, the other two claimed

    second = make_engine(migrated_url)
    d2 = dispatcher(second, settings, clock)
    clock.advance(settings.request_timeout_s + LEASE_MARGIN_S + 1)
    assert clock.now - T0 < timedelta(minutes=1)
    assert d2.run_once() == 3, "every row the dead process held is due again within a minute"
    d2.close()
    assert [r.status for r in outbox(second)] == ["sent", "sent", "sent"]
    second.dispose()


def test_each_send_renews_its_lease_and_a_row_taken_over_is_not_sent_twice(engine: Engine,
                                                                           receiver: Receiver) -> None:
    """Sends are sequential: a row whose claim ran out while earlier rows were slow, and that
    another dispatcher claimed meanwhile, is left to that dispatcher."""
    settings = webhook_settings(receiver)
    lease = timedelta(seconds=settings.request_timeout_s + LEASE_MARGIN_S)
    clock = Clock()
    put(engine, settings, alert(1), alert(2), alert(3))
    d1, d2 = dispatcher(engine, settings, clock), dispatcher(engine, settings, clock)
    taken: list[int] = []

    def slow_sends(req: Received) -> None:
        sending = len(receiver.received("/hook"))
        if sending == 1:
            assert outbox(engine)[0].next_attempt_at == clock.now + lease
            clock.advance(settings.request_timeout_s)  # each send uses its whole timeout
        elif sending == 2:
            assert outbox(engine)[1].next_attempt_at == clock.now + lease, "renewed when its send began"
            clock.advance(settings.request_timeout_s + 1)
            receiver.on_request = None
            taken.append(d2.run_once())  # the third row's claim ran out: another process takes it

    receiver.on_request = slow_sends
    assert d1.run_once() == 3
    d1.close()
    d2.close()
    assert taken == [1], "only the row whose claim ran out, not the two d1 held leases on"
    ids = [r.headers["webhook-id"] for r in receiver.received("/hook")]
    assert len(ids) == 3 and len(set(ids)) == 3, "each alert went out once"
    assert [r.status for r in outbox(engine)] == ["sent", "sent", "sent"]


# -- alert storms: one page per incident ---------------------------------------------------------


def test_repeated_alerts_of_a_run_page_once_per_incident(engine: Engine, receiver: Receiver) -> None:
    settings = webhook_settings(receiver, incident_window_s=3600)
    with engine.begin() as conn:
        run_pk = conn.execute(sa.insert(SqlRun).values(run_id="r-42", world_size=1, status="running",
                                                       created_at=T0, updated_at=T0).returning(SqlRun.id)).scalar_one()
    for i in range(10):
        with engine.begin() as conn:
            enqueue(conn, [alert(i, kind="escalation")], settings, T0 + timedelta(seconds=5 * i), run_pk)
    with engine.begin() as conn:
        enqueue(conn, [alert(99, kind="rollback")], settings, T0 + timedelta(seconds=60), run_pk)
    assert [(r.kind, r.dedupe_key) for r in outbox(engine)] == [
        ("escalation", "r-42:escalation:0"), ("rollback", "r-42:rollback:99")]
    with engine.begin() as conn:  # past the window: a new incident pages again
        enqueue(conn, [alert(10, kind="escalation")], settings, T0 + timedelta(seconds=3700), run_pk)
    with engine.begin() as conn:  # resolved: the next alert is a new incident
        resolve(conn, "r-42:rollback:99", T0 + timedelta(seconds=3800))
        enqueue(conn, [alert(100, kind="rollback")], settings, T0 + timedelta(seconds=3801), run_pk)
    assert [r.dedupe_key for r in outbox(engine)] == [
        "r-42:escalation:0", "r-42:rollback:99", "r-42:escalation:10", "r-42:rollback:99:resolved",
        "r-42:rollback:100"]


def test_ten_nan_batches_send_one_page(migrated_url: str, receiver: Receiver) -> None:
    """Issue #15: ten POSTs of NaN-loss batches, far apart in steps and with no checkpoint, sent
    ten pages; the decisions are all still stored."""
    from fastapi.testclient import TestClient

    from fp8guard.service import Settings, create_app
    from tests.helpers import batch, post, register

    app = create_app(Settings(database_url=migrated_url, auth="off", alerts=webhook_settings(receiver)))
    with TestClient(app) as c:
        register(c, "victim")
        for i in range(10):
            steps = [i * 1000 + j for j in range(5)]
            values = np.ones((5, 4, 6), dtype="<f4")
            r = post(c, batch("victim", steps, values=values, losses=[float("nan")] * 5))
            assert r.status_code == 200, r.text
        pages = [a for a in c.get("/v1/runs/victim/actions").json() if a["kind"] == "page"]
    assert len(pages) == 10
    rows = outbox(app.state.store.engine)
    assert [(r.kind, r.sink) for r in rows] == [("escalation", "webhook")], rows
