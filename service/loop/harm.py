"""Measured FP8 harm, as the agent's harm probe reports it (``fp8guard.agent.harm``): pure and
checkpointable, like the detector it belongs to.

- A step carrying ``loss_bf16`` means the run probes: from that step on the policy asks a
  fallback for measured harm (or broken numerics), not for numerics alone.
- A ``harm_attributed`` event (the probe's gap left the run's band; bisection named the modules)
  is an ``fp8_harm`` finding on those modules: the evidence a fallback needs.
- A ``promotion_trial`` event (modules held in BF16 tried back in FP8 inside the probe) is kept
  in a ledger the policy reads before re-promoting; a harmful trial is also an ``fp8_harm``
  finding on those modules (warning), which keeps them in BF16 longer.

Everything is kept per step and read "as of" a decision step, so the decisions do not depend on
how the telemetry was batched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fp8guard import wire
from fp8guard.service.domain import EventRecord, Finding, StepRow
from fp8guard.service.kinds import Rule, Severity

__all__ = ["HARM_EVENTS", "HarmLedger", "TrialRecord"]

HARM_EVENTS = (wire.EventKind.HARM_ATTRIBUTED.value, wire.EventKind.PROMOTION_TRIAL.value)
"""The event kinds the loop reads (the store hands them back after a restart too)."""

_KEEP_TRIALS = 512


@dataclass(frozen=True, slots=True)
class TrialRecord:
    step: int
    module: str
    harmful: bool


class HarmLedger:
    def __init__(self, state: dict[str, Any] | None = None) -> None:
        s = state or {}
        self.probe_since: int | None = s.get("probe_since")
        """The first step that carried a probe measurement."""
        self.trials: list[TrialRecord] = [TrialRecord(int(t[0]), str(t[1]), bool(t[2])) for t in s.get("trials", [])]

    def state_dict(self) -> dict[str, Any]:
        return {"probe_since": self.probe_since,
                "trials": [[t.step, t.module, t.harmful] for t in self.trials[-_KEEP_TRIALS:]]}

    def probed_at(self, step: int) -> bool:
        return self.probe_since is not None and self.probe_since <= step

    def trials_at(self, step: int) -> list[TrialRecord]:
        return [t for t in self.trials if t.step <= step]

    def observe(self, steps: Sequence[StepRow], events: Sequence[EventRecord]) -> list[Finding]:
        for row in steps:
            if row.loss_bf16 is not None and (self.probe_since is None or row.step < self.probe_since):
                self.probe_since = row.step
        out: list[Finding] = []
        for e in sorted(events, key=lambda e: e.step or 0):
            if e.step is None or e.kind not in HARM_EVENTS:
                continue
            data = e.data
            modules = tuple(str(m) for m in data.get("modules") or [])
            gap, band = _num(data.get("gap")), _num(data.get("band_high"))
            if not modules:
                continue
            if e.kind == wire.EventKind.HARM_ATTRIBUTED:
                after = _num(data.get("gap_after"))
                out.append(Finding(
                    rule=Rule.FP8_HARM, severity=Severity.CRITICAL, step=e.step,
                    onset_step=int(data.get("probe_step") or e.step), modules=modules,
                    explanation=(f"FP8 costs {_pct(gap)} of the loss on the run's own batch (its normal band ends at "
                                 f"{_pct(band)}); {len(modules)} module(s) in high precision leave {_pct(after)} "
                                 f"(bisection): {', '.join(modules[:5])}."),
                    evidence={"gap": gap, "gap_after": after, "band_high": band, "modules": list(modules[:50]),
                              "probe_step": data.get("probe_step"), "forwards": data.get("forwards")}))
                continue
            harmful = bool(data.get("harmful")) or not (gap <= band)
            self.trials += [TrialRecord(e.step, m, harmful) for m in modules]
            if harmful:
                out.append(Finding(
                    rule=Rule.FP8_HARM, severity=Severity.WARNING, step=e.step, onset_step=e.step, modules=modules,
                    explanation=(f"Tried back in FP8 inside the probe, {len(modules)} module(s) held in BF16 would "
                                 f"cost {_pct(gap)} of the loss (band {_pct(band)}): they stay in BF16."),
                    evidence={"trial": True, "gap": gap, "band_high": band, "modules": list(modules[:50])}))
        return out


def _num(value: Any) -> float:
    try:
        number = wire.decode_float(value) if isinstance(value, str) else float(value)
        return math.nan if number is None else number
    except (TypeError, ValueError):
        return math.nan


def _pct(value: float) -> str:
    return f"{100 * value:.2f} %" if math.isfinite(value) else str(value)
