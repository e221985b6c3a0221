"""Paired ratios of side-by-side timings, with a distribution-free interval and a verdict.

The GPU benches time a mode and its baseline in alternating blocks of steps, one process, and
report the ratio of medians and the median of the per-round ratios. On a host-bound step the
rounds spread far more than the effect (the 48-layer model's plain blocks ranged 214-316 ms in one
run, against a 0.5 % target), and a median alone cannot say whether a target was missed or not
resolved. The interval here says it: the median's confidence interval from order statistics (the
number of rounds below the true median is Binomial(n, 1/2) whatever the distribution), so a target
is **met** when the whole interval lies at or under it, **not met** when the whole interval lies
over it, and **unresolved** otherwise: more rounds or a quieter host would tell. It assumes the
rounds' ratios are independent draws, which pairing each block with the baseline block of the same
round approaches (a drift of the host slower than a round cancels within the pair; the blocks of a
round are at most a few blocks apart); it does not hold for a drift within one round.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["COUNTS_EVERY_10", "COUNTS_EVERY_STEP", "MONITOR", "median_interval", "paired_ratios", "verdict"]

MONITOR = 1.005
"""#14's target for the monitor's step over plain FP8 (its own grad norm included)."""
COUNTS_EVERY_10 = 1.01
"""#14's target for exact counts every 10th step."""
COUNTS_EVERY_STEP = 1.15
"""#14's target for exact counts every step."""


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float] | None:
    """(low, high, coverage): the median's interval ``[x_(k), x_(n+1-k)]`` of the sorted values
    with the largest ``k`` whose coverage ``1 - 2 P(Bin(n, 1/2) < k)`` is at least ``confidence``;
    None when even the full range covers less (under six values at 95 %)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1, got {confidence}")
    xs = sorted(values)
    n = len(xs)
    best: tuple[float, float, float] | None = None
    tail = 0.0
    for k in range(1, n // 2 + 1):
        tail += math.comb(n, k - 1) / 2**n  # P(Bin(n, 1/2) < k)
        coverage = 1 - 2 * tail
        if coverage < confidence:
            break
        best = (xs[k - 1], xs[n - k], coverage)
    return best


def verdict(low: float, high: float, target: float) -> str:
    """``met`` (the interval at or under the target), ``not met`` (over it) or ``unresolved``."""
    if high <= target:
        return "met"
    if low > target:
        return "not met"
    return "unresolved"


def paired_ratios(mode_ms: Sequence[float], base_ms: Sequence[float], target: float | None = None,
                  confidence: float = 0.95) -> dict[str, Any]:
    """Per-round ratios of a mode's block time to its baseline's (same round), their median, its
    interval and, with a target ratio, the verdict."""
    ratios = [m / b for m, b in zip(mode_ms, base_ms, strict=True)]
    out: dict[str, Any] = {"paired_ratios": [round(r, 5) for r in ratios], "paired_ratio_median": None,
                           "paired_ratio_interval": None, "target": target, "verdict": None}
    if ratios:
        out["paired_ratio_median"] = round(statistics.median(ratios), 5)
    interval = median_interval(ratios, confidence)
    if interval is not None:
        low, high, coverage = interval
        out["paired_ratio_interval"] = {"low": round(low, 5), "high": round(high, 5), "coverage": round(coverage, 4)}
    if target is not None:  # too few rounds for an interval: unresolved
        out["verdict"] = verdict(interval[0], interval[1], target) if interval is not None else "unresolved"
    return out
