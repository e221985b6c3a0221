"""``LoopWorker``: runs the closed loop off the request path, per run in order, runs in parallel.

Ingest answers as soon as a batch is durable and hands the batch to ``submit``; a small pool of
threads then judges dirty runs, one thread per run at a time (in this process) and one pass per
run at a time across processes (the store's loop lock). The batches themselves wait in the
database's ``loop_queue``, so nothing depends on this process surviving: a periodic sweep picks
up batches stored by a process that died, or left over when a pass stopped at its limit.
Batches this process received are kept in memory until judged (bounded), so the common path
never reads them back.

A run that ships faster than one batch per ``gather_s`` has its healthy batches judged
``gather_s`` after the first of them came, together with whatever else came meanwhile: such an
agent costs one pass per few batches rather than one per batch (a pass's fixed work, its lock,
reads, state and commit, was about half of its CPU for a small batch, under the same GIL as the
request path). A run's batch that follows its previous one by more than ``gather_s`` (a fleet of
agents each flushing every second or so), and a batch with a non-finite loss, grad norm or amax,
are judged at once.

Guarantees: every acknowledged batch is judged exactly once (its queue row is deleted in the
transaction that stores its findings and decisions); batches of one rank are judged in the order
they were written; a run's decisions are taken one batch at a time.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

import numpy as np

from fp8guard import wire
from fp8guard.service.domain import Batch
from fp8guard.service.errors import StorageUnavailable
from fp8guard.service.loop.judge import Judge, PassResult
from fp8guard.service.store import Store

__all__ = ["LoopStats", "LoopWorker", "nonfinite"]

log = logging.getLogger(__name__)


def nonfinite(batch: Batch) -> bool:
    """Whether the batch carries a non-finite loss, grad norm or amax: what the critical rules act
    on at once (and what makes the agent's tripwire ship at once and long-poll for the answer)."""
    for row in batch.steps:
        for value in (row.loss, row.grad_norm):
            if value is not None and not math.isfinite(value):
                return True
    for block in batch.blocks:
        if "amax" in block.stats and not np.isfinite(block.values[:, block.stats.index("amax"), :]).all():
            return True
    return False


class LoopStats:
    """Counters for ``/metrics``."""

    __slots__ = ("batches", "commands", "dropped", "failures", "passes", "restarts", "seconds", "up")

    COUNTERS = ("passes", "batches", "commands", "failures", "dropped", "seconds")
    """What the loop counts (a loop process reports these to the serving process)."""

    def __init__(self) -> None:
        self.passes = 0
        self.batches = 0
        self.commands = 0
        self.failures = 0
        self.dropped = 0
        self.seconds = 0.0
        self.restarts = 0
        """Times the loop's process died and was started again (``service/loop/process.py``)."""
        self.up = 1
        """Whether the loop is running (0 while its process is being restarted)."""


class LoopWorker:
    def __init__(self, store: Store, judge: Judge, *, threads: int = 2, sweep_interval_s: float = 1.0,
                 max_held: int = 4096, gather_s: float = 0.0,
                 on_commands: Callable[[str, Sequence[wire.Command]], None] | None = None) -> None:
        if threads < 1:
            raise ValueError(f"the loop needs at least one thread, got {threads}")
        self.store = store
        self.judge = judge
        self.threads = threads
        self.sweep_interval_s = sweep_interval_s
        self.max_held = max_held
        self.gather_s = gather_s
        self.on_commands = on_commands or (lambda run_id, pending: None)
        """Called with a run and its pending commands after a pass issued commands."""
        self.stats = LoopStats()
        self._cv = threading.Condition()
        self._dirty: deque[int] = deque()
        self._queued: set[int] = set()
        self._busy: set[int] = set()
        self._again: set[int] = set()
        self._urgent: set[int] = set()
        """Dirty runs with a batch whose numbers went non-finite: judged before the others. With 50
        runs sending at once, a NaN batch waited up to 45 ms behind fifteen healthy runs' passes."""
        self._since: dict[int, float] = {}
        """Per dirty run: when the first of its batches not yet taken by a pass came (monotonic)."""
        self._last_batch: OrderedDict[int, float] = OrderedDict()
        """Per recently seen run: when its last batch was submitted (bounded, oldest dropped)."""
        self._hurry = 0
        """While a drain() waits: take every dirty run at once, gathering nothing."""
        self._held: OrderedDict[int, Batch] = OrderedDict()
        self._stop = False
        self._workers: list[threading.Thread] = []

    # -- feeding -------------------------------------------------------------------------------

    def submit(self, run_pk: int, queue_id: int | None, batch: Batch | None, *, urgent: bool | None = None) -> None:
        """A batch of ``run_pk`` is durable (its queue row committed): judge it soon; first, before
        runs with healthy batches, if it carries a non-finite loss, grad norm or amax (``urgent``:
        already known, for a batch that is not handed over, as from the loop's own process)."""
        if urgent is None:
            urgent = batch is not None and nonfinite(batch)
        now = time.monotonic()
        with self._cv:
            if queue_id is not None and batch is not None:
                self._held[queue_id] = batch
                while len(self._held) > self.max_held:
                    self._held.popitem(last=False)  # read back from the database when its turn comes
            last = self._last_batch.pop(run_pk, None)
            self._last_batch[run_pk] = now
            while len(self._last_batch) > self.max_held:
                self._last_batch.popitem(last=False)
            # A run that ships slower than one batch per gather_s has nothing to gather: due now.
            self._mark(run_pk, urgent, since=None if last is not None and now - last < self.gather_s else 0.0)

    def _mark(self, run_pk: int, urgent: bool = False, since: float | None = None) -> None:
        if urgent:
            self._urgent.add(run_pk)
        at = time.monotonic() if since is None else since
        self._since[run_pk] = min(self._since.get(run_pk, at), at)
        if run_pk in self._busy:
            self._again.add(run_pk)
        elif run_pk not in self._queued:
            self._queued.add(run_pk)
            if run_pk in self._urgent:
                self._dirty.appendleft(run_pk)
            else:
                self._dirty.append(run_pk)
            # All, not one: the sweep thread and drain() wait on the same condition, and a single
            # notify that woke the sweep (which waits for _stop only) was lost; the run then sat in
            # _dirty, already marked queued so later marks did not notify again, until another
            # run's batch came ("the closed loop did not catch up" in the scenario runs).
            self._cv.notify_all()
        elif urgent:
            self._dirty.remove(run_pk)
            self._dirty.appendleft(run_pk)
            self._cv.notify_all()  # a thread may be waiting out this run's gathering

    def _next(self) -> tuple[int | None, float | None]:
        """The dirty run to judge now, or None and how long until one is due (None: none is
        dirty). Runs are due in the order they became dirty, urgent ones first."""
        if not self._dirty:
            return None, None
        head = self._dirty[0]
        if self.gather_s <= 0 or self._hurry or head in self._urgent:
            return head, None
        left = self._since.get(head, 0.0) + self.gather_s - time.monotonic()
        return (head, None) if left <= 0 else (None, left)

    def _pop(self, run_pk: int) -> None:
        self._dirty.popleft()
        self._queued.discard(run_pk)
        self._urgent.discard(run_pk)
        self._since.pop(run_pk, None)
        self._busy.add(run_pk)

    def _take(self, queue_id: int) -> Batch | None:
        with self._cv:
            return self._held.pop(queue_id, None)

    # -- running -------------------------------------------------------------------------------

    def start(self) -> None:
        if self._workers:
            return
        self._stop = False
        self._workers = [threading.Thread(target=self._run, name=f"fp8guard-loop-{i}", daemon=True)
                         for i in range(self.threads)]
        self._workers.append(threading.Thread(target=self._sweep, name="fp8guard-loop-sweep", daemon=True))
        for t in self._workers:
            t.start()

    def close(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._workers:
            t.join(timeout)
        self._workers = []

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every submitted batch was judged (tests, and a clean shutdown); without
        running threads, judge in the calling thread."""
        if not self._workers:
            self.run_pending()
            return True
        deadline = time.monotonic() + timeout
        with self._cv:
            self._hurry += 1
            self._cv.notify_all()
            try:
                while self._dirty or self._busy or self._again:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cv.wait(min(left, 0.05))
            finally:
                self._hurry -= 1
        return True

    def run_pending(self) -> None:
        """Judge every dirty run now, in this thread."""
        while True:
            with self._cv:
                if not self._dirty:
                    return
                run_pk = self._dirty[0]
                self._pop(run_pk)
            self._judge(run_pk)

    def _run(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._stop:
                        return
                    run_pk, wait = self._next()
                    if run_pk is not None:
                        break
                    self._cv.wait(wait)
                self._pop(run_pk)
            try:
                self._judge(run_pk)
            except Exception:
                # A worker thread never dies: with both gone nothing would judge again and every
                # run's decisions would stop in silence. The run's batches stay queued; the sweep
                # marks it again. (Reached when the one-by-one fallback cannot read the queue, or
                # the command notification fails.)
                self.stats.failures += 1
                log.exception("fp8guard loop: judging run %s failed; the sweep retries it", run_pk)

    def _judge(self, run_pk: int) -> None:
        more = False
        try:
            more = self._pass(run_pk)
        finally:
            with self._cv:
                self._busy.discard(run_pk)
                if more or run_pk in self._again:
                    self._again.discard(run_pk)
                    self._mark(run_pk, since=0.0 if more else None)  # a backlog goes on at once
                self._cv.notify_all()

    def _pass(self, run_pk: int) -> bool:
        started = time.perf_counter()
        try:
            result: PassResult = self.store.loop_pass(run_pk, lambda txn: self.judge(txn, self._take))
        except StorageUnavailable:
            self.stats.failures += 1
            log.warning("fp8guard loop: the database is unavailable; run %s is judged again later", run_pk)
            return False  # the sweep retries; its batches wait in the queue
        except Exception:
            self.stats.failures += 1
            log.exception("fp8guard loop: judging run %s failed; judging its batches one at a time", run_pk)
            return self._one_by_one(run_pk)
        self._count(result, time.perf_counter() - started)
        return result.more

    def _one_by_one(self, run_pk: int) -> bool:
        """After a failed pass: one batch per pass, so a batch the loop cannot judge (a bug, never
        data loss: its telemetry is stored) is dropped alone, loudly."""
        while True:
            try:
                result = self.store.loop_pass(run_pk, lambda txn: self.judge(txn, self._take, limit=1))
            except StorageUnavailable:
                return False
            except Exception:
                queued = self.store.loop_pass(run_pk, lambda txn: txn.queued(1))
                if not queued:
                    return False
                log.exception("fp8guard loop: batch %s of run %s cannot be judged; its telemetry stays stored, "
                              "but no rule saw it", queued[0].queue_id, run_pk)
                self.store.drop_queued([queued[0].queue_id])
                self.stats.dropped += 1
                continue
            self._count(result, 0.0)
            if result.judged == 0:
                return False

    def _count(self, result: PassResult, seconds: float) -> None:
        self.stats.passes += 1
        self.stats.batches += result.judged
        self.stats.commands += result.commands
        self.stats.seconds += seconds
        if result.commands:
            self.on_commands(result.run_id, result.pending)

    def _sweep(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stop, timeout=self.sweep_interval_s)
                if self._stop:
                    return
            self.sweep_once()

    def sweep_once(self) -> None:
        """Mark every run with queued batches dirty (those of other processes, or of a crash)."""
        try:
            runs = self.store.queued_runs()
        except Exception:
            log.warning("fp8guard loop: the sweep could not read the queue", exc_info=True)
            return
        with self._cv:
            for run_pk in runs:
                self._mark(run_pk)
