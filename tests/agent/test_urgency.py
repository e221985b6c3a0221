"""The monitor's urgency after the tripwire fires (``fp8guard.agent.urgency``): the first trip of
an incident ships at once, a trip that persists does not ship at every step, new evidence and
a new incident ship at once again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fp8guard.agent import Monitor, MonitorConfig  # noqa: E402
from fp8guard.agent.transport import JsonlFileTransport  # noqa: E402


def _urgent_flushes(tmp_path: Path, losses: list[float], grad_norms: list[float]) -> list[int]:
    """Train a plain model through ``monitor.step`` with these scalars, regular flushes far away
    (ring of 1,000 steps, an hour); the last step of every batch shipped before ``close``."""
    path = tmp_path / "t.jsonl"
    monitor = Monitor(MonitorConfig(run_id="urgency", flush_interval_steps=1000, flush_interval_s=3600.0,
                                    tripwire_wait_s=0.0, harm_interval_steps=0),
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
