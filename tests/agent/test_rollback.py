"""Rollback on the CPU through the Monitor's command path: the checkpoint restored bit-exactly at the
first step boundary, once per command id, batches skipped, the abandoned timeline's checkpoints
discarded, a bit-identical replay, the learning rate lowered for n steps (or handed to a schedule
hook), and failures that change nothing.

CheckpointManager is tested in test_checkpoint.py, fallback and promotion in test_remediation.py;
their shared run and helpers in remediation_helpers.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from fp8guard.agent import Monitor, MonitorConfig  # noqa: E402
from fp8guard.agent.checkpoint import CheckpointManager  # noqa: E402
from fp8guard.agent.remediation import Remediator  # noqa: E402
from fp8guard.agent.transport import JsonlFileTransport  # noqa: E402
from tests.agent.remediation_helpers import (  # noqa: E402
    Run,
    _assert_same_state,
    _cmd,
    _run,
    _snapshot,
    _train_step,
)

# -- rollback ---------------------------------------------------------------------------------------


def _monitor_run(tmp_path: Path, remediator_kw: dict[str, Any] | None = None,
                 ) -> tuple[Run, Monitor, Remediator, Path]:
    r = _run(tmp_path, every=5)
    events = tmp_path / "telemetry.jsonl"
    remediator = Remediator(checkpoints=r.ckpts, **(remediator_kw or {}))
    monitor = Monitor(MonitorConfig(run_id="rollback", command_check_interval_steps=5, flush_interval_steps=100),
                      transport=JsonlFileTransport(events)).attach(r.model, r.opt, handler=remediator)
    return r, monitor, remediator, events


def _loop(r: Run, monitor: Monitor, remediator: Remediator, steps: Iterator[int] | range, *,
          inject: dict[int, list[dict[str, Any]]] | None = None,
          on_resume: Any = None) -> list[tuple[int, float]]:
    """The documented loop; returns (step, loss) of every step that completed."""
    done: list[tuple[int, float]] = []
    step, end = steps.start, steps.stop  # type: ignore[union-attr]
    while step < end:
        x, y = r.data.next()
        _, loss = r.model(x, y)
        assert loss is not None
        loss.backward()
        r.fp8.update()
        if inject and step in inject:
            monitor.receive_commands(inject[step])
        monitor.step(loss, step=step)  # also ends a lowered-LR window (the handler's on_step)
        if monitor.next_step != step + 1:  # rolled back: this iteration belongs to the abandoned stretch
            resume = monitor.next_step
            if on_resume is not None:
                on_resume(step, resume)
            step = resume
            continue
        r.opt.step()
        r.sched.step()
        r.opt.zero_grad()
        r.ckpts.maybe_save(step, extra={"monitor": monitor.state_dict()})
        done.append((step, float(loss.detach())))
        step += 1
    return done


def _events(path: Path) -> list[dict[str, Any]]:
    return [e for line in path.read_text().splitlines() for e in json.loads(line)["events"]]


def test_rollback_through_the_monitor_restores_the_checkpoint_bit_exactly(tmp_path: Path) -> None:
    r, monitor, remediator, events_path = _monitor_run(tmp_path)
    saved: dict[int, dict[str, torch.Tensor]] = {}
    orig_save = r.ckpts.save

    def save(step: int, **kw: Any) -> Path:
        saved[step] = _snapshot(r.model)
        return orig_save(step, **kw)

    r.ckpts.save = save  # type: ignore[method-assign]
    at_resume: dict[str, Any] = {}

    def on_resume(step: int, resume: int) -> None:
        at_resume.update(step=step, resume=resume, params=_snapshot(r.model), segment=monitor.segment,
                         next_step=monitor.state_dict()["next_step"], position=r.data.position,
                         steps=r.ckpts.steps())

    rollback = {"id": 7, "kind": "rollback", "checkpoint_step": 4, "skip_batches": 3, "reason": "loss spike"}
    first = _loop(r, monitor, remediator, range(0, 17), inject={12: [rollback]}, on_resume=on_resume)

    # one process needs no broadcast: applied at the first step boundary after it arrived
    assert at_resume["step"] == 12 and at_resume["resume"] == 5
    _assert_same_state(at_resume["params"], saved[4])
    assert at_resume["segment"] == 1 and at_resume["next_step"] == 5
    assert at_resume["position"] == 5 + 3  # batches 5, 6, 7 skipped
    assert at_resume["steps"] == [4]  # the abandoned timeline's checkpoint of step 9 is gone
    assert [s for s, _ in first] == [*range(0, 12), *range(5, 17)]
    # the same id delivered again (a retried ingest answer) and a duplicate in one delivery: once
    again = _loop(r, monitor, remediator, range(17, 25), inject={17: [rollback, rollback]}, on_resume=on_resume)
    assert [s for s, _ in again] == list(range(17, 25)) and at_resume["step"] == 12
    monitor.close()
    events = _events(events_path)
    acks = [e for e in events if e["kind"] == "command_acknowledged"]
    assert len(acks) == 1 and acks[0]["step"] == 12
    assert acks[0]["data"]["status"] == "applied" and acks[0]["data"]["command_id"] == 7
    assert acks[0]["data"]["resume_step"] == 5 and acks[0]["data"]["data_position"] == 8
    assert acks[0]["data"]["discarded_checkpoints"] == [9]
    assert [e["step"] for e in events if e["kind"] == "rollback_applied"] == [12]


def test_replay_after_rollback_without_skipping_is_bit_identical(tmp_path: Path) -> None:
    r, monitor, remediator, _ = _monitor_run(tmp_path)
    rollback = {"id": 1, "kind": "rollback", "checkpoint_step": 4}
    done = _loop(r, monitor, remediator, range(0, 12), inject={7: [rollback]})
    losses: dict[int, list[float]] = {}
    for s, loss in done:
        losses.setdefault(s, []).append(loss)
    assert [s for s, _ in done] == [*range(0, 7), *range(5, 12)]
    for s in range(5, 7):  # same weights, optimizer, scheduler, FP8 state and batches: same loss
        assert losses[s][0] == losses[s][1], s
    monitor.close()


def test_rollback_scales_the_learning_rate_for_n_steps(tmp_path: Path) -> None:
    r, monitor, remediator, _ = _monitor_run(tmp_path)
    seen: list[float] = []  # the lr each optimizer step used
    r.opt.register_step_pre_hook(lambda opt, args, kwargs: seen.append(opt.param_groups[0]["lr"]))
    rollback = {"id": 1, "kind": "rollback", "checkpoint_step": 4, "lr_scale": 0.25, "lr_scale_steps": 3}
    done = _loop(r, monitor, remediator, range(0, 12), inject={9: [rollback]})
    steps = [s for s, _ in done]
    assert steps == [*range(0, 9), *range(5, 12)]
    base = {s: 3e-3 / (1 + 0.1 * s) for s in range(12)}  # LambdaLR's value at each step
    for i, s in enumerate(steps):
        lr = seen[i]
        scaled = 5 <= s < 8 and i >= 9  # the three steps after resuming
        assert lr == pytest.approx(base[s] * (0.25 if scaled else 1.0), rel=1e-12), (s, i)
    assert remediator.lr_scaled_until is None
    monitor.close()


def test_rollback_with_a_schedule_hook_leaves_the_optimizer_alone(tmp_path: Path) -> None:
    calls: list[tuple[float, int]] = []
    r, monitor, remediator, _ = _monitor_run(tmp_path, {"lr_schedule_hook": lambda s, n: calls.append((s, n))})
    _loop(r, monitor, remediator, range(0, 10))
    lr = r.opt.param_groups[0]["lr"]
    outcome = remediator.apply(_cmd("rollback", checkpoint_step=9, lr_scale=0.5, lr_scale_steps=20), step=9)
    assert outcome.status == "applied" and outcome.details["lr_scaled_by"] == "hook"
    assert calls == [(0.5, 20)] and r.opt.param_groups[0]["lr"] == lr
    monitor.close()


def test_rollback_failures_change_nothing(tmp_path: Path) -> None:
    r = _run(tmp_path)
    _train_step(r)
    r.ckpts.save(4)
    _train_step(r)
    before, position = _snapshot(r.model), r.data.position
    remediator = Remediator(checkpoints=r.ckpts)
    missing = remediator.apply(_cmd("rollback", checkpoint_step=3), step=9)
    assert missing.status == "failed" and missing.error is not None
    assert "no checkpoint of step 3" in missing.error and "steps: [4]" in missing.error
    ahead = remediator.apply(_cmd("rollback", cid=2, checkpoint_step=4), step=2)
    assert ahead.status == "failed" and "after the current step" in str(ahead.error)
    no_ckpts = Remediator().apply(_cmd("rollback", cid=3, checkpoint_step=4), step=9)
    assert no_ckpts.status == "failed" and "checkpoints=CheckpointManager" in str(no_ckpts.error)
    no_data = CheckpointManager(tmp_path / "ckpt", model=r.model, optimizer=r.opt, rank=0)
    skip = Remediator(checkpoints=no_data).apply(_cmd("rollback", cid=4, checkpoint_step=4, skip_batches=5), step=9)
    assert skip.status == "failed" and "cannot skip 5 batches" in str(skip.error)
    _assert_same_state(_snapshot(r.model), before)
    assert r.data.position == position
    x, y = r.data.batch(0)
    r.model(x, y)[1].backward()  # type: ignore[union-attr]  # gradients of the abandoned step
    ok = remediator.apply(_cmd("rollback", cid=5, checkpoint_step=4, skip_batches=2), step=9)
    assert ok.status == "applied" and ok.resume_step == 5
    assert r.data.position == 1 + 2 and all(p.grad is None for p in r.model.parameters())
