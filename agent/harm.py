"""The harm probe: what FP8 costs this run's loss right now, measured on the current batch.

Every ``harm_interval_steps`` the monitor evaluates the current batch's loss twice more, under
``torch.no_grad`` and with the same weights: once as training computes it (each module in its
training precision) and once with every FP8 module in high precision. The relative difference
``fp8_loss_gap = (loss_fp8 - loss_bf16) / loss_bf16`` is a paired measurement on one batch, so
it needs no BF16 baseline run. Both forwards start from the same RNG state (dropout draws the
same masks in both), and the RNG is put back afterwards, so training's random stream is as if
the probe never ran; each source puts its FP8 state back too (``ProbeableSource.probe``).

The probe itself adds no host sync: its three scalars go into the step's device slots like the
loss does, and a copy of them is read one step later once its event has completed. When the
gap leaves its band (learned from this run's own probes: a robust median and spread), the
probe finds the modules that carry the harm by bisection: half of the FP8 modules in high
precision, then half of the guilty half, ... (about 2 log2(modules) forwards, only then). The
bisection and the promotion trials read each forward's loss on the host: those are sync points,
but only on an anomaly or while modules are held in BF16, never per step.

The probe decides nothing: it reports ``harm_attributed`` and ``promotion_trial`` events, and
the service's policy weighs them (``docs/closed-loop.md``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fp8guard import wire
from fp8guard.agent.sources.base import ProbeableSource

__all__ = ["Attribution", "HarmProbe", "LossFn", "ProbeReading", "StepWork", "Trial"]

log = logging.getLogger("fp8guard.agent")

LossFn = Callable[[], torch.Tensor]
"""Computes the loss of the current batch with the model as it is (the loop's forward and loss)."""

_WARMUP_CEILING = 10.0
"""Before the band exists (fewer than ``warmup_probes`` readings), a gap above this many
``min_gap`` is harm at once; smaller ones build the band."""
_CLOSES = 0.5
"""A half of the candidates "carries the harm" when switching it alone to high precision leaves
at most this fraction of the gap."""


@dataclass(frozen=True, slots=True)
class ProbeReading:
    """One probe's result, on the host."""

    step: int
    loss_fp8: float
    loss_bf16: float
    gap: float


@dataclass(frozen=True, slots=True)
class Attribution:
    """The modules whose high precision closes most of the gap, with the gap before and after."""

    step: int
    modules: list[str]
    gap: float
    gap_after: float
    band_high: float
    forwards: int


@dataclass(frozen=True, slots=True)
class Trial:
    """Modules held in BF16, tried back in FP8 inside the probe while training stays in BF16."""

    step: int
    modules: list[str]
    gap: float
    band_high: float

    @property
    def harmful(self) -> bool:
        return not self.gap <= self.band_high  # NaN is harmful


@dataclass(slots=True)
class StepWork:
    """What the probe did at one step, for the monitor to record."""

    measured: torch.Tensor | None = None
    """``[loss_fp8, loss_bf16, gap]`` on the device, at a probe step."""
    events: list[tuple[wire.EventKind, dict[str, Any]]] = field(default_factory=list)
    hurry: bool = False
    """A harm was attributed: ship now and listen for the decision."""


class HarmProbe:
    """Measures, reads back without waiting, keeps the band, bisects and trials. One per monitor."""

    def __init__(self, sources: Sequence[ProbeableSource], *, interval_steps: int, band_z: float, min_gap: float,
                 warmup_probes: int, device: torch.device) -> None:
        self.sources = list(sources)
        self.interval_steps = interval_steps
        self.band_z = band_z
        self.min_gap = min_gap
        self.warmup_probes = warmup_probes
        self.device = device
        self._history: deque[float] = deque(maxlen=64)
        cuda = device.type == "cuda"
        self._host = torch.zeros(3, dtype=torch.float32, pin_memory=cuda)
        self._event: torch.cuda.Event | None = None
        self._pending: int | None = None
        self.probes = 0
        self.forwards = 0

    # -- when ----------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.interval_steps > 0 and step > 0 and step % self.interval_steps == 0

    def precision(self) -> dict[str, bool]:
        """Every switchable module's training precision (True: FP8)."""
        out: dict[str, bool] = {}
        for source in self.sources:
            out.update(source.precision())
        return out

    def on_step(self, step: int, loss_fn: LossFn, *, alone: bool, force: bool = False) -> StepWork:
        """One step's work: read the last probe (never waits) and, if its gap left the band,
        bisect; measure when due (or ``force``d: the tripwire saw an anomaly, does it cost the
        loss?); trial the modules training holds in BF16. Bisection and trials need one process
        (``alone``): under torch.distributed every rank only measures, at the same steps, since
        a sharded model's forward is a collective."""
        work = StepWork()
        reading = self.poll()
        if reading is not None and self.judge(reading) and alone:
            found = self.bisect(step, loss_fn)
            if found is not None:
                log.warning("fp8guard: FP8 costs %.2f %% of the loss at step %d (band %.2f %%); %s carry it",
                            100 * found.gap, reading.step, 100 * found.band_high, ", ".join(found.modules))
                work.events.append((wire.EventKind.HARM_ATTRIBUTED, {
                    "probe_step": reading.step, "gap": found.gap, "gap_after": found.gap_after,
                    "band_high": found.band_high, "modules": found.modules, "forwards": found.forwards}))
                work.hurry = True
        if not (self.due(step) or force):
            return work
        work.measured = self.measure(step, loss_fn)
        held = [name for name, fp8 in self.precision().items() if not fp8]
        if held and alone:
            trial = self.trial(step, loss_fn, held)
            work.events.append((wire.EventKind.PROMOTION_TRIAL, {
                "modules": trial.modules, "gap": trial.gap, "band_high": trial.band_high, "harmful": trial.harmful}))
        return work

    # -- the measurement (no sync) -------------------------------------------------------------------

    def measure(self, step: int, loss_fn: LossFn) -> torch.Tensor:
        """The step's ``[loss_fp8, loss_bf16, gap]`` as a device tensor; its host copy is read
        later by :meth:`poll`."""
        everything_bf16 = dict.fromkeys(self.precision(), False)
        loss_fp8, loss_bf16 = self._losses(loss_fn, [{}, everything_bf16])
        out = torch.stack((loss_fp8, loss_bf16, (loss_fp8 - loss_bf16) / loss_bf16))
        # sync point (deferred): a non-blocking copy read at a later step once its event completed
        self._host.copy_(out, non_blocking=True)
        if self.device.type == "cuda":
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()
        self._pending = step
        self.probes += 1
        return out

    def poll(self) -> ProbeReading | None:
        """The last probe's values once they have landed on the host; never waits."""
        if self._pending is None or (self._event is not None and not self._event.query()):  # type: ignore[no-untyped-call]
            return None
        step, self._pending = self._pending, None
        loss_fp8, loss_bf16, gap = self._host.tolist()  # host memory: no device sync
        return ProbeReading(step=step, loss_fp8=loss_fp8, loss_bf16=loss_bf16, gap=gap)

    # -- the band ----------------------------------------------------------------------------------

    def band_high(self) -> float:
        """The largest gap this run considers normal: median + band_z robust spreads of its own
        probes (at least ``min_gap`` above the median); before ``warmup_probes`` readings, a
        ceiling of ``10 x min_gap``."""
        if len(self._history) < self.warmup_probes:
            return _WARMUP_CEILING * self.min_gap
        values = list(self._history)
        center = statistics.median(values)
        spread = 1.4826 * statistics.median(abs(v - center) for v in values)
        return center + max(self.band_z * spread, self.min_gap)

    def judge(self, reading: ProbeReading) -> bool:
        """Whether the reading leaves the band; an in-band reading joins the band's history."""
        high = self.band_high()
        if math.isfinite(reading.gap) and reading.gap <= high:
            self._history.append(reading.gap)
            return False
        return True

    # -- attribution and trials (sync points, rare) -------------------------------------------------------

    def bisect(self, step: int, loss_fn: LossFn) -> Attribution | None:
        """The modules whose switch to high precision closes most of the current gap.

        sync point (rare): each forward's loss is read on the host to choose the next half; only
        after the gap left its band."""
        training = self.precision()
        candidates = [name for name, fp8 in training.items() if fp8]
        if not candidates:
            return None
        start = self.forwards
        loss_fp8, reference = (float(v) for v in self._losses(loss_fn, [{}, dict.fromkeys(candidates, False)]))
        gap = (loss_fp8 - reference) / reference
        if not gap > 0:  # the harm is gone on this batch (or FP8 helps): nothing to attribute
            return None

        def remaining(subset: Sequence[str]) -> float:
            (loss,) = self._losses(loss_fn, [dict.fromkeys(subset, False)])
            return (float(loss) - reference) / reference

        while len(candidates) > 1:
            half = len(candidates) // 2
            first, second = candidates[:half], candidates[half:]
            if remaining(first) <= _CLOSES * gap:
                candidates = first
            elif remaining(second) <= _CLOSES * gap:
                candidates = second
            else:
                break  # the harm is spread over both halves: name them all
        return Attribution(step=step, modules=candidates, gap=gap, gap_after=remaining(candidates),
                           band_high=self.band_high(), forwards=self.forwards - start)

    def trial(self, step: int, loss_fn: LossFn, modules: Sequence[str]) -> Trial:
        """The gap with ``modules`` (held in BF16 by training) back in FP8 with fresh FP8 state, as
        a re-promotion would start them, against every module in high precision. sync point
        (rare): only while modules are held in BF16."""
        everything_bf16 = dict.fromkeys(self.precision(), False)
        tried, reference = (float(v) for v in self._losses(loss_fn, [dict.fromkeys(modules, True), everything_bf16],
                                                            prime=modules))
        return Trial(step=step, modules=list(modules), gap=(tried - reference) / reference,
                     band_high=self.band_high())

    # -- the forwards ----------------------------------------------------------------------------------

    def _losses(self, loss_fn: LossFn, plans: Sequence[Mapping[str, bool]],
                prime: Sequence[str] = ()) -> list[torch.Tensor]:
        """``loss_fn()`` once per plan (module -> FP8?), from one RNG state, leaving no trace. The
        modules in ``prime`` that a plan puts in FP8 first run one forward whose amaxes set their
        scales (``settle``): a trial measures them at the scale their own values give."""
        cuda = torch.cuda.is_available() and self.device.type == "cuda"
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if cuda else None
        out = []
        try:
            with torch.no_grad():
                for plan in plans:
                    torch.set_rng_state(cpu_rng)
                    if cuda_rng is not None:
                        torch.cuda.set_rng_state(cuda_rng, self.device)
                    with self._plan(plan):
                        primed = [m for m in prime if plan.get(m)]
                        if primed:
                            loss_fn()
                            self.forwards += 1
                            for source in self.sources:
                                source.settle(primed)
                            torch.set_rng_state(cpu_rng)
                            if cuda_rng is not None:
                                torch.cuda.set_rng_state(cuda_rng, self.device)
                        out.append(loss_fn().detach().float().reshape(()))
                    self.forwards += 1
        finally:
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, self.device)
        return out

    @contextlib.contextmanager
    def _plan(self, plan: Mapping[str, bool]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for source in self.sources:
                names = source.precision()
                stack.enter_context(source.probe({k: v for k, v in plan.items() if k in names}))
            yield
