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
