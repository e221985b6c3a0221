"""Detection rules: pure functions of (state, new values, thresholds). State is plain data
(lists and numpy arrays the detector serialises), so rules are trivially testable and a
service restart loses nothing."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Spike", "amax_growth", "amax_growth_block", "amax_growth_steps", "consecutive", "ramp_steps", "robust_spike"]

F64 = npt.NDArray[np.float64]
F32 = npt.NDArray[np.float32]
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
    if value - med <= min_rise * (abs(med) + 1e-12):
        return None  # not even the minimum rise: skip the MAD (the common case, every step)
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
    if not over.any():  # a healthy block: every run is reset (what the general form computes)
        return np.zeros(over.shape, dtype=np.int64)
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


def amax_growth_block(fast: npt.NDArray[np.floating[Any]], slow: npt.NDArray[np.floating[Any]], seen: I64,
                      amax: npt.NDArray[np.floating[Any]], *, alpha_fast: float = 0.2,
                      alpha_slow: float = 0.01) -> tuple[F32, F32, I64]:
    """:func:`amax_growth` over a (steps, tensors) block at once; returns the per-step
    trajectories of the fast and slow averages and of ``seen`` (equal to the step-by-step
    rule wherever the amax was measured, and in the final state).

    The recurrence y_t = (1 - a m_t) y_{t-1} + a m_t x_t (m_t: finite positive amax) has the
    closed form y_t = P_t (y_0 + sum_k a m_k x_k / P_k) with P_t = prod (1 - a m_j); chunks of
    at most 128 steps keep P_t far from float64 underflow. A tensor seen for the first time
    starts both averages at its first value, which the recurrence then leaves unchanged.
    """
    amax = amax.astype(np.float32, copy=False)
    ok = np.isfinite(amax) & (amax > 0)
    # float32 halves the work; log2 amax lives in [-150, 128] and the thresholds are whole
    # powers of two, so 7 significant digits are plenty.
    log_amax = np.log2(np.where(ok, amax, 1.0)).astype(np.float32)
    counts = np.cumsum(ok, axis=0)
    fresh = (seen == 0) & (counts[-1] > 0)
    if fresh.any():
        first = log_amax[np.argmax(ok, axis=0), np.arange(amax.shape[1])]
        fast = np.where(fresh, first, fast)
        slow = np.where(fresh, first, slow)
    m = ok.astype(np.float32)
    fast, slow = fast.astype(np.float32), slow.astype(np.float32)
    out_fast = np.empty_like(log_amax)
    out_slow = np.empty_like(log_amax)
    for lo in range(0, amax.shape[0], 128):
        hi = min(lo + 128, amax.shape[0])
        for y0, a, out in ((fast, alpha_fast, out_fast), (slow, alpha_slow, out_slow)):
            w = np.float32(a) * m[lo:hi]
            p = np.cumprod(np.float32(1.0) - w, axis=0)
            out[lo:hi] = p * (y0[None, :] + np.cumsum(w * log_amax[lo:hi] / p, axis=0))
        fast, slow = out_fast[hi - 1], out_slow[hi - 1]
    return out_fast, out_slow, (seen[None, :] + counts).astype(np.int64)


def amax_growth_steps(fast: npt.NDArray[np.floating[Any]], slow: npt.NDArray[np.floating[Any]], seen: I64,
                      amax: npt.NDArray[np.floating[Any]], *, alpha_fast: float = 0.2,
                      alpha_slow: float = 0.01) -> tuple[F32, F32, I64]:
    """:func:`amax_growth` over a (steps, tensors) block, one step at a time in float32: the
    same arithmetic whatever the batch boundaries, so findings never depend on how telemetry was
    batched. Returns the per-step trajectories of the fast and slow averages and of ``seen``.

    A step that measured no amax (zero or non-finite: a module in BF16) leaves the averages as
    they are and resets ``seen``: when the tensor is measured again its averages restart from
    that value, so growth is judged against its own FP8 period.
    """
    amax = amax.astype(np.float32, copy=False)
    ok = np.isfinite(amax) & (amax > 0)
    log_amax = np.log2(np.where(ok, amax, np.float32(1.0))).astype(np.float32)
    af, asl = np.float32(alpha_fast), np.float32(alpha_slow)
    f, s, n = fast.astype(np.float32), slow.astype(np.float32), seen.astype(np.int64)
    out_f = np.empty_like(log_amax)
    out_s = np.empty_like(log_amax)
    if ok.all() and (n > 0).all():
        # Every tensor measured at every step and seen before (a healthy FP8 block): the same
        # float32 arithmetic as below without the branches, a third of the numpy calls.
        for t in range(amax.shape[0]):
            x = log_amax[t]
            f = out_f[t] = f + af * (x - f)
            s = out_s[t] = s + asl * (x - s)
        return out_f, out_s, n[None, :] + np.arange(1, amax.shape[0] + 1, dtype=np.int64)[:, None]
    out_n = np.empty(amax.shape, dtype=np.int64)
    for t in range(amax.shape[0]):
        x, m = log_amax[t], ok[t]
        start = m & (n == 0)
        f = np.where(start, x, np.where(m, f + af * (x - f), f))
        s = np.where(start, x, np.where(m, s + asl * (x - s), s))
        n = np.where(m, n + 1, 0)
        out_f[t], out_s[t], out_n[t] = f, s, n
    return out_f, out_s, out_n


def ramp_steps(last_log: F32, drift: F32, rising: F32, amax: npt.NDArray[np.floating[Any]], *,
               alpha: float) -> tuple[F32, F32, F32]:
    """A steady climb of a tensor's amax, one step at a time: exponential averages (weight
    ``alpha``) of the step-to-step change of log2(amax) (``drift``) and of whether it rose
    (``rising``). A multiplicative ramp of a few % per step drives both up within ~1/alpha steps;
    noise keeps ``rising`` near one half. Unmeasured steps leave the averages as they are and
    restart the chain. Returns per-step trajectories of (last log2 amax, drift, rising).
    """
    amax = amax.astype(np.float32, copy=False)
    ok = np.isfinite(amax) & (amax > 0)
    log_amax = np.log2(np.where(ok, amax, np.float32(1.0))).astype(np.float32)
    a = np.float32(alpha)
    last, d, r = last_log.astype(np.float32), drift.astype(np.float32), rising.astype(np.float32)
    out_last, out_d, out_r = (np.empty_like(log_amax) for _ in range(3))
    if ok.all() and np.isfinite(last).all():
        # Every tensor measured now and at the step before (a healthy FP8 block): the same float32
        # arithmetic as below without the branches.
        prev = np.concatenate([last[None, :], log_amax[:-1]])
        delta = log_amax - prev
        up = (delta > 0).astype(np.float32)
        for t in range(amax.shape[0]):
            d = out_d[t] = d + a * (delta[t] - d)
            r = out_r[t] = r + a * (up[t] - r)
        out_last[:] = log_amax
        return out_last, out_d, out_r
    for t in range(amax.shape[0]):
        x, m = log_amax[t], ok[t]
        step_ok = m & np.isfinite(last)
        delta = np.where(step_ok, x - last, np.float32(0.0))
        d = np.where(step_ok, d + a * (delta - d), d)
        r = np.where(step_ok, r + a * ((delta > 0).astype(np.float32) - r), r)
        last = np.where(m, x, np.float32(np.nan))
        out_last[t], out_d[t], out_r[t] = last, d, r
    return out_last, out_d, out_r
