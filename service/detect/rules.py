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

__all__ = ["Spike", "amax_growth", "consecutive", "robust_spike"]

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
