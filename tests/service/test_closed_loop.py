"""The loop through the service: a loss spike becomes a finding, a rollback command in the
ingest answer, an acknowledged action, and a signed webhook alert delivered from the outbox."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from fp8guard import wire
from fp8guard.service import Settings, create_app
from fp8guard.service.alerts import AlertSettings, WebhookSink
from tests.helpers import post
from tests.service.alerting_helpers import (
    SECRET,
    Receiver,
    receiver_fixture,  # noqa: F401 - fixture
)


def _steps(run_id: str, steps: list[int], loss: Any, **kw: Any) -> dict[str, Any]:
    return wire.make_batch(run_id=run_id, steps=[{"step": s, "loss": loss(s)} for s in steps], **kw)


def test_loss_spike_to_rollback_command_ack_and_alert(migrated_url: str, receiver: Receiver) -> None:
    settings = Settings(database_url=migrated_url, auth="off",
                        alerts=AlertSettings(webhooks=[WebhookSink(url=receiver.url("/hook"), secret=SECRET)]))
    app = create_app(settings)
    with TestClient(app) as client:
        guard = {"warmup_steps": 10, "rollback_margin_steps": 5, "known_good_after_steps": 5, "skip_batches": 50}
        assert client.put("/v1/runs/loop", json={"guard": guard}).status_code == 201
        events = [{"kind": "checkpoint_saved", "step": 9, "data": {"path": "/ck/9"}}]
        r = post(client, _steps("loop", list(range(40)), lambda s: 2.0 + 0.01 * (s % 5), events=events))
        assert r.json()["commands"] == []
        r = post(client, _steps("loop", [40], lambda s: 9.0))
        # the batch is acknowledged once durable; the loop decides right after, off the request path
        commands = client.get("/v1/runs/loop/commands").json()
        assert [c["kind"] for c in commands] == ["rollback"]
        cmd = commands[0]
        assert cmd["checkpoint_step"] == 9 and cmd["skip_batches"] == (40 - 9) + 50
        # the same command keeps coming with every answer until acknowledged
        assert post(client, _steps("loop", [41], lambda s: 2.0)).json()["commands"] == commands
        ack = {"kind": "command_acknowledged", "step": 42,
               "data": {"command_id": cmd["id"], "status": "applied", "applied_step": 42}}
        post(client, wire.make_batch(run_id="loop", events=[ack, {"kind": "rollback_applied", "step": 42}]))
        assert client.get("/v1/runs/loop/commands").json() == []
        actions = client.get("/v1/runs/loop/actions").json()
        assert actions[0]["kind"] == "rollback" and actions[0]["status"] == "applied" and actions[0]["applied_step"] == 42
        assert "Rolling back to the known-good checkpoint of step 9" in actions[0]["reason"]
        findings = client.get("/v1/runs/loop/findings").json()
        assert findings[0]["rule"] == "loss_spike" and findings[0]["evidence"]["value"] == 9.0
        assert client.get("/v1/runs/loop/checkpoints").json()[0]["known_good"] is True
        app.state.alerts.run_once()
        delivered = receiver.received("/hook")
        assert len(delivered) == 1
        body = delivered[0].json()
        assert body["type"] == "fp8guard.rollback" and "webhook-signature" in delivered[0].headers


def test_dry_run_only_recommends(client) -> None:
    assert client.put("/v1/runs/dry", json={"guard": {"dry_run": True, "warmup_steps": 10}}).status_code == 201
    post(client, _steps("dry", list(range(30)), lambda s: 2.0 + 0.01 * (s % 3)))
    post(client, _steps("dry", [30], lambda s: float("nan")))
    assert post(client, _steps("dry", [31], lambda s: 2.0)).json()["commands"] == []
    actions = client.get("/v1/runs/dry/actions").json()
    assert actions and all(a["status"] in ("recommended", "recorded") for a in actions)


def test_guard_overrides_are_validated(client) -> None:
    r = client.put("/v1/runs/bad-guard", json={"guard": {"saturation_fwd": 0.1}})
    assert r.status_code == 422 and "saturation_fwd" in r.text
    r = client.put("/v1/runs/bad-guard", json={"guard": {"no_such_knob": 1}})
    assert r.status_code == 422 and "no_such_knob" in r.text
