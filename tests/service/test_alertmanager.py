"""Alerts pushed through the dispatcher into a REAL Prometheus Alertmanager (Debian's
``prometheus-alertmanager``), read back through its API v2, then resolved.

Without the binary the tests skip locally; in CI (``CI=true``) they fail, since ``tests/run.sh``
installs it. ``FP8GUARD_ALERTMANAGER_BIN`` may point at a binary elsewhere.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fp8guard.service.alerts import Alert, AlertDispatcher, AlertmanagerSink, AlertSettings, enqueue, resolve
from fp8guard.service.store import make_engine
from fp8guard.service.store.models import SqlAlert

_CONFIG = """\
route:
  receiver: blackhole
receivers:
  - name: blackhole
"""


def _binary() -> str:
    found = (os.environ.get("FP8GUARD_ALERTMANAGER_BIN") or shutil.which("alertmanager")
             or shutil.which("prometheus-alertmanager"))  # Debian names the binary this way
    if found:
        return found
    reason = ("Alertmanager is not installed: apt-get install prometheus-alertmanager "
              "(or set FP8GUARD_ALERTMANAGER_BIN)")
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; in CI it must be present (tests/run.sh installs it)")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def alertmanager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A running Alertmanager; yields its base URL."""
    binary = _binary()
    root = tmp_path_factory.mktemp("alertmanager")
    (root / "alertmanager.yml").write_text(_CONFIG)
    last_log = ""
    for _ in range(3):  # the free port may be taken between probing and binding; try another
        port = _free_port()
        log_path = root / f"log-{port}.txt"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [binary, f"--config.file={root / 'alertmanager.yml'}", f"--storage.path={root / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=", "--log.level=info"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        base = f"http://127.0.0.1:{port}"
        try:
            if _ready(proc, base, timeout_s=30):
                yield base
                return
            last_log = Path(log_path).read_text(errors="replace")[-2000:]
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    pytest.fail(f"Alertmanager did not start; its log ends with:\n{last_log}")


def _ready(proc: subprocess.Popen[bytes], base: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            try:
                if client.get(f"{base}/-/ready").status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    return False


@pytest.fixture
def engine(migrated_url: str) -> Iterator[Engine]:
    eng = make_engine(migrated_url)
    yield eng
    eng.dispose()


def _alerts(base: str, key: str, **params: str) -> list[dict[str, Any]]:
    query = {"filter": f'alert_key="{key}"', **params}
    r = httpx.get(f"{base}/api/v2/alerts", params=query, timeout=5)
    r.raise_for_status()
    found: list[dict[str, Any]] = r.json()
    return found


def _gone_or_ended(base: str, key: str) -> bool:
    """Resolved: no longer listed, or listed with endsAt in the past and not active."""
    now = datetime.now(UTC)
    for a in _alerts(base, key):
        ends = datetime.fromisoformat(a["endsAt"].replace("Z", "+00:00"))
        if a["status"]["state"] == "active" and ends > now:
            return False
    return True


def _status(engine: Engine, key: str) -> str:
    with engine.connect() as conn:
        return str(conn.scalar(sa.select(SqlAlert.status).where(SqlAlert.dedupe_key == key)))


def test_push_read_back_and_resolve(alertmanager: str, engine: Engine, db_url: str) -> None:
    key = f"r-am-{db_url[:6]}:rollback:7"
    settings = AlertSettings(alertmanager=[AlertmanagerSink(url=alertmanager)],
                             dashboard_url="https://fp8.example.com")
    alert = Alert(run_id="r-am", kind="rollback", severity="critical", step=1200, dedupe_key=key,
                  summary="Loss spiked 40x at step 1200; rolled back to step 1000.",
                  details={"checkpoint_step": 1000})
    with engine.begin() as conn:
        assert enqueue(conn, [alert], settings, datetime.now(UTC), None) == 1
    # Alertmanager judges endsAt by its own clock, so the dispatcher runs on the real one too.
    dispatcher = AlertDispatcher(engine, settings)
    try:
        assert dispatcher.run_once() == 1
        assert _status(engine, key) == "sent"
        wait_for(lambda: len(_alerts(alertmanager, key)) == 1, 10, "the alert to be listed")
        [am] = _alerts(alertmanager, key)
        assert am["labels"] == {"alertname": "FP8GuardRollback", "severity": "critical", "run": "r-am",
                                "service": "fp8guard", "alert_key": key}
        assert am["annotations"]["summary"] == alert.summary
        assert "checkpoint_step: 1000" in am["annotations"]["description"]
        assert am["annotations"]["dashboard_url"] == "https://fp8.example.com/runs/r-am"
        assert am["generatorURL"] == "https://fp8.example.com/runs/r-am"
        assert am["status"]["state"] == "active"
        ends = datetime.fromisoformat(am["endsAt"].replace("Z", "+00:00"))
        assert ends > datetime.now(UTC), "still firing"

        with engine.begin() as conn:
            assert resolve(conn, key, datetime.now(UTC)) == 1
        assert dispatcher.run_once() == 1
        assert _status(engine, key) == "resolved"
        wait_for(lambda: _gone_or_ended(alertmanager, key), 10, "the alert to be resolved")
    finally:
        dispatcher.close()


def test_active_alert_is_resent_then_expires(alertmanager: str, engine: Engine, db_url: str) -> None:
    key = f"r-am-{db_url[:6]}:bf16_fallback:3"
    settings = AlertSettings(alertmanager=[AlertmanagerSink(url=alertmanager)],
                             resend_interval_s=0.5, active_for_s=1.5)
    alert = Alert(run_id="r-am", kind="bf16_fallback", severity="warning", step=50, dedupe_key=key,
                  summary="layers.3.mlp.fc1 fell back to BF16 after repeated amax overflows.")
    with engine.begin() as conn:
        enqueue(conn, [alert], settings, datetime.now(UTC), None)
    dispatcher = AlertDispatcher(engine, settings)
    deadline = time.monotonic() + 20
    try:
        while _status(engine, key) != "resolved":
            assert time.monotonic() < deadline, "the alert never resolved"
            dispatcher.run_once()
            with engine.connect() as conn:
                row = conn.execute(sa.select(SqlAlert.status, SqlAlert.active_until)
                                   .where(SqlAlert.dedupe_key == key)).one()
            listed = [a["status"]["state"] for a in _alerts(alertmanager, key)]
            # Between re-sends it stays firing; only near active_until may endsAt have passed.
            if row.status == "sent" and datetime.now(UTC) < row.active_until - timedelta(seconds=0.3):
                assert listed == ["active"]
            time.sleep(0.1)
        stats = dispatcher.stats()["alertmanager"]
        assert stats["sent"] == 1 and stats["resent"] >= 1 and stats["resolved"] == 1
        assert stats["retry"] == stats["failed"] == 0
        wait_for(lambda: _gone_or_ended(alertmanager, key), 10, "the alert to be resolved")
    finally:
        dispatcher.close()
