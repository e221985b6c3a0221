"""``Committer``: group commit for the ingest path.

Requests hand their decoded batch to ``submit`` and wait; a writer thread takes everything
waiting (up to ``max_batches`` batches or ``max_samples`` samples) and stores it in one
transaction, so under many agents the database commits (and, on PostgreSQL, flushes its WAL)
once per group instead of once per request. A request is answered only after the transaction
holding its batch committed: nothing is acknowledged that is not durable. A batch that cannot be
stored fails alone (the store retries a failed group batch by batch).

A small batch that finds every writer idle and nothing queued is stored on the event loop
itself (``inline_max_samples``): with no one to group it with, the two thread hand-offs (wake a
writer, wake the event loop with the result) were most of a lone agent's wait beyond the write,
on a loaded host a scheduler slice each. While it is written the event loop serves no one else,
so it is bounded by size, and anything that arrives meanwhile is queued and grouped as before.
It never waits for the database: if a closed-loop pass holds SQLite's write lock
(``Store.try_ingest_now``), the batch goes to the writer thread instead.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from fp8guard.service.domain import Batch, IngestResult
from fp8guard.service.errors import ServiceError, StorageUnavailable
from fp8guard.service.store import Store

__all__ = ["Committer"]

log = logging.getLogger(__name__)


class Committer:
    def __init__(self, store: Store, *, writers: int = 1, max_batches: int = 64, max_samples: int = 2_000_000,
                 on_stored: Callable[[Batch, IngestResult], None] | None = None,
                 inline_max_samples: int = 0) -> None:
        if writers < 1:
            raise ValueError(f"ingest needs at least one writer thread, got {writers}")
        self.store = store
        self.writers = writers
        self.max_batches = max_batches
        self.max_samples = max_samples
        self.on_stored = on_stored or (lambda batch, result: None)
        self.inline_max_samples = inline_max_samples
        self.inline = 0
        """Batches stored on the event loop (no writer was busy, nothing queued)."""
        self._writing = 0  # writer threads storing a group, or the event loop storing inline
        self.groups = 0
        self.grouped = 0
        self._cv = threading.Condition()
        self._queue: deque[tuple[Batch, Future[IngestResult]]] = deque()
        self._stop = False
        self._threads: list[threading.Thread] = []
        self._count_lock = threading.Lock()

    def start(self) -> None:
        if not self._threads:
            self._stop = False
            self._threads = [threading.Thread(target=self._run, name=f"fp8guard-ingest-{i}", daemon=True)
                             for i in range(self.writers)]
            for t in self._threads:
                t.start()

    def close(self, timeout: float = 30.0) -> None:
        """Store what is queued, then stop."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout)
        self._threads = []

    async def submit(self, batch: Batch) -> IngestResult:
        """Store ``batch`` (with whatever else is waiting); raises the batch's ServiceError."""
        future: Future[IngestResult] = Future()
        with self._cv:
            if self._stop or not self._threads:
                raise StorageUnavailable("the service is shutting down; retry with the same batch_id")
            inline = not self._queue and not self._writing and batch.num_samples <= self.inline_max_samples
            if inline:
                self._writing += 1
            else:
                self._queue.append((batch, future))
                self._cv.notify()
        if not inline:
            return await asyncio.wrap_future(future)
        stored = False
        try:
            stored = self._store([(batch, future)], now=True)
        finally:
            with self._cv:
                self._writing -= 1
                if stored:
                    self.inline += 1
                else:  # the database's write lock was taken: a writer thread waits for it
                    self._queue.append((batch, future))
                    self._cv.notify()
        return await asyncio.wrap_future(future) if not stored else future.result()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if not self._queue:
                    return
                group = [self._queue.popleft()]
                samples = group[0][0].num_samples
                while self._queue and len(group) < self.max_batches:
                    nxt = self._queue[0][0].num_samples
                    if samples + nxt > self.max_samples:
                        break
                    group.append(self._queue.popleft())
                    samples += nxt
                self._writing += 1
            try:
                self._store(group)
            finally:
                with self._cv:
                    self._writing -= 1

    def _store(self, group: list[tuple[Batch, Future[IngestResult]]], *, now: bool = False) -> bool:
        """Store the group and settle its futures; with ``now``, only if the database is free this
        instant (False, and nothing done, otherwise)."""
        try:
            got = self.store.try_ingest_now(group[0][0]) if now else self.store.ingest_many([b for b, _ in group])
            if got is None:
                return False
            results = got
        except Exception as exc:  # never leave a request waiting forever
            log.exception("fp8guard ingest: storing a group of %d batches failed", len(group))
            results = [exc if isinstance(exc, ServiceError) else StorageUnavailable(f"storing failed: {exc}")
                       for _ in group]
        with self._count_lock:
            self.groups += 1
            self.grouped += len(group)
        for (batch, future), result in zip(group, results, strict=True):
            if isinstance(result, BaseException):
                future.set_exception(result)
                continue
            try:
                self.on_stored(batch, result)
            except Exception:  # the loop's sweep still finds the batch in the queue
                log.exception("fp8guard ingest: handing batch %s to the loop failed", batch.batch_id)
            future.set_result(result)
        return True
