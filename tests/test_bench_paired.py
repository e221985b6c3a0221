"""bench/_paired.py: the median's distribution-free interval and the verdict the GPU benches give
a timing target (met, not met, unresolved)."""

from __future__ import annotations

import math
import random

import pytest

from bench._paired import median_interval, paired_ratios, verdict


@pytest.mark.parametrize(("n", "k"), [(6, 1), (10, 2), (16, 4), (20, 6), (40, 14)])
def test_the_interval_is_the_order_statistics_binomial_tables_give(n: int, k: int) -> None:
    low, high, coverage = median_interval(list(range(1, n + 1)))  # type: ignore[misc]
    assert (low, high) == (k, n + 1 - k)
    expected = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n
    assert coverage == pytest.approx(expected) and coverage >= 0.95
    # one order statistic further in covers less than 95 %
    assert 1 - 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n < 0.95


def test_too_few_rounds_give_no_interval_and_no_verdict_but_unresolved() -> None:
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    out = paired_ratios([101.0] * 5, [100.0] * 5, 1.005)
    assert out["paired_ratio_interval"] is None and out["verdict"] == "unresolved"
    with pytest.raises(ValueError, match="confidence"):
        median_interval([1.0] * 10, confidence=1.0)


def test_the_verdict_reads_the_whole_interval() -> None:
    assert verdict(0.998, 1.004, 1.005) == "met"
    assert verdict(1.006, 1.02, 1.005) == "not met"
    assert verdict(0.99, 1.03, 1.005) == "unresolved"


def test_paired_ratios_pair_each_round_with_its_own_baseline() -> None:
    rng = random.Random(0)
    base = [100 + rng.uniform(-30, 30) for _ in range(16)]  # a host whose blocks drift 60 %
    quiet = paired_ratios([b * 1.002 for b in base], base, 1.005)
    assert quiet["verdict"] == "met" and quiet["paired_ratio_median"] == pytest.approx(1.002)
    slow = paired_ratios([b * 1.02 for b in base], base, 1.005)
    assert slow["verdict"] == "not met"
    noisy = paired_ratios([b * rng.uniform(0.97, 1.04) for b in base], base, 1.005)
    assert noisy["verdict"] == "unresolved" and len(noisy["paired_ratios"]) == 16
    assert paired_ratios(base, base)["verdict"] is None  # no target: no verdict


def test_odd_rounds_and_the_verdict_s_boundaries() -> None:
    low, high, _ = median_interval([5.0, 1.0, 4.0, 2.0, 3.0, 7.0, 6.0, 9.0, 8.0])  # type: ignore[misc]
    assert (low, high) == (2.0, 8.0)  # n = 9: k = 2, coverage 1 - 2 * 10 / 512
    assert verdict(0.99, 1.005, 1.005) == "met"  # at the target counts as met
    assert verdict(1.005, 1.01, 1.005) == "unresolved"  # only wholly over it is not met


def test_the_time_bench_settles_every_staggered_mode_and_knows_each_target() -> None:
    from bench._counts_time import settle_steps, target_ratio

    for mode in ("counts_every_10_staggered", "counts_every_10_staggered_batched"):
        assert settle_steps(mode, 2) == 10 and settle_steps(mode, 12) == 12
    assert settle_steps("counts_every_step_batched", 2) == 2
    assert target_ratio("counts_every_step_batched") == 1.15 and target_ratio("counts_every_10_staggered_batched") == 1.01
    assert target_ratio("agent_no_counts") == 1.005 and target_ratio("debug_path_only") is None
