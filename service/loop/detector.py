"""``Detector``: runs the rules over one rank's telemetry, step by step, and keeps their state
in a JSON-able dict (stored per run and rank, so a service restart forgets nothing)."""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fp8guard.service.domain import Finding, StatBlock, StepRow
from fp8guard.service.kinds import Rule, Severity
from fp8guard.service.loop import rules
from fp8guard.service.loop.config import GuardConfig

__all__ = ["Detector", "TensorMeta"]


@dataclass(frozen=True, slots=True)
class TensorMeta:
    name: str
    module: str
    backward: bool
    """E5M2 gradients get the backward saturation threshold."""


class Detector:
    def __init__(self, config: GuardConfig, tensors: Sequence[TensorMeta], state: dict[str, Any] | None = None) -> None:
        self.config = config
        self.tensors = list(tensors)
        n = len(self.tensors)
        s = state or {}
        self.loss_hist: list[float] = [float(v) for v in s.get("loss_hist", [])]
        self.grad_hist: list[float] = [float(v) for v in s.get("grad_hist", [])]
        self.last_fired: dict[str, int] = dict(s.get("last_fired", {}))
        self.sat_run = _arr(s.get("sat_run"), n, np.int64)  # consecutive steps over the saturation threshold
        self.fast = _arr(s.get("fast"), n, np.float32)
        self.slow = _arr(s.get("slow"), n, np.float32)
        self.seen = _arr(s.get("seen"), n, np.int64)
        self.growth_run = _arr(s.get("growth_run"), n, np.int64)
        self.under_base = _arr(s.get("under_base"), n, np.float32, fill=-1.0)
        self.under_run = _arr(s.get("under_run"), n, np.int64)
        self.stale_run = _arr(s.get("stale_run"), n, np.int64)  # consecutive steps with a pinned scale
        self.threshold = np.array([config.saturation_bwd if t.backward else config.saturation_fwd
                                   for t in self.tensors], dtype=np.float64)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able; per-tensor arrays as base64 (a 1,000-tensor state as number lists cost
        milliseconds of JSON per batch)."""
        return {
            "loss_hist": self.loss_hist, "grad_hist": self.grad_hist, "last_fired": self.last_fired,
            **{name: _pack(getattr(self, name)) for name in _ARRAYS},
        }

    # -- feeding ------------------------------------------------------------------------------

    def observe(self, steps: Sequence[StepRow], blocks: Sequence[StatBlock]) -> list[Finding]:
        """Run every rule over the batch's steps in order; return what fired."""
        findings: list[Finding] = []
        for row in sorted(steps, key=lambda r: r.step):
            findings += self._scalars(row.step, row)
        n = len(self.tensors)
        for block in blocks:
            if n == 0 or block.values.shape[2] < n:
                continue
            for k, name in enumerate(block.stats):
                # float32 as stored: the rules compare against thresholds, converting 3 x 100k
                # values to float64 per batch only cost time
                values = block.values[:, k, :n]
                if name == "amax":
                    findings += self._inf_amax(block.steps, values)
                    findings += self._growth(block.steps, values)
                elif name == "saturation":
                    findings += self._saturation(block.steps, values)
                elif name == "underflows":
                    for i, step in enumerate(block.steps.tolist()):
                        findings += self._underflow(step, values[i])
            if "amax" in block.stats and "amax_history_max" in block.stats:
                findings += self._stale(block.steps, block.values[:, block.stats.index("amax"), :n],
                                        block.values[:, block.stats.index("amax_history_max"), :n])
        return findings

    def _cool(self, key: str, step: int) -> bool:
        last = self.last_fired.get(key)
        if last is not None and step - last < self.config.cooldown_steps and step >= last:
            return False
        self.last_fired[key] = step
        return True

    def _first_fresh(self, rule: str, steps: np.ndarray[Any, Any],
                     hits: np.ndarray[Any, Any]) -> tuple[int, np.ndarray[Any, Any]] | None:
        """The first step with hit tensors whose module is not cooling down for ``rule``, and
        those tensors; marks their modules as fired. Cooling is per module: a second module
        crossing the line a few steps after the first is its own finding, not swallowed by the
        first one's quiet period."""
        cd = self.config.cooldown_steps
        with np.errstate(invalid="ignore"):
            last = np.array([self.last_fired.get(f"{rule}:{t.module}", np.nan) for t in self.tensors],
                            dtype=np.float64)[None, :]
            at = steps.astype(np.float64)[:, None]
            ready = np.isnan(last) | (at - last >= cd) | (at < last)  # at < last: a rollback rewound the steps
        fresh = hits & ready
        rows = np.flatnonzero(fresh.any(axis=1))
        if rows.size == 0:
            return None
        row = int(rows[0])
        idx = np.flatnonzero(fresh[row])
        for m in {self.tensors[i].module for i in idx.tolist()}:
            self.last_fired[f"{rule}:{m}"] = int(steps[row])
        return row, idx

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

    def _modules(self, idx: np.ndarray[Any, Any]) -> tuple[str, ...]:
        return tuple(sorted({self.tensors[i].module for i in idx.tolist()}))

    def _inf_amax(self, steps: np.ndarray[Any, Any], amax: np.ndarray[Any, Any]) -> list[Finding]:
        rows = np.flatnonzero(np.isinf(amax).any(axis=1))
        if rows.size == 0:
            return []
        step = int(steps[rows[0]])
        idx = np.flatnonzero(np.isinf(amax[rows[0]]))
        if not self._cool("inf_amax", step):
            return []
        names = [self.tensors[i].name for i in idx[:10].tolist()]
        return [Finding(rule=Rule.INF_AMAX, severity=Severity.CRITICAL, step=step, onset_step=step,
                        modules=self._modules(idx),
                        explanation=(f"{idx.size} tensor(s) recorded an infinite amax at step {step} "
                                     f"(e.g. {names[0]}), which freezes their scale for the whole amax history."),
                        evidence={"tensors": names, "count": int(idx.size)})]

    def _saturation(self, steps: np.ndarray[Any, Any], ratios: np.ndarray[Any, Any]) -> list[Finding]:
        cfg = self.config
        over = np.nan_to_num(ratios, nan=0.0, posinf=np.inf) > self.threshold[None, :]
        runs = rules.consecutive(self.sat_run, over)  # (steps, tensors)
        self.sat_run = runs[-1]
        first = self._first_fresh("saturation", steps, runs >= cfg.saturation_steps)
        if first is None:
            return []
        row, idx = first
        step, ratio = int(steps[row]), ratios[row]
        worst = idx[np.argmax(ratio[idx])]
        severity = Severity.CRITICAL if ratio[worst] > 16 * self.threshold[worst] else Severity.WARNING
        return [Finding(
            rule=Rule.SATURATION, severity=severity, step=step, onset_step=step - cfg.saturation_steps + 1,
            modules=self._modules(idx),
            explanation=(f"{idx.size} FP8 tensor(s) clipped for {cfg.saturation_steps}+ steps in a row; the worst, "
                         f"{self.tensors[worst].name}, had amax x scale at {ratio[worst]:.3g}x the FP8 maximum."),
            evidence={"tensors": [self.tensors[i].name for i in idx[:20].tolist()],
                      "ratios": [float(ratio[i]) for i in idx[:20].tolist()], "count": int(idx.size)})]

    def _growth(self, steps: np.ndarray[Any, Any], amaxes: np.ndarray[Any, Any]) -> list[Finding]:
        cfg = self.config
        limit = math.log2(cfg.amax_growth_factor)
        fast, slow, seen = rules.amax_growth_block(self.fast, self.slow, self.seen, amaxes)
        growth_all = fast - slow
        # Only steps that measured an amax count: a module in BF16 records none, and its stale
        # averages must not keep "growing" (nor keep blocking its re-promotion).
        measured = np.isfinite(amaxes) & (amaxes > 0)
        runs = rules.consecutive(self.growth_run, (growth_all > limit) & (seen >= cfg.amax_growth_warmup) & measured)
        self.fast, self.slow, self.seen, self.growth_run = fast[-1], slow[-1], seen[-1], runs[-1]
        # A tensor that stopped being measured (its module fell back to BF16) starts a fresh
        # baseline when it comes back: growth is judged against its own FP8 period.
        self.seen = np.where(measured[-1], self.seen, 0)
        first = self._first_fresh("amax_growth", steps, runs >= cfg.amax_growth_steps)
        if first is None:
            return []
        row, idx = first
        step, growth = int(steps[row]), growth_all[row]
        worst = idx[np.argmax(growth[idx])]
        return [Finding(
            rule=Rule.AMAX_GROWTH, severity=Severity.WARNING, step=step, onset_step=step - cfg.amax_growth_steps + 1,
            modules=self._modules(idx),
            explanation=(f"The amax of {idx.size} tensor(s) keeps climbing (outlier amplification): "
                         f"{self.tensors[worst].name} runs {2 ** float(growth[worst]):.1f}x above its long-run level."),
            evidence={"tensors": [self.tensors[i].name for i in idx[:20].tolist()],
                      "growth_x": [float(2 ** growth[i]) for i in idx[:20].tolist()], "count": int(idx.size)})]

    def _stale(self, steps: np.ndarray[Any, Any], amax: np.ndarray[Any, Any],
               hist_max: np.ndarray[Any, Any]) -> list[Finding]:
        """A delayed-scaling scale pinned by an outlier still in the amax history: the history's
        maximum dwarfs every recent amax, so ordinary values are cast far below the FP8 range."""
        cfg = self.config
        with np.errstate(invalid="ignore", over="ignore"):
            measured = np.isfinite(amax) & (amax > 0) & np.isfinite(hist_max)
            pinned = measured & (hist_max > cfg.stale_scale_factor * amax) & (self.seen >= cfg.amax_growth_warmup)
        runs = rules.consecutive(self.stale_run, pinned)  # an unmeasured step (BF16) ends the episode
        self.stale_run = runs[-1]
        first = self._first_fresh("stale_scale", steps, runs >= cfg.stale_scale_steps)
        if first is None:
            return []
        row, idx = first
        step = int(steps[row])
        ratio = hist_max[row, idx] / amax[row, idx]
        worst = idx[int(np.argmax(ratio))]
        return [Finding(
            rule=Rule.STALE_SCALE, severity=Severity.WARNING, step=step, onset_step=step - cfg.stale_scale_steps + 1,
            modules=self._modules(idx),
            explanation=(f"The FP8 scale of {idx.size} tensor(s) is pinned by a past outlier: for "
                         f"{cfg.stale_scale_steps}+ steps the amax history held {float(ratio.max()):.3g}x the current "
                         f"amax of {self.tensors[worst].name}, so its ordinary values are cast far below the FP8 "
                         "range (precision lost, values flushed to zero) until the outlier leaves the history."),
            evidence={"tensors": [self.tensors[i].name for i in idx[:20].tolist()],
                      "history_over_amax": [float(r) for r in ratio[:20].tolist()], "count": int(idx.size)})]

    def _underflow(self, step: int, under: np.ndarray[Any, Any]) -> list[Finding]:
        cfg = self.config
        base = self.under_base
        fresh = base < 0
        high = ~fresh & (under > cfg.underflow_growth_factor * base + cfg.underflow_min)
        self.under_run = rules.consecutive(self.under_run, high)
        self.under_base = np.where(fresh, under, np.where(high, base, base + 0.1 * (under - base)))
        idx = np.flatnonzero(self.under_run >= cfg.underflow_checks)
        if idx.size == 0 or not self._cool("underflow_growth", step):
            return []
        worst = idx[np.argmax(under[idx])]
        return [Finding(
            rule=Rule.UNDERFLOW_GROWTH, severity=Severity.WARNING, step=step, onset_step=step,
            modules=self._modules(idx),
            explanation=(f"Values flushed to zero grew in {idx.size} tensor(s); {self.tensors[worst].name} lost "
                         f"{under[worst]:.0f} nonzero values, {under[worst] / max(base[worst], 1):.0f}x its baseline."),
            evidence={"tensors": [self.tensors[i].name for i in idx[:20].tolist()],
                      "underflows": [float(under[i]) for i in idx[:20].tolist()], "count": int(idx.size)})]


_ARRAYS = ("sat_run", "fast", "slow", "seen", "growth_run", "under_base", "under_run", "stale_run")


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
