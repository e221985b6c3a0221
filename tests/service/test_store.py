"""Store-level behaviour that several service processes sharing one database depend on."""

from __future__ import annotations

import numpy as np
import pytest

from fp8guard.service.domain import RunSpec
from fp8guard.service.errors import Conflict
from fp8guard.service.ingest.decode import decode_batch
from fp8guard.service.schemas import IngestBatchIn
from fp8guard.service.store import Store, Window
from tests.helpers import batch, stat_values


def _ingest(store: Store, payload: dict) -> None:
    store.ingest(decode_batch(IngestBatchIn.model_validate(payload)))


def test_two_processes_interleaving_one_rank_keep_rollups_exact(migrated_url: str) -> None:
    """Two Store instances stand for two `fp8guard serve` processes behind a load balancer:
    each one's cached roll-up tail must be dropped when the other wrote in between."""
    a, b = Store.open(migrated_url), Store.open(migrated_url)
    try:
        a.register_run(RunSpec(run_id="shared"))
        steps = list(range(0, 300))
        vals = stat_values(steps, 5)
        vals[37, 0, 3] = 9e9  # lands in a block that the next writer extends
        vals[41, 0, 1] = -7.0
        order = [a, b, a, a, b, a]
        for i, lo in enumerate(range(0, 300, 50)):
            _ingest(order[i], batch("shared", steps[lo:lo + 50], n_tensors=5, values=vals[lo:lo + 50],
                                    define_tensors=lo == 0))
        for store in (a, b):
            m = store.tensor_matrix("shared", "amax", Window(width=5))
            assert m.level > 1
            for c, first in enumerate(m.column_steps.tolist()):
                sel = slice(first, first + m.bucket)
                np.testing.assert_array_equal(m.maximum[:, c], vals[sel, 0, :].max(axis=0))
                np.testing.assert_array_equal(m.minimum[:, c], vals[sel, 0, :].min(axis=0))
    finally:
        a.close()
        b.close()


def test_out_of_order_batches_merge_into_existing_rollups(store: Store) -> None:
    store.register_run(RunSpec(run_id="ooo"))
    steps = list(range(0, 200))
    vals = stat_values(steps, 3)
    _ingest(store, batch("ooo", steps[100:], n_tensors=3, values=vals[100:]))
    _ingest(store, batch("ooo", steps[:100], n_tensors=3, values=vals[:100], define_tensors=False))
    m = store.tensor_matrix("ooo", "scale", Window(width=1))
    np.testing.assert_array_equal(m.maximum[:, 0], vals[:, 1, :].max(axis=0))
    assert store.scalars("ooo", ["loss"], Window()).steps == steps


def test_rollups_merge_rows_of_a_tensor_table_that_grew(store: Store) -> None:
    """Small batches fold into stored roll-up rows a level at a time; a row written before the
    run's tensor table grew is narrower than the new extremes, and tensors it lacks read as
    their new values alone."""
    store.register_run(RunSpec(run_id="grow"))
    steps = list(range(0, 30))
    vals = stat_values(steps, 5)
    vals[4, 0, 1] = 9e9
    vals[17, 0, 4] = -3.0
    _ingest(store, batch("grow", steps[:10], n_tensors=3, values=vals[:10, :, :3]))
    _ingest(store, batch("grow", steps[10:20], n_tensors=5, values=vals[10:20]))
    _ingest(store, batch("grow", steps[20:], n_tensors=5, values=vals[20:], define_tensors=False))
    m = store.tensor_matrix("grow", "amax", Window(width=1))
    assert m.level > 1
    np.testing.assert_array_equal(m.maximum[:3, 0], vals[:, 0, :3].max(axis=0))
    np.testing.assert_array_equal(m.minimum[:3, 0], vals[:, 0, :3].min(axis=0))
    np.testing.assert_array_equal(m.maximum[3:, 0], vals[10:, 0, 3:].max(axis=0))
    np.testing.assert_array_equal(m.minimum[3:, 0], vals[10:, 0, 3:].min(axis=0))


def test_failed_batch_leaves_no_cached_facts(store: Store) -> None:
    """A batch rolled back after defining stats must not leave stat ids in the write cache."""
    store.register_run(RunSpec(run_id="rb-cache"))
    good = batch("rb-cache", [0, 1], n_tensors=3)
    bad = batch("rb-cache", [2], n_tensors=3, stats=("amax", "brand_new_stat"))
    bad["tensors"][0]["name"] = "clash"
    _ingest(store, good)
    with pytest.raises(Conflict):
        _ingest(store, bad)
    ok = batch("rb-cache", [2], n_tensors=3, stats=("amax", "brand_new_stat"), define_tensors=False)
    _ingest(store, ok)
    assert "brand_new_stat" in store.run("rb-cache").stats
    assert store.tensor_series("rb-cache", 0, "brand_new_stat", Window()).steps == [2]


def test_sqlite_writers_queue_on_one_lock_and_give_up_after_its_timeout(store: Store,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Every write transaction of a SQLite store (not only ingest and the loop) takes the process's
    write lock, and one that cannot get it in time is answered 'unavailable' rather than waiting forever."""
    import threading

    from fp8guard.service.errors import StorageUnavailable
    from fp8guard.service.store import repository

    if store.engine.dialect.name != "sqlite":
        pytest.skip("the process write lock is SQLite's")
    monkeypatch.setattr(repository, "WRITE_LOCK_TIMEOUT_S", 0.2)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store._session(write=True):
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        with pytest.raises(StorageUnavailable):
            store.register_run(RunSpec(run_id="waits"))
        with pytest.raises(StorageUnavailable):
            store.set_guard("waits", {}, "admin")
    finally:
        release.set()
        holder.join(10)
    store.register_run(RunSpec(run_id="waits"))  # the lock is free again
    assert store.run("waits").summary.run_id == "waits"
