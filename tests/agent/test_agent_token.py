"""The agent's bearer token: taken from ``token=`` or ``$FP8GUARD_TOKEN``, sent on every request
(registration, ingest, command long-poll), never logged; a refused token is one clear error line,
no hot retry loop, and the telemetry waits in the spool instead of being lost."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from fp8guard import wire
from fp8guard.agent.command_listener import CommandListener
from fp8guard.agent.config import MonitorConfig
from fp8guard.agent.errors import ConfigError
from fp8guard.agent.integrations._common import config_with_token
from fp8guard.agent.transport import HttpTransport, RunInfo

URL = "http://fp8guard.test"
TOKEN = "fp8g_secret_token_value"


class AuthService:
    """Answers like the service with authentication: 401 without the right bearer token."""

    def __init__(self, token: str | None, status_without: int = 401) -> None:
        self.token, self.status_without = token, status_without
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        if self.token is None or request.headers.get("authorization") != f"Bearer {self.token}":
            return httpx.Response(self.status_without, json={"detail": "token refused"})
        if request.method == "PUT":
            return httpx.Response(201, json={})
        if request.method == "GET":
            return httpx.Response(200, json=[])
        return httpx.Response(200, json={"duplicate": False, "commands": []})


def _batch(i: int) -> dict[str, Any]:
    return wire.make_batch(run_id="tok-run", batch_id=f"batch-{i:04d}", steps=[{"step": i, "loss": 1.0}])


def _transport(service: AuthService, tmp_path: Path, token: str | None, **kw: Any) -> HttpTransport:
    client = httpx.Client(base_url=URL, transport=httpx.MockTransport(service))
    return HttpTransport(URL, RunInfo("tok-run"), client=client, token=token, spool_dir=tmp_path / "spool",
                         sleep=lambda s: None, **kw)


def test_token_is_sent_on_registration_and_ingest(tmp_path: Path) -> None:
    service = AuthService(TOKEN)
    t = _transport(service, tmp_path, TOKEN)
    t.send(_batch(0))
    t.send(_batch(1))
    assert [r.method for r in service.seen] == ["PUT", "POST", "POST"]
    assert {r.headers["authorization"] for r in service.seen} == {f"Bearer {TOKEN}"}
    assert t.stats().sent_batches == 2
    t.close()


@pytest.mark.parametrize("status", [401, 403])
def test_refused_token_is_one_error_line_and_the_telemetry_is_spooled(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, status: int) -> None:
    service = AuthService(TOKEN, status_without=status)
    clock = [1000.0]
    t = _transport(service, tmp_path, "wrong-token", max_attempts=4, clock=lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="fp8guard.agent.transport"):
        for i in range(20):
            t.send(_batch(i))
            clock[0] += 1.0  # 20 s of batches: probes every backoff_max_s (5 s), never a retry storm
    assert len(service.seen) <= 5, [r.method for r in service.seen]  # not retried per batch, nor 4 times each
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in caplog.records]
    message = errors[0].getMessage()
    assert f"HTTP {status}" in message and "\n" not in message and "kept" in message
    assert "wrong-token" not in caplog.text and TOKEN not in caplog.text  # never logged
    assert not any("unreachable" in r.getMessage() for r in caplog.records)  # it is not an outage
    s = t.stats()
    assert (s.spooled_batches, s.dropped_batches, s.rejected_batches) == (20, 0, 0)
    # The token is fixed (a new process with the right one): the spool is backfilled, nothing lost.
    t.close()
    t2 = _transport(service, tmp_path, TOKEN)
    t2.send(_batch(20))
    stored = [r for r in service.seen[-21:] if r.method == "POST"]
    assert len(stored) == 21 and t2.stats().backfilled_batches == 20
    t2.close()


def test_long_poll_sends_the_token_and_stops_on_refusal(caplog: pytest.LogCaptureFixture) -> None:
    service = AuthService(TOKEN)
    got: list[list[dict[str, Any]]] = []
    client = httpx.Client(base_url=URL, transport=httpx.MockTransport(service))
    listener = CommandListener(URL, "tok-run", got.append, client=client, token=TOKEN)
    listener.listen(0.3, after=0)
    time.sleep(0.05)
    assert service.seen and service.seen[0].headers["authorization"] == f"Bearer {TOKEN}"
    listener.close()

    refused = AuthService(TOKEN, status_without=403)
    bad = CommandListener(URL, "tok-run", got.append, client=httpx.Client(
        base_url=URL, transport=httpx.MockTransport(refused)), token="nope")
    with caplog.at_level(logging.ERROR, logger="fp8guard.agent.command_listener"):
        bad.listen(2.0, after=0)
        deadline = time.monotonic() + 2
        while bad._thread is not None and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(refused.seen) == 1  # one refusal ends the listening window: no hot loop
    assert len([r for r in caplog.records if "HTTP 403" in r.getMessage()]) == 1
    assert "nope" not in caplog.text
    bad.close()
    assert threading.active_count() >= 1


def test_config_takes_the_token_from_the_environment_and_hides_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FP8GUARD_TOKEN", TOKEN)
    cfg = MonitorConfig(url="http://127.0.0.1:8000")
    assert cfg.token == TOKEN and TOKEN not in repr(cfg)
    assert MonitorConfig(token="other").token == "other"
    monkeypatch.delenv("FP8GUARD_TOKEN")
    assert MonitorConfig().token is None
    with pytest.raises(ConfigError, match="token"):
        MonitorConfig(token="two words")


def test_integrations_pass_token_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FP8GUARD_TOKEN", "from-env")
    assert config_with_token(None, None).token == "from-env"
    assert config_with_token(MonitorConfig(run_id="r"), "explicit").token == "explicit"
    assert config_with_token(MonitorConfig(run_id="r"), "explicit").run_id == "r"
    import inspect

    from fp8guard.agent.integrations.accelerate import attach_accelerate
    assert "token" in inspect.signature(attach_accelerate).parameters
    for module, name in [("fp8guard.agent.integrations.lightning", "FP8GuardCallback"),
                         ("fp8guard.agent.integrations.hf", "FP8GuardTrainerCallback")]:
        try:
            cls = getattr(__import__(module, fromlist=[name]), name)
        except ImportError:  # the framework is not installed here
            continue
        assert cls(MonitorConfig(run_id="r"), token="explicit").config.token == "explicit"
        assert cls(MonitorConfig(run_id="r")).config.token == "from-env"
