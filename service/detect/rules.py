"""Detection rules: pure functions of (state, new values, thresholds). State is plain data
(lists and numpy arrays the detector serialises), so rules are trivially testable and a
service restart loses nothing."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["Spike", "amax_growth", "amax_growth_block", "consecutive", "robust_spike"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Spike:
    z: float
    median: float
    rise: float
    """(value - median) / |median|"""


def robust_spike(history: Sequence[float], value: float, *, z: float, min_rise: float, warmup: int) -> Spike | None:
    """Median/MAD z-score of ``value`` against the recent finite ``history``.

    Robust to the noise of the loss (MAD ignores the outliers a std would chase) and to
    warm-up (nothing fires before ``warmup`` values). A floor on the scale (0.1% of the
    median) keeps a noise-free plateau from calling every wiggle a spike: the OLMo-core monitor
    guards std ~ 0 the same way.
    """
    if len(history) < max(warmup, 3) or not math.isfinite(value):
        return None
    # statistics.median on a short list beats numpy's per-call overhead by ~10x
    med = statistics.median(history)
    mad = statistics.median([abs(x - med) for x in history])
    scale = 1.4826 * mad + 1e-3 * abs(med) + 1e-12
    score = (value - med) / scale
    rise = (value - med) / (abs(med) + 1e-12)
    if score > z and rise > min_rise:
        return Spike(z=score, median=med, rise=rise)
    return None


def consecutive(run: I64, over: npt.NDArray[np.bool_]) -> I64:
    """Per-tensor count of consecutive steps over a threshold (reset by a step under it).

    ``over`` is (tensors,) for one step or (steps, tensors) for several; the result has the
    same shape (the run length after each step), continuing from ``run``."""
    if over.ndim == 1:
        return np.where(over, run + 1, 0).astype(np.int64)
    steps = np.arange(over.shape[0])[:, None]
    last_reset = np.maximum.accumulate(np.where(~over, steps, -1), axis=0)
    return np.where(last_reset < 0, run[None, :] + steps + 1, steps - last_reset).astype(np.int64)


def amax_growth(fast: F64, slow: F64, seen: I64, amax: F64, *, alpha_fast: float = 0.2,
                alpha_slow: float = 0.01) -> tuple[F64, F64, I64, F64]:
    """Two exponential averages of log2(amax) per tensor; returns (fast, slow, seen, growth).

    ``growth = fast - slow`` in log2 units: a sustained climb of a tensor's amax (Fishman et
    al. 2024's outlier amplification) opens a gap that a one-step outlier cannot. Non-finite
    or zero amax leaves the averages untouched (the inf rule handles inf).
    """
    ok = np.isfinite(amax) & (amax > 0)
    log_amax = np.log2(np.where(ok, amax, 1.0))
    first = ok & (seen == 0)
    fast = np.where(first, log_amax, np.where(ok, fast + alpha_fast * (log_amax - fast), fast))
    slow = np.where(first, log_amax, np.where(ok, slow + alpha_slow * (log_amax - slow), slow))
    seen = seen + ok.astype(np.int64)
    return fast, slow, seen, fast - slow


def amax_growth_block(fast: F64, slow: F64, seen: I64, amax: F64, *, alpha_fast: float = 0.2,
                      alpha_slow: float = 0.01) -> tuple[F64, F64, I64]:
    """:func:`amax_growth` over a (steps, tensors) block at once; returns the per-step
    trajectories of the fast and slow averages and of ``seen``.

    The recurrence y_t = (1 - a m_t) y_{t-1} + a m_t x_t (m_t: finite positive amax) has the
    closed form y_t = P_t (y_0 + sum_k a m_k x_k / P_k) with P_t = prod (1 - a m_j); chunks of
    at most 128 steps keep P_t far from float64 underflow.
    """
    ok = np.isfinite(amax) & (amax > 0)
    log_amax = np.log2(np.where(ok, amax, 1.0))
    seen_traj = seen[None, :] + np.cumsum(ok, axis=0)
    # A tensor's first finite amax initialises both averages (as in amax_growth).
    first = ok & (seen_traj == 1) & (np.cumsum(ok, axis=0) == 1) & (seen[None, :] == 0)
    out_fast = np.empty_like(log_amax)
    out_slow = np.empty_like(log_amax)
    for lo in range(0, amax.shape[0], 128):
        hi = min(lo + 128, amax.shape[0])
        for y0, a, out in ((fast, alpha_fast, out_fast), (slow, alpha_slow, out_slow)):
            m = ok[lo:hi].astype(np.float64)
            w = np.where(first[lo:hi], 1.0, a * m)  # weight 1 on the first value: y = x there
            p = np.cumprod(1.0 - w, axis=0)
            safe = np.where(p == 0.0, 1.0, p)
            contrib = np.cumsum(w * log_amax[lo:hi] / safe, axis=0)
            traj = np.where(p == 0.0, 0.0, p * y0[None, :]) + np.where(p == 0.0, 0.0, p * contrib)
            # where p hit exactly 0 (the first-value reset), restart from that value onwards
            reset = np.maximum.accumulate(np.where(p == 0.0, np.arange(hi - lo)[:, None], -1), axis=0)
            if (reset >= 0).any():
                traj = _restarted(traj, w, log_amax[lo:hi], reset)
            out[lo:hi] = traj
        fast, slow = out_fast[hi - 1], out_slow[hi - 1]
    return out_fast, out_slow, seen_traj.astype(np.int64)


def _restarted(traj: F64, w: F64, x: F64, reset: I64) -> F64:
    """Recompute columns whose product reached 0 (a first value) step by step; rare (a tensor's
    very first amax), so a plain loop is fine."""
    cols = np.flatnonzero((reset >= 0).any(axis=0))
    for c in cols.tolist():
        y = 0.0
        for t in range(traj.shape[0]):
            y = (1.0 - w[t, c]) * y + w[t, c] * x[t, c]
            traj[t, c] = y
    return traj
