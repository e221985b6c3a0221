"""``Detector``: runs the rules over one rank's telemetry, step by step, and keeps their state
in a JSON-able dict (stored per run and rank, so a service restart forgets nothing).

Every rule's semantics is per step: a batch of 50 steps yields exactly the findings that 50
batches of one step would (same rule, step, tensors; ``tests/service/test_batching.py``). Blocks
are processed with numpy across tensors and, where a rule's state carries from step to step,
with a loop over steps; quiet periods (``cooldown_steps``) are per module and applied in step
order, so two modules crossing the line inside one batch get a finding each.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fp8guard.service.domain import EventRecord, Finding, StatBlock, StepRow
from fp8guard.service.kinds import Rule, Severity
from fp8guard.service.loop import rules
from fp8guard.service.loop.config import GuardConfig
from fp8guard.service.loop.harm import HarmLedger

__all__ = ["FP8_MAX", "Detector", "TensorMeta"]

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
"""Largest finite value of each FP8 format (OCP FP8, as Transformer Engine uses them)."""
_RULE_ORDER = {r: i for i, r in enumerate(Rule)}


@dataclass(frozen=True, slots=True)
class TensorMeta:
    name: str
    module: str
    backward: bool
    """E5M2 gradients get the backward saturation threshold."""
    fp8_max: float | None = None
    """The format's largest value, to derive ``saturation`` from ``amax`` and ``scale``."""


class Detector:
    def __init__(self, config: GuardConfig, tensors: Sequence[TensorMeta], state: dict[str, Any] | None = None) -> None:
        self.config = config
        self.tensors = list(tensors)
        n = len(self.tensors)
        s = state or {}
        self.loss_hist: list[float] = [float(v) for v in s.get("loss_hist", [])]
        self.grad_hist: list[float] = [float(v) for v in s.get("grad_hist", [])]
        self.last_fired: dict[str, int] = dict(s.get("last_fired", {}))
        self.early: dict[str, float] = {k: float(v) for k, v in (s.get("early") or {}).items()}
        """Before the spike rules have a baseline: the first loss, the smallest gradient norm,
        and how many steps in a row each has been far above it."""
        self.sat_run = _arr(s.get("sat_run"), n, np.int64)  # consecutive steps over the saturation threshold
        self.fast = _arr(s.get("fast"), n, np.float32)
        self.slow = _arr(s.get("slow"), n, np.float32)
        self.seen = _arr(s.get("seen"), n, np.int64)
        self.growth_run = _arr(s.get("growth_run"), n, np.int64)
        self.last_log = _arr(s.get("last_log"), n, np.float32, fill=np.nan)
        self.drift = _arr(s.get("drift"), n, np.float32)  # EMA of log2 amax steps
        self.rising = _arr(s.get("rising"), n, np.float32)  # EMA of "this step's amax rose"
        self.ramp_run = _arr(s.get("ramp_run"), n, np.int64)
        self.last_scale = _arr(s.get("last_scale"), n, np.float32, fill=np.nan)
        self.under_base = _arr(s.get("under_base"), n, np.float32, fill=-1.0)
        self.under_run = _arr(s.get("under_run"), n, np.int64)
        self.under_since = _arr(s.get("under_since"), n, np.float64, fill=np.nan)
        """The step of the check that began each tensor's current run of high underflow counts."""
        self.stale_run = _arr(s.get("stale_run"), n, np.int64)  # consecutive steps with a pinned scale
        self.hist_last = _arr(s.get("hist_last"), n, np.float32, fill=np.nan)  # last amax_history_max seen
        self.hist_since = _arr(s.get("hist_since"), n, np.float64, fill=np.nan)  # step it took that value
        self.threshold = np.array([config.saturation_bwd if t.backward else config.saturation_fwd
                                   for t in self.tensors], dtype=np.float64)
        self.spike_bound = np.array([config.saturation_spike_bwd if t.backward else config.saturation_spike_fwd
                                     for t in self.tensors], dtype=np.float64)
        self._seen_steps = np.zeros((0, n), dtype=np.int64)
        self.fp8_max = np.array([t.fp8_max if t.fp8_max else np.nan for t in self.tensors], dtype=np.float32)
        self.harm = HarmLedger(s.get("harm"))
        """What the agent's harm probe measured (``service/loop/harm.py``)."""
        self._modules_of: tuple[list[str], np.ndarray[Any, Any]] | None = None

    def state_dict(self) -> dict[str, Any]:
        """JSON-able; per-tensor arrays as base64 (a 1,000-tensor state as number lists cost
        milliseconds of JSON per batch)."""
        return {
            "loss_hist": self.loss_hist, "grad_hist": self.grad_hist, "last_fired": self.last_fired,
            "early": self.early, "harm": self.harm.state_dict(), **{name: _pack(getattr(self, name)) for name in _ARRAYS},
        }

    # -- feeding ------------------------------------------------------------------------------

    def observe(self, steps: Sequence[StepRow], blocks: Sequence[StatBlock],
                events: Sequence[EventRecord] = ()) -> list[Finding]:
        """Run every rule over the batch's steps in order; return what fired, in step order."""
        findings: list[Finding] = self.harm.observe(steps, events)
        for row in sorted(steps, key=lambda r: r.step):
            findings += self._scalars(row.step, row)
        n = len(self.tensors)
        for block in blocks:
            if n == 0 or block.values.shape[2] < n:
                continue
            stats = {name: block.values[:, k, :n] for k, name in enumerate(block.stats)}
            # float32 as stored: the rules compare against thresholds, converting 3 x 100k
            # values to float64 per batch only cost time
            if "saturation" not in stats and "amax" in stats and "scale" in stats:
                stats["saturation"] = self._derived_saturation(stats["amax"], stats["scale"])
            elif "scale" in stats:
                self.last_scale = np.where(np.isfinite(stats["scale"][-1]), stats["scale"][-1], self.last_scale)
            if "amax" in stats:
                findings += self._inf_amax(block.steps, stats["amax"])
                findings += self._growth(block.steps, stats["amax"])
                findings += self._ramp(block.steps, stats["amax"])
            if "saturation" in stats:
                findings += self._saturation(block.steps, stats["saturation"])
            if "underflows" in stats:
                for i, step in enumerate(block.steps.tolist()):
                    findings += self._underflow(step, stats["underflows"][i])
            if "amax" in stats and "amax_history_max" in stats:
                findings += self._stale(block.steps, stats["amax"], stats["amax_history_max"])
        return sorted(findings, key=lambda f: (f.step, _RULE_ORDER[f.rule]))

    def _derived_saturation(self, amax: np.ndarray[Any, Any], scale: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """``saturation_t = amax_t * scale_{t-1} / fp8_max``: the scale a step casts with is the one
        the previous step's update produced (``scale`` is reported after the step's update)."""
        prev = np.vstack([self.last_scale[None, :], scale[:-1]]).astype(np.float32)
        self.last_scale = np.where(np.isfinite(scale[-1]), scale[-1], self.last_scale).astype(np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            out: np.ndarray[Any, Any] = (amax * prev / self.fp8_max[None, :]).astype(np.float32)
        return out

    def _cool(self, key: str, step: int) -> bool:
        last = self.last_fired.get(key)
        if last is not None and step - last < self.config.cooldown_steps and step >= last:
            return False
        self.last_fired[key] = step
        return True

    def _fresh_events(self, rule: str, steps: np.ndarray[Any, Any],
                      hits: np.ndarray[Any, Any]) -> list[tuple[int, np.ndarray[Any, Any]]]:
        """Every step, in order, with hit tensors whose module is not cooling down for ``rule``,
        and those tensors; marks their modules as fired as it goes. Cooling is per module: a
        second module crossing the line a few steps after the first is its own finding, in the
        same batch or the next."""
        cd = self.config.cooldown_steps
        candidates = np.flatnonzero(hits.any(axis=1))
        if candidates.size == 0:
            return []
        modules, module_of = self._module_index()
        # Per module, not per tensor: a 1,000-tensor run has a quarter as many modules, and a
        # module's tensors share its cooldown.
        last = np.array([self.last_fired.get(f"{rule}:{m}", np.nan) for m in modules], dtype=np.float64)
        out = []
        for row in candidates.tolist():
            at = float(steps[row])
            with np.errstate(invalid="ignore"):
                ready = np.isnan(last) | (at - last >= cd) | (at < last)  # at < last: a rollback rewound the steps
            idx = np.flatnonzero(hits[row] & ready[module_of])
            if idx.size == 0:
                continue
            # Not np.unique: numpy 2 imports numpy.ma on its first call, 30 ms of CPU (under the
            # GIL) in the middle of a service's first decision.
            fired = np.flatnonzero(np.bincount(module_of[idx], minlength=len(modules)))
            for k in fired.tolist():
                self.last_fired[f"{rule}:{modules[k]}"] = int(at)
            last[fired] = at
            out.append((row, idx))
        return out

    def _module_index(self) -> tuple[list[str], np.ndarray[Any, Any]]:
        """The run's modules, and each tensor's module as an index into them (built once)."""
        if self._modules_of is None:
            names = sorted({t.module for t in self.tensors})
            at = {m: i for i, m in enumerate(names)}
            self._modules_of = (names, np.array([at[t.module] for t in self.tensors], dtype=np.int64))
        return self._modules_of

    def _scalars(self, step: int, row: StepRow) -> list[Finding]:
        cfg = self.config
        out: list[Finding] = []
        bad = {name: v for name, v in (("loss", row.loss), ("grad_norm", row.grad_norm))
               if v is not None and not math.isfinite(v)}
        if bad and self._cool("nonfinite", step):
            what = " and ".join(f"{k} is {v}" for k, v in bad.items())
            out.append(Finding(rule=Rule.NONFINITE, severity=Severity.CRITICAL, step=step, onset_step=step,
                               explanation=f"At step {step} the {what}: the update is poisoned.",
                               evidence={k: str(v) for k, v in bad.items()}))
        out += self._early(step, row)
        for name, value, hist, z, rise in (("loss", row.loss, self.loss_hist, cfg.loss_z, cfg.loss_min_rise),
                                           ("grad_norm", row.grad_norm, self.grad_hist, cfg.grad_z, cfg.grad_min_rise)):
            if value is None or not math.isfinite(value):
                continue
            spike = rules.robust_spike(hist, value, z=z, min_rise=rise, warmup=cfg.warmup_steps)
            if spike is not None:
                if self._cool(f"{name}_spike", step):
                    severity = Severity.CRITICAL if name == "loss" or spike.rise > 10 * rise else Severity.WARNING
                    out.append(Finding(
                        rule=Rule(f"{name}_spike"), severity=severity, step=step, onset_step=step,
                        explanation=(f"The {name.replace('_', ' ')} jumped to {value:.4g} at step {step}, "
                                     f"{spike.rise:.0%} above its recent median {spike.median:.4g} "
                                     f"(robust z = {spike.z:.1f})."),
                        evidence={"value": value, "median": spike.median, "z": spike.z, "rise": spike.rise}))
                continue  # keep spikes out of the baseline
            hist.append(value)
            del hist[: max(0, len(hist) - cfg.window)]
        return out

    def _early(self, step: int, row: StepRow) -> list[Finding]:
        """Divergence before the spike rules have their window: a loss that stays above the run's
        first loss (a healthy run's loss only falls from there) or a gradient norm that stays far
        above its smallest value, for ``early_steps`` steps in a row."""
        cfg, e = self.config, self.early
        out: list[Finding] = []
        if row.loss is not None and math.isfinite(row.loss) and len(self.loss_hist) < cfg.warmup_steps:
            first = e.setdefault("first_loss", row.loss)
            over = row.loss > first * (1 + cfg.early_loss_rise) if first > 0 else row.loss > first + cfg.early_loss_rise
            e["loss_run"] = e.get("loss_run", 0.0) + 1 if over else 0.0
            if e["loss_run"] == cfg.early_steps and self._cool("loss_divergence", step):
                onset = step - cfg.early_steps + 1
                out.append(Finding(
                    rule=Rule.LOSS_DIVERGENCE, severity=Severity.CRITICAL, step=step, onset_step=onset,
                    explanation=(f"The loss rose from its first value {first:.4g} to {row.loss:.4g} and stayed "
                                 f"{cfg.early_loss_rise:.0%}+ above it for {cfg.early_steps} steps: training diverges "
                                 "from the start (a learning rate too high, or bad data)."),
                    evidence={"value": row.loss, "first": first, "steps": cfg.early_steps}))
        if row.grad_norm is not None and math.isfinite(row.grad_norm) and len(self.grad_hist) < cfg.warmup_steps:
            low = min(e.get("grad_min", row.grad_norm), row.grad_norm)
            e["grad_min"] = low
            over = row.grad_norm > cfg.early_grad_factor * low
            e["grad_run"] = e.get("grad_run", 0.0) + 1 if over else 0.0
            if e["grad_run"] == cfg.early_steps and self._cool("grad_divergence", step):
                out.append(Finding(
                    rule=Rule.GRAD_DIVERGENCE, severity=Severity.CRITICAL, step=step,
                    onset_step=step - cfg.early_steps + 1,
                    explanation=(f"The gradient norm reached {row.grad_norm:.4g}, {row.grad_norm / max(low, 1e-30):.0f}x "
                                 f"its smallest value so far ({low:.3g}), for {cfg.early_steps} steps in a row: "
                                 "the optimisation is blowing up."),
                    evidence={"value": row.grad_norm, "min": low, "steps": cfg.early_steps}))
        return out

    def _modules(self, idx: np.ndarray[Any, Any]) -> tuple[str, ...]:
        return tuple(sorted({self.tensors[i].module for i in idx.tolist()}))

    def _names(self, idx: np.ndarray[Any, Any], limit: int = 20) -> list[str]:
        return [self.tensors[i].name for i in idx[:limit].tolist()]

    def _inf_amax(self, steps: np.ndarray[Any, Any], amax: np.ndarray[Any, Any]) -> list[Finding]:
        out = []
        for row, idx in self._fresh_events("inf_amax", steps, np.isinf(amax)):
            step = int(steps[row])
            names = self._names(idx, 10)
            out.append(Finding(rule=Rule.INF_AMAX, severity=Severity.CRITICAL, step=step, onset_step=step,
                               modules=self._modules(idx),
                               explanation=(f"{idx.size} tensor(s) recorded an infinite amax at step {step} "
                                            f"(e.g. {names[0]}), which freezes their scale for the whole amax history."),
                               evidence={"tensors": names, "count": int(idx.size)}))
        return out

    def _saturation(self, steps: np.ndarray[Any, Any], ratios: np.ndarray[Any, Any]) -> list[Finding]:
        cfg = self.config
        clean = np.nan_to_num(ratios, nan=0.0, posinf=np.inf)
        runs = rules.consecutive(self.sat_run, clean > self.threshold[None, :])  # (steps, tensors)
        self.sat_run = runs[-1]
        out = []
        for row, idx in self._fresh_events("saturation", steps, runs >= cfg.saturation_steps):
            step, ratio = int(steps[row]), ratios[row]
            worst = idx[np.argmax(ratio[idx])]
            severity = Severity.CRITICAL if ratio[worst] > 16 * self.threshold[worst] else Severity.WARNING
            out.append(Finding(
                rule=Rule.SATURATION, severity=severity, step=step, onset_step=step - cfg.saturation_steps + 1,
                modules=self._modules(idx),
                explanation=(f"{idx.size} FP8 tensor(s) clipped for {cfg.saturation_steps}+ steps in a row; the "
                             f"worst, {self.tensors[worst].name}, had amax x scale at {ratio[worst]:.3g}x the FP8 "
                             "maximum."),
                evidence={"tensors": self._names(idx), "ratios": [float(ratio[i]) for i in idx[:20].tolist()],
                          "count": int(idx.size)}))
        # One step far over the FP8 maximum is a finding at that step (routine overshoots are
        # 1.0-1.2 forward and up to ~4 backward: the bounds sit well above them).
        for row, idx in self._fresh_events("saturation_spike", steps, clean > self.spike_bound[None, :]):
            step, ratio = int(steps[row]), ratios[row]
            worst = idx[np.argmax(ratio[idx])]
            out.append(Finding(
                rule=Rule.SATURATION_SPIKE, severity=Severity.WARNING, step=step, onset_step=step,
                modules=self._modules(idx),
                explanation=(f"At step {step} {idx.size} FP8 tensor(s) saturated far beyond routine: "
                             f"{self.tensors[worst].name} had amax x scale at {ratio[worst]:.3g}x the FP8 maximum "
                             "(an outlier; delayed scaling clips it until its scale catches up)."),
                evidence={"tensors": self._names(idx), "ratios": [float(ratio[i]) for i in idx[:20].tolist()],
                          "count": int(idx.size)}))
        return out

    def _growth(self, steps: np.ndarray[Any, Any], amaxes: np.ndarray[Any, Any]) -> list[Finding]:
        cfg = self.config
        limit = math.log2(cfg.amax_growth_factor)
        # Only steps that measured an amax count: a module in BF16 records none, and its stale
        # averages must not keep "growing" (nor keep blocking its re-promotion); it starts a
        # fresh baseline when it comes back.
        fast, slow, seen = rules.amax_growth_steps(self.fast, self.slow, self.seen, amaxes)
        self._seen_steps = seen  # per step: the ramp and stale-scale rules wait for the same warm-up
        growth_all = fast - slow
        measured = np.isfinite(amaxes) & (amaxes > 0)
        runs = rules.consecutive(self.growth_run, (growth_all > limit) & (seen >= cfg.amax_growth_warmup) & measured)
        self.fast, self.slow, self.seen, self.growth_run = fast[-1], slow[-1], seen[-1], runs[-1]
        out = []
        for row, idx in self._fresh_events("amax_growth", steps, runs >= cfg.amax_growth_steps):
            step, growth = int(steps[row]), growth_all[row]
            worst = idx[np.argmax(growth[idx])]
            out.append(Finding(
                rule=Rule.AMAX_GROWTH, severity=Severity.WARNING, step=step,
                onset_step=step - cfg.amax_growth_steps + 1, modules=self._modules(idx),
                explanation=(f"The amax of {idx.size} tensor(s) jumped and stays up (outlier amplification): "
                             f"{self.tensors[worst].name} runs {2 ** float(growth[worst]):.1f}x above its long-run "
                             "level."),
                evidence={"tensors": self._names(idx), "growth_x": [float(2 ** growth[i]) for i in idx[:20].tolist()],
                          "count": int(idx.size)}))
        return out

    def _ramp(self, steps: np.ndarray[Any, Any], amaxes: np.ndarray[Any, Any]) -> list[Finding]:
        """A steady multiplicative climb (a few % per step): the amax rises on most steps and its
        average step is at least ``ramp_min_step`` (log2), for ``ramp_steps`` steps in a row."""
        cfg = self.config
        last, drift, rising = rules.ramp_steps(self.last_log, self.drift, self.rising, amaxes, alpha=cfg.ramp_alpha)
        ok = (drift > math.log2(1 + cfg.ramp_min_step)) & (rising > cfg.ramp_rising) & \
            (self._seen_steps >= cfg.amax_growth_warmup)
        runs = rules.consecutive(self.ramp_run, ok)
        self.last_log, self.drift, self.rising, self.ramp_run = last[-1], drift[-1], rising[-1], runs[-1]
        out = []
        for row, idx in self._fresh_events("amax_ramp", steps, runs >= cfg.ramp_steps):
            step = int(steps[row])
            per_step = 2 ** drift[row] - 1
            worst = idx[np.argmax(per_step[idx])]
            out.append(Finding(
                rule=Rule.AMAX_RAMP, severity=Severity.WARNING, step=step, onset_step=step - cfg.ramp_steps + 1,
                modules=self._modules(idx),
                explanation=(f"The amax of {idx.size} tensor(s) climbs steadily: {self.tensors[worst].name} grows "
                             f"about {per_step[worst]:.1%} per step (a gradual outlier; FP8 range runs out if it "
                             "goes on)."),
                evidence={"tensors": self._names(idx),
                          "growth_per_step": [float(per_step[i]) for i in idx[:20].tolist()], "count": int(idx.size)}))
        return out

    def _stale(self, steps: np.ndarray[Any, Any], amax: np.ndarray[Any, Any],
               hist_max: np.ndarray[Any, Any]) -> list[Finding]:
        """A delayed-scaling scale pinned by an outlier still in the amax history: the history's
        maximum dwarfs every recent amax, so ordinary values are cast far below the FP8 range."""
        cfg = self.config
        with np.errstate(invalid="ignore", over="ignore"):
            measured = np.isfinite(amax) & (amax > 0) & np.isfinite(hist_max)
            pinned = measured & (hist_max > cfg.stale_scale_factor * amax) & \
                (self._seen_steps >= cfg.amax_growth_warmup)
        runs = rules.consecutive(self.stale_run, pinned)  # an unmeasured step (BF16) ends the episode
        self.stale_run = runs[-1]
        since = self._pinned_since(steps, hist_max)
        out = []
        for row, idx in self._fresh_events("stale_scale", steps, runs >= cfg.stale_scale_steps):
            step = int(steps[row])
            ratio = hist_max[row, idx] / amax[row, idx]
            worst = idx[int(np.argmax(ratio))]
            # The episode began when the outlier that pins the scale entered the history, not when
            # the rule's count ran out: so the policy can tell the after-effect of a blown-up update
            # (the outlier came after a loss event) from a cause, however long the history holds it.
            pinned_at = since[row, idx]
            onset = step - cfg.stale_scale_steps + 1
            if np.isfinite(pinned_at).any():
                onset = min(onset, int(np.nanmin(pinned_at)))
            out.append(Finding(
                rule=Rule.STALE_SCALE, severity=Severity.WARNING, step=step,
                onset_step=onset, modules=self._modules(idx),
                explanation=(f"The FP8 scale of {idx.size} tensor(s) is pinned by a past outlier: for "
                             f"{cfg.stale_scale_steps}+ steps the amax history held {float(ratio.max()):.3g}x the "
                             f"current amax of {self.tensors[worst].name}, so its ordinary values are cast far below "
                             "the FP8 range (precision lost, values flushed to zero) until the outlier leaves the "
                             "history."),
                evidence={"tensors": self._names(idx), "history_over_amax": [float(r) for r in ratio[:20].tolist()],
                          "count": int(idx.size)}))
        return out

    def _pinned_since(self, steps: np.ndarray[Any, Any], hist_max: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Per step and tensor: the step at which ``amax_history_max`` took its current value (the
        step its outlier was recorded; NaN before the tensor was seen), step by step whatever the
        batching."""
        last, since = self.hist_last, self.hist_since
        if hist_max.dtype == np.float32 and np.isfinite(hist_max).all():
            # Every value finite (the common case): a tensor's value changed at a step iff it
            # differs from the step before's, so the step-by-step walk below is one scan.
            h = hist_max
            changed = h != np.concatenate([last[None, :], h[:-1]])
            rows = np.maximum.accumulate(np.where(changed, np.arange(h.shape[0])[:, None], -1), axis=0)
            at = np.asarray(steps, dtype=np.float64)[np.maximum(rows, 0)]
            out_fast: np.ndarray[Any, Any] = np.where(rows >= 0, at, since[None, :])
            self.hist_last, self.hist_since = h[-1].copy(), out_fast[-1].copy()
            return out_fast
        out = np.empty(hist_max.shape, dtype=np.float64)
        for t in range(hist_max.shape[0]):
            h = hist_max[t]
            changed = np.isfinite(h) & (h != last)
            since = np.where(changed, float(steps[t]), since)
            last = np.where(np.isfinite(h), h, last).astype(np.float32)
            out[t] = since
        self.hist_last, self.hist_since = last, since
        return out

    def _underflow(self, step: int, under: np.ndarray[Any, Any]) -> list[Finding]:
        cfg = self.config
        base = self.under_base
        fresh = base < 0
        high = ~fresh & (under > cfg.underflow_growth_factor * base + cfg.underflow_min)
        rewound = self.under_since > step  # a rollback rewound the steps: runs of the abandoned timeline end
        if rewound.any():
            self.under_run = np.where(rewound, 0, self.under_run)
        self.under_run = rules.consecutive(self.under_run, high)
        self.under_since = np.where(high, np.where(self.under_run == 1, float(step), self.under_since), np.nan)
        self.under_base = np.where(fresh, under, np.where(high, base, base + 0.1 * (under - base)))
        idx = np.flatnonzero(self.under_run >= cfg.underflow_checks)
        if idx.size == 0 or not self._cool("underflow_growth", step):
            return []
        worst = idx[np.argmax(under[idx])]
        # Dated from the check that began the run: raised again after the cooldown, a standing
        # condition keeps its onset (a new onset at each raise would take the known-good mark from
        # every checkpoint near it). With several tensors, the latest start: a tensor whose run is
        # new makes the finding as new as it.
        since = self.under_since[idx]
        onset = min(step, int(np.nanmax(since))) if np.isfinite(since).all() else step
        return [Finding(
            rule=Rule.UNDERFLOW_GROWTH, severity=Severity.WARNING, step=step, onset_step=onset,
            modules=self._modules(idx),
            explanation=(f"Values flushed to zero grew in {idx.size} tensor(s); {self.tensors[worst].name} lost "
                         f"{under[worst]:.0f} nonzero values, {under[worst] / max(base[worst], 1):.0f}x its baseline."),
            evidence={"tensors": self._names(idx), "underflows": [float(under[i]) for i in idx[:20].tolist()],
                      "count": int(idx.size)})]


_ARRAYS = ("sat_run", "fast", "slow", "seen", "growth_run", "last_log", "drift", "rising", "ramp_run", "last_scale",
           "under_base", "under_run", "under_since", "stale_run", "hist_last", "hist_since")


def _pack(a: np.ndarray[Any, Any]) -> dict[str, str]:
    return {"dtype": a.dtype.str, "b64": base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")}


def _arr(values: Any, n: int, dtype: Any, fill: float = 0.0) -> np.ndarray[Any, Any]:
    """A per-tensor state array, padded for tensors added since the state was saved."""
    out = np.full(n, fill, dtype=dtype)
    if isinstance(values, dict):
        src = np.frombuffer(base64.b64decode(values["b64"]), dtype=values["dtype"]).astype(dtype)[:n]
        out[: src.size] = src
    elif values:
        src = np.asarray(values, dtype=dtype)[:n]
        out[: src.size] = src
    return out
