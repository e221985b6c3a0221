"""The ingest committer on a real store: a small batch with no writer busy is stored on the event
loop (no thread hand-off), anything else by a writer thread; either way the answer comes only
once the batch is stored, and a batch that cannot be stored raises its own ServiceError."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from fp8guard import wire
from fp8guard.service.domain import Batch, IngestResult, RunSpec
from fp8guard.service.errors import NotFound
from fp8guard.service.ingest.committer import Committer
from fp8guard.service.ingest.decode import decode_batch
from fp8guard.service.schemas import IngestBatchIn
from fp8guard.service.store import Store
from tests.helpers import batch


def _batch(run_id: str, first: int, *, n_tensors: int = 6, define: bool = True) -> Batch:
    payload = batch(run_id, list(range(first, first + 10)), n_tensors=n_tensors, define_tensors=define)
    return decode_batch(IngestBatchIn.model_validate_json(wire.dumps(payload)))


def _submit_all(committer: Committer, batches: list[Batch]) -> list[IngestResult]:
    async def go() -> list[IngestResult]:
        return [await committer.submit(b) for b in batches]

    return asyncio.run(go())


@pytest.mark.parametrize("inline_max", [0, 10_000])
def test_answers_come_after_the_batch_is_stored_inline_or_not(store: Store, inline_max: int) -> None:
    store.register_run(RunSpec(run_id="cm-1"))
    stored: list[str] = []
    committer = Committer(store, inline_max_samples=inline_max, on_stored=lambda b, r: stored.append(b.batch_id))
    committer.start()
    try:
        batches = [_batch("cm-1", 0), _batch("cm-1", 10, define=False), _batch("cm-1", 20, define=False)]
        results = _submit_all(committer, batches)
    finally:
        committer.close()
    assert [r.samples for r in results] == [60, 60, 60] and not any(r.duplicate for r in results)
    assert stored == [b.batch_id for b in batches]
    assert committer.inline == (3 if inline_max else 0)
    assert committer.grouped == 3  # every batch went through a (one-batch) transaction
    rank = store.run("cm-1").ranks[0]
    assert (rank.batches, rank.samples, rank.last_step) == (3, 180, 29)


def test_a_batch_over_the_inline_limit_goes_to_a_writer(store: Store) -> None:
    store.register_run(RunSpec(run_id="cm-2"))
    committer = Committer(store, inline_max_samples=59)  # the batch has 6 tensors x 10 steps
    committer.start()
    try:
        (result,) = _submit_all(committer, [_batch("cm-2", 0)])
    finally:
        committer.close()
    assert result.samples == 60 and committer.inline == 0 and committer.groups == 1
    assert store.run("cm-2").ranks[0].samples == 60


def test_an_inline_failure_raises_its_error_and_the_next_batch_still_goes_inline(store: Store) -> None:
    store.register_run(RunSpec(run_id="cm-3"))
    committer = Committer(store, inline_max_samples=10_000)
    committer.start()

    async def go() -> IngestResult:
        with pytest.raises(NotFound):
            await committer.submit(_batch("cm-unregistered", 0))
        return await committer.submit(_batch("cm-3", 0))

    try:
        result = asyncio.run(go())
    finally:
        committer.close()
    assert result.samples == 60 and committer.inline == 2
    assert store.run("cm-3").ranks[0].batches == 1


def test_an_inline_batch_never_waits_for_the_write_lock_a_loop_pass_holds(store: Store) -> None:
    """On SQLite, while another thread of the process holds the database's write lock (a loop
    pass), the batch goes to the writer thread at once and is answered once that thread stored it."""
    if store.engine.dialect.name != "sqlite":
        pytest.skip("the process write lock is SQLite's")
    store.register_run(RunSpec(run_id="cm-4"))
    committer = Committer(store, inline_max_samples=10_000)
    committer.start()
    lock = store._write_lock
    assert lock is not None
    lock.acquire()
    released = threading.Timer(0.3, lock.release)
    released.start()
    try:
        t0 = time.monotonic()
        (result,) = _submit_all(committer, [_batch("cm-4", 0)])
        waited = time.monotonic() - t0
    finally:
        released.join()
        committer.close()
    assert result.samples == 60 and committer.inline == 0 and committer.groups == 1
    assert waited >= 0.25  # answered only after the writer could store it
    assert store.run("cm-4").ranks[0].batches == 1


def test_an_inline_batch_never_waits_for_another_processs_write_lock(store: Store) -> None:
    """On SQLite, while another connection (the loop's process) holds the database's write lock,
    the inline attempt gives up at once, without SQLite's busy timeout stalling the event loop, and
    the batch goes to the writer thread, answered once that thread stored it."""
    if store.engine.dialect.name != "sqlite":
        pytest.skip("the database-wide write lock is SQLite's")
    import sqlite3

    store.register_run(RunSpec(run_id="cm-5"))
    committer = Committer(store, inline_max_samples=10_000)
    committer.start()
    other = sqlite3.connect(store.engine.url.database or "", isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # another process's write transaction
    released = threading.Timer(0.5, other.execute, ("COMMIT",))
    gaps: list[float] = []

    async def go() -> IngestResult:
        async def tick() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.005)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.02)
        try:
            return await committer.submit(_batch("cm-5", 0))
        finally:
            ticker.cancel()

    released.start()
    try:
        t0 = time.monotonic()
        result = asyncio.run(go())
        waited = time.monotonic() - t0
    finally:
        released.join()
        committer.close()
        other.close()
    assert result.samples == 60 and committer.inline == 0 and committer.groups == 1
    assert waited >= 0.4  # answered only after the writer could store it
    assert max(gaps) < 0.2  # the event loop kept running meanwhile (it was blocked ~0.5 s)
    assert store.run("cm-5").ranks[0].batches == 1
