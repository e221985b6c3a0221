"""Alert settings and the Alert model: validation messages that say what to change, the settings
nested under the service's settings and read from the environment, the model's checks and JSON round
trip, and the package's import boundary (no torch).

Delivery to each sink is in test_alert_delivery.py, the outbox across transactions, processes and
time in test_alert_outbox.py; their shared receiver and builders in alerting_helpers.py.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import pytest
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from fp8guard.service.alerts import Alert, AlertmanagerSink, AlertSettings, SlackSink, WebhookSink
from tests.service.alerting_helpers import SECRET, alert

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
