"""Shared by the alert tests (test_alert_settings.py, test_alert_delivery.py, test_alert_outbox.py): a real
local HTTP receiver, the database engine, a clock the tests move, and builders for alerts, settings,
the outbox and its dispatcher.

The fixtures are named in their decorators (``receiver``, ``engine``): a test module imports
``receiver_fixture`` and ``engine_fixture`` and its tests take ``receiver`` and ``engine``.
"""

from __future__ import annotations

import base64
import json
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fp8guard.service.alerts import (
    Alert,
    AlertDispatcher,
    AlertSettings,
    WebhookSink,
    dedupe_key_for,
    enqueue,
)
from fp8guard.service.store import make_engine
from fp8guard.service.store.models import SqlAlert

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


@pytest.fixture(name="receiver")
def receiver_fixture() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(name="engine")
def engine_fixture(migrated_url: str) -> Iterator[Engine]:
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
