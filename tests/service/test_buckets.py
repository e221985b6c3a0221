"""Extreme-preserving downsampling."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fp8guard.service.store import buckets


@pytest.mark.parametrize(("start", "end", "width"), [(0, 99, 2000), (0, 99_999, 2000), (5, 12_345, 7),
                                                     (1_000, 1_000, 1), (0, 10**9, 3000), (17, 50_000, 999)])
def test_plan_never_exceeds_width_and_aligns(start: int, end: int, width: int) -> None:
    plan = buckets.plan_buckets(start, end, width)
    assert 1 <= plan.columns <= width
    assert plan.bucket % plan.level == 0 and plan.level in buckets.LEVELS
    assert plan.first * plan.bucket <= start and (plan.first + plan.columns) * plan.bucket > end
    assert plan.columns >= min(width, end - start + 1) // 2 - 1  # at most 2x coarser than asked


def test_plan_rejects_bad_ranges() -> None:
    with pytest.raises(ValueError, match="width"):
        buckets.plan_buckets(0, 10, 0)
    with pytest.raises(ValueError, match="before"):
        buckets.plan_buckets(10, 0, 5)


def test_rollups_keep_single_step_spike_at_every_level() -> None:
    steps = np.arange(0, 20_000, dtype=np.int64)
    values = np.ones((steps.size, 3), dtype=np.float32)
    values[12_345, 1] = 1e30
    values[777, 2] = -5.0
    for level, (blocks, mins, maxs) in buckets.rollups(steps, values).items():
        assert maxs[12_345 // level - blocks[0], 1] == np.float32(1e30)
        assert mins[777 // level - blocks[0], 2] == -5.0
        assert np.all(maxs[:, 0] == 1.0)


def test_group_minmax_propagates_nan_and_handles_ragged_groups() -> None:
    groups = np.array([0, 0, 0, 3, 7, 7], dtype=np.int64)
    vals = np.array([[1.0], [np.nan], [2.0], [4.0], [5.0], [-np.inf]], dtype=np.float32)
    g, lo, hi = buckets.group_minmax(vals, vals, groups)
    assert g.tolist() == [0, 3, 7]
    assert math.isnan(lo[0, 0]) and math.isnan(hi[0, 0])
    assert lo[1, 0] == hi[1, 0] == 4.0 and lo[2, 0] == -np.inf and hi[2, 0] == 5.0


def test_reduce_into_columns_marks_missing_as_empty() -> None:
    plan = buckets.plan_buckets(0, 9, 10)
    out_min, out_max = buckets.empty_planes(2, plan.columns)
    present = np.zeros(plan.columns, dtype=bool)
    mins = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    buckets.reduce_into_columns(plan, np.array([2, 5]), mins, mins, out_min, out_max, present)
    assert present.tolist() == [False, False, True, False, False, True] + [False] * 4
    assert out_min[1, 5] == 4.0 and out_min[0, 0] > out_max[0, 0]  # empty cell: +inf > -inf


def test_unpack_rows_pads_short_rows_with_no_data() -> None:
    short = np.array([1.0, 2.0], dtype="<f4").tobytes()
    long = np.array([3.0, 4.0, 5.0], dtype="<f4").tobytes()
    mins, maxs = buckets.unpack_rows([short, long], level=1, num_tensors=3)
    assert mins[0, 2] == np.inf and maxs[0, 2] == -np.inf and mins[1, 2] == 5.0
