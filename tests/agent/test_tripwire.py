"""The device-side tripwire: what trips it, what does not, and that reading it never waits."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from fp8guard.agent.tripwire import Tripwire  # noqa: E402


def _wire(**kw: object) -> Tripwire:
    args = {"loss_factor": 1.3, "grad_factor": 5.0, "saturation": 8.0, "warmup_steps": 5, **kw}
    return Tripwire(torch.device("cpu"), **args)  # type: ignore[arg-type]


def _feed(w: Tripwire, losses: list[float], grads: list[float] | None = None,
          sats: list[float] | None = None) -> list[int]:
    fired = []
    for step, loss in enumerate(losses):
        w.check(step, loss=torch.tensor(loss), grad_norm=torch.tensor(grads[step]) if grads else None,
                saturation=torch.tensor([1.0, sats[step]]) if sats else None)
        got = w.fired()  # on the CPU the check of this step is complete at once
        if got is not None:
            fired.append(got)
    return fired


def test_healthy_noise_never_trips() -> None:
    g = torch.Generator().manual_seed(0)
    losses = (3.0 + 0.05 * torch.randn(300, generator=g)).tolist()
    grads = (1.0 + 0.1 * torch.rand(300, generator=g)).tolist()
    sats = (0.5 + 3.0 * torch.rand(300, generator=g)).tolist()
    assert _feed(_wire(), losses, grads, sats) == []


def test_nonfinite_trips_from_the_first_step() -> None:
    assert _feed(_wire(), [math.nan, 3.0]) == [0]
    assert _feed(_wire(), [3.0, 3.0], grads=[1.0, math.inf]) == [1]


def test_jumps_trip_after_warmup_and_stay_out_of_the_baseline() -> None:
    losses = [3.0] * 10 + [4.2] + [3.0] * 5 + [4.2]
    assert _feed(_wire(), losses) == [10, 16]  # the first jump did not raise the baseline
    assert _feed(_wire(), [3.0, 4.2, 3.0]) == []  # before warmup a jump alone does not count


def test_a_blowup_from_the_first_step_trips_before_the_warmup_ends() -> None:
    """A learning rate far too high: the loss leaves its first value at step 2, long before a
    running average exists; the early bound (the service's, over one step fewer) catches it."""
    assert _feed(_wire(warmup_steps=10), [3.0, 3.1, 6.0, 9.0, 11.0, 12.0]) == [3, 4, 5]
    grads = [1.0, 0.5, 0.4, 12.0, 15.0, 30.0]
    assert _feed(_wire(warmup_steps=10), [3.0] * 6, grads=grads) == [4, 5]


def test_a_healthy_start_never_trips_the_early_bounds() -> None:
    """Falling losses and a gradient norm that falls, then rises a few times its low, do not trip;
    nor does a loss within the early rise of its first value."""
    losses = [4.0, 3.9, 4.1, 3.5, 3.2, 3.3, 3.0, 2.9, 2.8, 2.9, 2.7, 2.6]
    grads = [5.0, 2.0, 1.0, 0.8, 3.0, 4.0, 2.5, 2.0, 1.5, 1.4, 1.3, 1.2]
    assert _feed(_wire(warmup_steps=10), losses, grads=grads) == []


def test_the_early_bounds_stop_at_the_end_of_the_warmup() -> None:
    """Once the baseline has its values, only the running-average jump counts (a loss that had
    settled above its first value no longer trips)."""
    losses = [3.0] + [3.5] * 15
    assert _feed(_wire(warmup_steps=5), losses) == [2, 3, 4]  # checks 0-4 are the warm-up


def test_saturation_far_over_the_fp8_maximum_trips() -> None:
    sats = [1.1] * 20
    sats[12] = 40.0
    assert _feed(_wire(), [3.0] * 20, sats=sats) == [12]


def test_distributed_ranks_ignore_their_own_loss() -> None:
    """Under torch.distributed only all-reduced values count, so every rank trips at the same step."""
    assert _feed(_wire(use_loss=False), [3.0] * 10 + [math.nan]) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_reading_never_waits_on_the_gpu() -> None:
    w = Tripwire(torch.device("cuda"), loss_factor=1.3, grad_factor=5.0, saturation=8.0, warmup_steps=0)
    torch.cuda._sleep(50_000_000)  # keep the stream busy
    w.check(0, loss=torch.tensor(float("nan"), device="cuda"), grad_norm=None, saturation=None)
    assert w.fired() is None  # not complete yet: no wait
    torch.cuda.synchronize()
    assert w.fired() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_due_read_waits_for_its_own_check_only() -> None:
    """On a GPU: peek returns at once while the device is busy; due waits for the check of
    ``lag`` boundaries ago and not for the work queued after it."""
    w = Tripwire(torch.device("cuda"), loss_factor=1.3, grad_factor=5.0, saturation=8.0, warmup_steps=0, lag_steps=1)
    torch.cuda.synchronize()
    w.check(0, tick=0, loss=None, grad_norm=torch.tensor(float("nan"), device="cuda"), saturation=None)
    torch.cuda._sleep(200_000_000)  # the next step's work, queued behind the check
    assert w.peek() == 0 or w.peek() is None  # never waits
    w.check(1, tick=1, loss=None, grad_norm=torch.tensor(1.0, device="cuda"), saturation=None)
    v = w.due(1)
    assert v is not None and v.shared and v.step == 0
    later = w._events[1]
    assert later is not None and not later.query()  # the wait did not drain the queue behind it
    torch.cuda.synchronize()


# -- the fixed-lag read that every rank agrees on ---------------------------------------------------


class _Event:
    """Stands in for a CUDA event whose copy has not landed yet (CPU copies land at once)."""

    def __init__(self) -> None:
        self.done = False
        self.queries = 0
        self.waits = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


def _slow(w: Tripwire, tick: int) -> _Event:
    event = _Event()
    w._events[tick % w._capacity] = event  # type: ignore[assignment]
    return event


def test_due_reads_each_verdict_exactly_lag_boundaries_later() -> None:
    w = _wire(lag_steps=2)
    grads = [1.0, 1.0, math.nan, 1.0, 1.0, 1.0]
    due = []
    for tick, g in enumerate(grads):
        w.check(100 + tick, tick=tick, loss=torch.tensor(3.0), grad_norm=torch.tensor(g), saturation=None)
        v = w.due(tick)
        due.append(None if v is None else (v.step, v.shared))
    assert due == [None, None, (100, False), (101, False), (102, True), (103, False)]


def test_peek_is_early_and_local_but_due_still_reports_the_verdict() -> None:
    """Peek makes a rank flush early; the due read reports the same verdict at its fixed
    boundary whether this rank peeked it or not (another rank may not have)."""
    w = _wire(lag_steps=2)
    w.check(7, tick=0, loss=torch.tensor(math.nan), grad_norm=torch.tensor(1.0), saturation=None)
    assert w.peek() == 7 and w.peek() is None
    w.check(8, tick=1, loss=torch.tensor(3.0), grad_norm=torch.tensor(math.inf), saturation=None)
    assert w.due(1) is None
    v0 = w.due(2)
    assert v0 is not None and (v0.step, v0.shared, v0.fired, v0.peeked) == (7, False, True, True)
    v1 = w.due(3)
    assert v1 is not None and (v1.step, v1.shared, v1.peeked) == (8, True, False)


def test_the_host_waits_only_for_the_verdict_due_and_only_if_incomplete() -> None:
    """Peek never waits; due waits (a deferred sync point) only for the check of ``lag`` boundaries
    ago, and only when its copy has not landed: never for an event that completed in time."""
    w = _wire(lag_steps=2)
    events = []
    for tick in range(6):
        w.check(tick, tick=tick, loss=None, grad_norm=torch.tensor(math.nan if tick == 1 else 1.0), saturation=None)
        events.append(_slow(w, tick))
        assert w.peek() is None  # nothing has completed: no wait
        if tick >= 2:
            events[tick - 2].done = tick != 3  # every check but one completes within two boundaries
        v = w.due(tick)
        if tick >= 2:
            assert v is not None and v.step == tick - 2 and v.waited == (tick == 3)
            assert v.shared == (tick - 2 == 1)
    assert [e.waits for e in events] == [0, 1, 0, 0, 0, 0] and w.waits == 1


def test_a_verdict_is_not_lost_when_the_host_runs_ahead() -> None:
    """Before the fixed-lag read, one host word held one verdict: a check still in flight at the
    next step's read was overwritten by that step's check, and its trip was never seen."""
    w = _wire(lag_steps=2)
    w.check(0, tick=0, loss=None, grad_norm=torch.tensor(math.nan), saturation=None)
    slow = _slow(w, 0)
    assert w.peek() is None
    w.check(1, tick=1, loss=None, grad_norm=torch.tensor(1.0), saturation=None)
    assert w.peek() is None  # the first check is still in flight, so is everything after it
    slow.done = True
    assert w.peek() == 0


def test_discard_drops_pending_verdicts_on_every_rank_alike() -> None:
    w = _wire(lag_steps=1)
    w.check(0, tick=0, loss=None, grad_norm=torch.tensor(math.nan), saturation=None)
    w.discard()
    assert w.due(1) is None
    w.check(1, tick=1, loss=None, grad_norm=torch.tensor(math.nan), saturation=None)
    w.check(1, tick=1, loss=None, grad_norm=torch.tensor(1.0), saturation=None)  # a second check of a tick: ignored
    v = w.due(2)
    assert w.checked(1) and v is not None and v.shared


def test_local_quantities_never_set_the_shared_bit() -> None:
    w = _wire(lag_steps=1)
    w.check(0, tick=0, loss=torch.tensor(math.nan), grad_norm=torch.tensor(1.0), saturation=torch.tensor([40.0]))
    v = w.due(1)
    assert v is not None and v.fired and not v.shared
