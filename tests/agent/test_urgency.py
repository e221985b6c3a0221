"""The monitor's urgency after the tripwire fires (``fp8guard.agent.urgency``): the first trip of
an incident ships at once, a trip that persists does not ship at every step, new evidence and
a new incident ship at once again."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from fp8guard.agent import Monitor, MonitorConfig  # noqa: E402
from fp8guard.agent.transport import JsonlFileTransport  # noqa: E402


def _urgent_flushes(tmp_path: Path, losses: list[float], grad_norms: list[float]) -> list[int]:
    """Train a plain model through ``monitor.step`` with these scalars, regular flushes far away
    (ring of 1,000 steps, an hour); the last step of every batch shipped before ``close``."""
    path = tmp_path / "t.jsonl"
    # Which steps ship is under test, not the shipper's back-pressure: a queue that never drops
    # (16 flushes come back to back, and a starved shipper thread would drop the oldest past 8).
    monitor = Monitor(MonitorConfig(run_id="urgency", flush_interval_steps=1000, flush_interval_s=3600.0,
                                    tripwire_wait_s=0.0, harm_interval_steps=0, max_pending_flushes=1000),
                      transport=JsonlFileTransport(path))
    monitor.attach(torch.nn.Linear(4, 4))
    for loss, norm in zip(losses, grad_norms, strict=True):
        monitor.step(torch.tensor(loss), grad_norm=torch.tensor(norm))
    monitor.close()
    batches = [json.loads(line)["steps"] for line in path.read_text().splitlines()]
    return [b[-1]["step"] for b in batches[:-1] if b]  # the last batch is close's


def test_a_persisting_trip_ships_at_once_then_backs_off(tmp_path: Path) -> None:
    """A loss that stays 10x high from step 20 to step 119 trips at every step; the first trip
    ships at the next boundary, and the incident's 100 trips ship about 20 times, not 100."""
    losses = [1.0] * 20 + [10.0] * 100
    shipped = _urgent_flushes(tmp_path, losses, [1.0] * len(losses))
    assert shipped[0] == 20, shipped  # the trip's own step, shipped at the next boundary
    assert shipped[:16] == list(range(20, 36)), shipped  # a rule deciding late in a streak still gets its step
    assert len(shipped) <= 16 + 3, shipped  # then powers of two only: streak 32 and 64


def test_new_evidence_and_a_new_incident_ship_at_once(tmp_path: Path) -> None:
    """Within a persisting loss trip, the gradient norm tripping too ships at its step; after a
    step without a trip, the next trip is a new incident and ships at once."""
    losses = [1.0] * 20 + [10.0] * 60 + [1.0] + [10.0] * 5 + [1.0] * 3
    norms = [1.0] * len(losses)
    norms[60] = 100.0
    shipped = _urgent_flushes(tmp_path, losses, norms)
    assert 60 in shipped and 59 not in shipped and 61 not in shipped, shipped
    assert 81 in shipped, shipped


def _forced_probes(tmp_path: Path, losses: list[float], grad_norms: list[float],
                   commands: dict[int, dict[str, Any]] | None = None) -> tuple[list[int], int]:
    """Train an emulated-FP8 model through ``monitor.step`` with these reported scalars (the probe's
    own forwards compute the model's real, healthy loss: no harm to bisect), regular probes far
    away (every 1,000 steps); the steps that probed and the probe's forwards."""
    from fp8guard.agent import emulate_fp8

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    fp8 = emulate_fp8(model)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    path = tmp_path / "p.jsonl"
    monitor = Monitor(MonitorConfig(run_id="probe", flush_interval_steps=1000, flush_interval_s=3600.0,
                                    tripwire_wait_s=0.0, harm_interval_steps=1000),
                      transport=JsonlFileTransport(path))
    monitor.attach(model)
    for step, (loss, norm) in enumerate(zip(losses, grad_norms, strict=True)):
        if commands and step in commands:
            monitor.receive_commands([commands[step]])  # applies at this step's boundary
        torch.nn.functional.mse_loss(model(x), y).backward()  # a training forward: FP8 state to probe with
        fp8.update()
        model.zero_grad()
        monitor.step(torch.tensor(loss), grad_norm=torch.tensor(norm),
                     loss_fn=lambda: torch.nn.functional.mse_loss(model(x), y))
    harm = monitor._harm
    assert harm is not None
    forwards = harm.forwards
    monitor.close()
    steps = [s for line in path.read_text().splitlines() for s in json.loads(line)["steps"]]
    return [s["step"] for s in steps if "fp8_loss_gap" in s], forwards


def test_a_persisting_trip_probes_at_its_start_then_backs_off(tmp_path: Path) -> None:
    """A loss that stays 10x high from step 20 to step 119 trips at every step. Each trip used to
    force a probe (two forwards, 200 over the incident); the incident probes at its first steps,
    then at streak 8, 16, 32, 64 only."""
    losses = [1.0] * 20 + [10.0] * 100
    probed, forwards = _forced_probes(tmp_path, losses, [1.0] * len(losses))
    assert probed[0] == 21, probed  # the trip's verdict is read, and the probe runs, at the next step
    assert probed[:4] == list(range(probed[0], probed[0] + 4)), probed
    assert len(probed) <= 4 + 4, probed
    assert forwards == 2 * len(probed), (forwards, probed)


def test_new_evidence_and_a_new_incident_probe_again(tmp_path: Path) -> None:
    """Within a persisting loss trip, the gradient norm tripping too probes at its step; after a
    step without a trip, the next trip is a new incident and probes at once."""
    losses = [1.0] * 20 + [10.0] * 60 + [1.0] + [10.0] * 5 + [1.0] * 3
    norms = [1.0] * len(losses)
    norms[60] = 100.0
    probed, _ = _forced_probes(tmp_path, losses, norms)
    # a trip's verdict is read, and the probe runs, at the next step
    assert 61 in probed and 60 not in probed and 62 not in probed, probed
    assert 82 in probed, probed


def test_an_applied_command_probes_again(tmp_path: Path) -> None:
    """A command applied during a persisting trip (a fallback: does the gap close?) starts a new
    incident: the next trip probes at once, and at the incident's first steps again."""
    losses = [1.0] * 20 + [10.0] * 100
    fallback = {"id": 1, "kind": "fallback", "reason": "r", "modules": ["0"]}
    probed, _ = _forced_probes(tmp_path, losses, [1.0] * len(losses), commands={50: fallback})
    # the command applies at step 50's boundary and drops the verdicts pending then (step 50's):
    # step 51's trip, read at step 52, is the new incident's first
    assert probed[probed.index(36) + 1:probed.index(36) + 6] == [52, 53, 54, 55, 59], probed


def test_a_trip_waits_for_a_decision_only_where_one_can_come(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Behind a NullTransport (shipping off) no service can answer: a trip does not wait
    ``tripwire_wait_s`` for a decision (on the H200 each such wait showed as a 250 ms step in the
    torchao bench's monitored blocks). Behind a transport that may deliver commands it waits."""
    from fp8guard.agent import NullTransport, urgency

    main = threading.get_ident()
    naps: list[float] = []
    real_sleep = time.sleep

    def sleep(s: float) -> None:
        if threading.get_ident() == main:
            naps.append(s)
        real_sleep(s)

    monkeypatch.setattr(urgency.time, "sleep", sleep)

    def waits(transport: Any) -> int:
        naps.clear()
        monitor = Monitor(MonitorConfig(run_id="waits", flush_interval_steps=1000, flush_interval_s=3600.0,
                                        tripwire_wait_s=0.05, harm_interval_steps=0), transport=transport)
        monitor.attach(torch.nn.Linear(4, 4))
        for loss in [1.0] * 20 + [10.0] * 4:  # the loss jumps 10x: trips, read a step later
            monitor.step(torch.tensor(loss), grad_norm=torch.tensor(1.0))
        monitor.close()
        return len(naps)

    assert waits(JsonlFileTransport(tmp_path / "t.jsonl")) > 0
    assert waits(NullTransport()) == 0
