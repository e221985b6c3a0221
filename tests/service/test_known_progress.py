"""A rank's progress as this process last wrote it stands in for reading it (PostgreSQL: the
ingest transaction is one round trip), checked by the statement that bumps the rank: whenever
it is wrong (another process wrote the rank, the batch is a duplicate) the transaction writes
nothing and the batch is written again the careful way. And the transaction's BEGIN rides in
the pipeline, which must leave no pooled connection in autocommit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa

from bench.pg_roundtrips import round_trips, traced
from fp8guard.service.domain import RunSpec
from fp8guard.service.errors import Conflict
from fp8guard.service.ingest.decode import decode_batch
from fp8guard.service.schemas import IngestBatchIn
from fp8guard.service.store import Store, Window
from fp8guard.service.store import repository as repo
from fp8guard.service.store import telemetry_writer as writer
from tests.helpers import STATS, batch, stat_values

N = 4


def _batch(run: str, steps: list[int], *, first: bool = False, batch_id: str | None = None,
           seed: int = 0) -> Any:
    vals = stat_values(steps, N, seed=seed)
    return decode_batch(IngestBatchIn.model_validate(
        batch(run, steps, n_tensors=N, values=vals, define_tensors=first, batch_id=batch_id)))


@pytest.fixture
def stale_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every failed progress check, as the store saw it."""
    seen: list[str] = []
    real = repo._raise_if_stale

    def counting(exc: BaseException | None) -> None:
        try:
            real(exc)
        except writer.StaleProgress as stale:
            seen.append(str(stale))
            raise

    monkeypatch.setattr(repo, "_raise_if_stale", counting)
    return seen


def _rank(store: Store, run: str) -> Any:
    (rank,) = store.run(run).ranks
    return rank


def test_two_processes_writing_one_rank_in_turn_store_every_batch(migrated_url: str,
                                                                  stale_checks: list[str]) -> None:
    """Each process's known progress goes stale whenever the other wrote the rank: every batch is
    still stored once, counted once, and its values read back."""
    a, b = Store.open(migrated_url), Store.open(migrated_url)
    try:
        a.register_run(RunSpec(run_id="turns"))
        stores = [a, a, b, a, b, b, a]
        for k, store in enumerate(stores):
            result = store.ingest(_batch("turns", list(range(10 * k, 10 * k + 10)), first=k == 0, seed=k))
            assert not result.duplicate and result.steps == 10
        for store in (a, b):
            rank = _rank(store, "turns")
            assert (rank.batches, rank.last_step, rank.samples) == (len(stores), 10 * len(stores) - 1,
                                                                   len(stores) * 10 * N)
            m = store.tensor_matrix("turns", "amax", Window(start=0, end=10 * len(stores) - 1, width=10 * len(stores)))
            want = np.concatenate([stat_values(list(range(10 * k, 10 * k + 10)), N, seed=k)[:, STATS.index("amax"), :]
                                   for k in range(len(stores))])
            np.testing.assert_array_equal(m.maximum.T, want)
        if a.engine.dialect.name == "postgresql":
            # a's third write (after b's first) and b's second (after a's third) and a's last
            assert len(stale_checks) == 3, stale_checks
        else:
            assert stale_checks == []  # SQLite has no round trip to save: it always reads
    finally:
        a.close()
        b.close()


def test_a_duplicate_sent_to_a_process_that_knows_its_rank_is_stored_once(store: Store,
                                                                            stale_checks: list[str]) -> None:
    store.register_run(RunSpec(run_id="dup"))
    store.ingest(_batch("dup", list(range(10)), first=True, batch_id="batch-000"))
    store.ingest(_batch("dup", list(range(10, 20)), batch_id="batch-001"))
    again = store.ingest(_batch("dup", list(range(10, 20)), batch_id="batch-001"))
    assert again.duplicate and again.samples == 0
    rank = _rank(store, "dup")
    assert (rank.batches, rank.last_step) == (2, 19)
    store.ingest(_batch("dup", list(range(20, 30)), batch_id="batch-002"))  # and the rank is still known after
    assert _rank(store, "dup").batches == 3
    assert len(stale_checks) == (1 if store.engine.dialect.name == "postgresql" else 0)


def test_a_group_with_one_stale_rank_is_written_again_whole(migrated_url: str, stale_checks: list[str]) -> None:
    """Group commit: one batch's failed check fails its group's transaction; the group is written
    again and every batch in it is stored."""
    a, b = Store.open(migrated_url), Store.open(migrated_url)
    try:
        for run in ("g1", "g2"):
            a.register_run(RunSpec(run_id=run))
            a.ingest(_batch(run, list(range(10)), first=True))
        b.ingest(_batch("g2", list(range(10, 20))))  # a's knowledge of g2 is now stale
        results = a.ingest_many([_batch("g1", list(range(10, 20))), _batch("g2", list(range(20, 30)))])
        assert [getattr(r, "duplicate", r) for r in results] == [False, False]
        assert [_rank(a, run).batches for run in ("g1", "g2")] == [2, 3]
        assert len(stale_checks) == (1 if a.engine.dialect.name == "postgresql" else 0)
    finally:
        a.close()
        b.close()


def _pooled_autocommit(store: Store) -> list[bool]:
    """The autocommit flag of every connection the pool holds (checked out one after another)."""
    held = [store.engine.connect() for _ in range(store.engine.pool.checkedin())]
    try:
        return [bool(getattr(c.connection.driver_connection, "autocommit", False)) for c in held]
    finally:
        for c in held:
            c.close()


def test_a_failed_ingest_leaves_no_connection_in_autocommit(store: Store) -> None:
    """The batch fails inside the pipeline (its tensor table conflicts with the stored one): it
    is refused, nothing of it is stored, and the connection goes back to the pool with psycopg's
    own transactions, so the next transaction on it is atomic again."""
    store.register_run(RunSpec(run_id="bad"))
    store.ingest(_batch("bad", list(range(10)), first=True))
    conflicting = batch("bad", list(range(10, 20)), n_tensors=N, define_tensors=True)
    conflicting["tensors"][1]["name"] = "renamed"
    with pytest.raises(Conflict):
        store.ingest(decode_batch(IngestBatchIn.model_validate(conflicting)))
    assert _rank(store, "bad").batches == 1
    assert not any(_pooled_autocommit(store))
    # and a transaction that fails after a write leaves nothing behind
    with pytest.raises(RuntimeError), store.engine.connect() as conn, conn.begin():
        conn.execute(sa.text("UPDATE runs SET status = 'poisoned'"))
        raise RuntimeError("abort")
    assert store.run("bad").summary.status != "poisoned"


def test_a_known_ranks_small_batch_is_one_round_trip(store: Store) -> None:
    """BEGIN, the batch's writes, its answer's reads and COMMIT go out together and wait once."""
    if store.engine.dialect.name != "postgresql":
        pytest.skip("round trips are PostgreSQL's")
    store.register_run(RunSpec(run_id="rt"))
    store.ingest(_batch("rt", list(range(10)), first=True))
    store.ingest(_batch("rt", list(range(10, 20))))
    with traced(store.engine) as trace:
        store.ingest(_batch("rt", list(range(20, 30))))
    assert round_trips(trace[0]) == 1, trace[0][:3000]
    assert _rank(store, "rt").batches == 3
