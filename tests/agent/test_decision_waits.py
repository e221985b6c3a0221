"""A decision the monitor hurried for applies at the step it hurried at, however the commands
before it were delivered (``fp8guard.agent.urgency``, ``fp8guard.agent.command_desk``).

Found on ``bench/scenarios.py``'s ``heal_wide`` at agent batch size 1: the rollback's command came
twice (the ingest answer and the long-poll both carry it), the second copy while the first was
being applied. The copy sat in the inbox, so at the replay's first step, where the harm probe's
bisection hurried for the whole-model fallback, the monitor saw a non-empty inbox, did not wait,
and the fallback (19 ms away) applied one step later, after a second FP8 step whose loss spiked:
a second rollback that batch size 10 did not get."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from fp8guard import wire  # noqa: E402
from fp8guard.agent import Monitor, MonitorConfig  # noqa: E402
from fp8guard.agent.command_desk import CommandDesk  # noqa: E402
from fp8guard.agent.commands import Command, Outcome, parse_command  # noqa: E402
from fp8guard.agent.remediation import Remediator  # noqa: E402
from fp8guard.agent.transport import JsonlFileTransport  # noqa: E402
from tests.agent.test_harm import _loss, _poison, _records, _setup, _teacher  # noqa: E402


def _fallback(command_id: int, module: str) -> dict[str, Any]:
    return {"id": command_id, "kind": "fallback", "reason": "test", "modules": [module]}


def test_a_command_delivered_again_does_not_wait_in_the_inbox() -> None:
    """A copy of a command already applied, or already queued, is not a new command: the inbox
    (what the monitor's waits look at) stays as it was."""
    desk = CommandDesk(lambda *a, **k: None)
    desk.receive([_fallback(1, "a")])
    desk.receive([_fallback(1, "a")])
    assert [c.id for c in desk.inbox] == [1]
    (command,) = desk.take(rank=0, world_size=1)
    desk.apply(command, 5, None)
    desk.receive([_fallback(1, "a")])
    assert not desk.inbox
    desk.receive([_fallback(2, "b")])
    assert [c.id for c in desk.inbox] == [2]


class _CopyWhileApplying:
    """The monitor's command handler: the real Remediator, with the service's second copy of
    each command arriving while the first is applied (as the ingest answer's copy did while a
    rollback restored its checkpoint)."""

    def __init__(self, monitor: Monitor, remediator: Remediator) -> None:
        self.monitor, self.remediator = monitor, remediator

    def apply(self, command: Command, *, step: int) -> Outcome:
        self.monitor.receive_commands([command])
        return self.remediator.apply(command, step=step)

    def on_step(self, step: int) -> None:
        self.remediator.on_step(step)


def _harm_run(tmp_path: Path, *, poison_at: int, before: dict[int, dict[str, Any]], decision: dict[str, Any],
              decision_at: int, check_every: int = 10) -> dict[int, int]:
    """Train the harm probe's test net (probe every 2 steps) with ``before[step]`` delivered ahead of
    that step and ``decision`` delivered by another thread 1 s into step ``decision_at`` (the
    step whose bisection hurries for it; the step's own work takes milliseconds); the step each
    command was applied at. No tripwire: the harm probe's hurry is the only one."""
    model, fp8, opt, x, _ = _setup()
    y = _teacher(model, x)
    path = tmp_path / "t.jsonl"
    monitor = Monitor(MonitorConfig(run_id="waits", harm_interval_steps=2, harm_warmup_probes=3,
                                    flush_interval_steps=1000, flush_interval_s=3600.0, tripwire=False, tripwire_wait_s=10.0,
                                    command_check_interval_steps=check_every), transport=JsonlFileTransport(path))
    monitor.attach(model, opt, handler=_CopyWhileApplying(monitor, Remediator(model=model, sync_ranks=False)))
    timer = None
    for step in range(decision_at + 3):
        if step == poison_at:
            _poison(model, 3, 1e5)
        if step in before:
            monitor.receive_commands([before[step]])
        if step == decision_at:
            timer = threading.Timer(1.0, monitor.receive_commands, args=([parse_command(decision)],))
            timer.start()
        loss = _loss(model, x, y)
        loss.backward()
        fp8.update()
        monitor.step(loss, loss_fn=lambda: _loss(model, x, y))
        opt.zero_grad()
    assert timer is not None
    timer.join()
    monitor.close()
    _, events = _records(path)
    return {e["data"]["command_id"]: e["step"] for e in events
            if e["kind"] == wire.EventKind.COMMAND_ACKNOWLEDGED and e["data"]["status"] == "applied"}


def test_a_copy_of_the_last_command_does_not_cut_the_wait_for_the_next(tmp_path: Path) -> None:
    """Poisoned at 9, probed at 10, read and bisected at 11: the monitor hurries at 11 and waits
    for the decision. A command applied at 10, whose second copy came while it was applied, must
    not end that wait: the decision applies at 11, not at a later step."""
    applied = _harm_run(tmp_path, poison_at=9, before={10: _fallback(1, "layers.0")},
                        decision=_fallback(2, "layers.3"), decision_at=11)
    assert applied == {1: 10, 2: 11}, applied


def test_a_hurried_step_on_the_regular_command_boundary_waits_too(tmp_path: Path) -> None:
    """Poisoned at 7, probed at 8, read and bisected at 9, the monitor hurries at 9, which is also
    a regular command boundary (every 10 steps): it waits there for the decision as at any other
    hurried step, instead of checking an empty inbox and applying the decision steps later."""
    applied = _harm_run(tmp_path, poison_at=7, before={}, decision=_fallback(2, "layers.3"), decision_at=9)
    assert applied == {2: 9}, applied
