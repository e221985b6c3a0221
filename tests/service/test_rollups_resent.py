"""D5: roll-ups always agree with the raw data, whatever was re-sent, out of order, or by which
process: every zoom level of the heatmap reads what a full recomputation from raw rows reads."""

from __future__ import annotations

import numpy as np
import pytest

from fp8guard.service.domain import RunSpec
from fp8guard.service.ingest.decode import decode_batch
from fp8guard.service.schemas import IngestBatchIn
from fp8guard.service.store import Store, Window
from fp8guard.service.store.buckets import LEVELS
from tests.helpers import STATS, batch, stat_values

N = 4


def _ingest(store: Store, run: str, steps: list[int], vals: np.ndarray, truth: dict[int, np.ndarray], *,
            first: bool = False) -> None:
    result = store.ingest(decode_batch(IngestBatchIn.model_validate(
        batch(run, steps, n_tensors=N, values=vals, define_tensors=first))))
    assert not result.duplicate
    for i, s in enumerate(steps):
        truth[s] = vals[i]


def _check(store: Store, run: str, truth: dict[int, np.ndarray]) -> None:
    """Every stored level against min/max computed here from the latest raw values."""
    steps = np.array(sorted(truth), dtype=np.int64)
    vals = np.stack([truth[int(s)] for s in steps])  # (steps, stats, tensors)
    end = int(steps[-1])
    seen: set[int] = set()
    for width in (end + 1, 2000, 500, 200, 60, 20, 8, 3, 1):
        m = store.tensor_matrix(run, "amax", Window(start=0, end=end, width=width))
        seen.add(m.level)
        for c, first in enumerate(m.column_steps.tolist()):
            sel = (steps >= first) & (steps < first + m.bucket)
            if not sel.any():
                assert not m.present[c]
                continue
            np.testing.assert_array_equal(m.maximum[:, c], vals[sel, 0, :].max(axis=0),
                                          err_msg=f"max, level {m.level}, column at step {first}")
            np.testing.assert_array_equal(m.minimum[:, c], vals[sel, 0, :].min(axis=0),
                                          err_msg=f"min, level {m.level}, column at step {first}")
    assert seen >= {lv for lv in LEVELS if lv <= end // 4}, seen


def _const(steps: list[int], value: float) -> np.ndarray:
    return np.full((len(steps), len(STATS), N), value, dtype="<f4")


def test_a_step_resent_with_new_values_updates_every_level(store: Store) -> None:
    """The issue's case: raw 1 -> 1000 -> 2 read raw 2 and zoomed-out max 1000."""
    store.register_run(RunSpec(run_id="re"))
    truth: dict[int, np.ndarray] = {}
    _ingest(store, "re", list(range(0, 20_000, 100)), _const(list(range(0, 20_000, 100)), 1.0), truth, first=True)
    for value in (1000.0, 2.0):
        _ingest(store, "re", [5_000, 5_100], _const([5_000, 5_100], value), truth)
    m = store.tensor_matrix("re", "amax", Window(start=0, end=19_999, width=2))
    assert m.level == LEVELS[-1] and float(m.maximum.max()) == 2.0
    _check(store, "re", truth)


def test_a_job_resuming_in_the_same_segment(store: Store) -> None:
    """The agent's resume: the job restarts from a checkpoint and re-sends steps it had sent,
    with other values, in batches that straddle what was stored, then carries on."""
    store.register_run(RunSpec(run_id="resume"))
    truth: dict[int, np.ndarray] = {}
    steps = list(range(1_200))
    first = stat_values(steps, N, seed=1) * 100  # a spike-laden first life
    for lo in range(0, 1_200, 50):
        _ingest(store, "resume", steps[lo:lo + 50], first[lo:lo + 50], truth, first=lo == 0)
    again = list(range(1_000, 1_600))
    second = stat_values(again, N, seed=2)
    for lo in range(0, len(again), 50):
        _ingest(store, "resume", again[lo:lo + 50], second[lo:lo + 50], truth)
    _check(store, "resume", truth)


def test_an_older_batch_then_newer_ones_from_another_process(migrated_url: str) -> None:
    """A process without a current tail stores a batch older than the segment's newest steps; its
    next batch must not take that batch's blocks for the newest ones (which would overwrite them)."""
    a, b = Store.open(migrated_url), Store.open(migrated_url)
    try:
        a.register_run(RunSpec(run_id="ooo"))
        truth: dict[int, np.ndarray] = {}
        late = list(range(1_000, 1_100))
        spike = stat_values(late, N, seed=3)
        spike[50, 0, 2] = 9e9
        _ingest(a, "ooo", late, spike, truth, first=True)
        early = list(range(0, 100))
        _ingest(b, "ooo", early, stat_values(early, N, seed=4), truth)
        more = list(range(1_100, 1_200))
        _ingest(b, "ooo", more, stat_values(more, N, seed=5), truth)
        for s in (a, b):
            _check(s, "ooo", truth)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("order", [[0, 2, 1], [2, 1, 0]])
def test_overlapping_batches_in_any_order(store: Store, order: list[int]) -> None:
    store.register_run(RunSpec(run_id="any"))
    truth: dict[int, np.ndarray] = {}
    spans = [list(range(0, 700)), list(range(300, 900)), list(range(650, 1_400))]
    for k, i in enumerate(order):
        _ingest(store, "any", spans[i], stat_values(spans[i], N, seed=10 + i) * (i + 1), truth, first=k == 0)
    _check(store, "any", truth)
