"""A background thread between the training loop and a transport.

The training thread calls :meth:`Shipper.submit` with a thunk that builds a payload; the thunk
runs on the shipper's thread, so JSON and base64 encoding, gzip and HTTP never cost the
training step anything but an append to a bounded queue. When the queue is full the OLDEST
waiting thunk is dropped: the newest telemetry is the most useful when a run is going wrong.
Every such loss is counted and handed to the transport's ``report_dropped`` (when it has one),
so the service hears of it as a ``telemetry_dropped`` event; the shipper's own thread does
that, never the training thread.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from fp8guard.agent.transport import Transport
from fp8guard.agent.transport.ratelimit import RateLimiter

__all__ = ["Shipper", "ShipperStats"]

log = logging.getLogger("fp8guard.agent.shipper")

_LOG_INTERVAL_S: Final = 60.0

PayloadThunk = Callable[[], dict[str, Any]]


@dataclass
class ShipperStats:
    """Counters since the shipper was created."""

    submitted: int = 0
    processed: int = 0
    """Thunks that ran and whose payload ``transport.send`` returned from (errors included)."""
    dropped: int = 0
    """Thunks discarded unrun: the oldest of a full queue, those left at close, and submits after close."""
    errors: int = 0
    """Thunks or sends that raised (logged; the thread carries on)."""
    queued: int = 0


@dataclass
class _Item:
    seq: int
    thunk: PayloadThunk
    steps: int = 0


class Shipper:
    """Runs payload thunks on a daemon thread and hands the payloads to ``transport.send`` in order.

    Example::

        shipper = Shipper(HttpTransport(url, run))
        shipper.submit(lambda: wire.make_batch(run_id=run.run_id, steps=records))  # never blocks
        ...
        shipper.close()  # flush, close the transport, join the thread

    ``close`` is safe to call from an ``atexit`` handler (``atexit.register(shipper.close)``):
    CPython runs those before it stops daemon threads, so the queue still drains. The shipper
    registers nothing itself; without a ``close``, whatever is still queued when the interpreter
    exits is lost (the thread is a daemon so that it can never keep a finished job alive).
    """

    def __init__(self, transport: Transport, *, max_queue: int = 64, name: str = "fp8guard-shipper") -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be an int >= 1, got {max_queue!r}")
        self._transport = transport
        self._max_queue = max_queue
        self._queue: collections.deque[_Item] = collections.deque()
        self._cond = threading.Condition()
        self._next_seq = 1
        self._in_flight: int | None = None  # seq of the item the thread is working on
        self._stopping = False
        self._closed = False
        self._stats = ShipperStats()
        self._unreported = [0, 0]  # batches, steps lost here and not yet handed to the transport
        self._limiter = RateLimiter(_LOG_INTERVAL_S, time.monotonic)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def transport(self) -> Transport:
        return self._transport

    def submit(self, make_payload: PayloadThunk, *, steps: int = 0) -> None:
        """Queue a thunk; never blocks on the transport and never raises. On a full queue the
        oldest waiting thunk is dropped (counted in ``stats().dropped`` and reported to the
        transport). ``steps``: how many training steps the payload will hold, for that report."""
        try:
            with self._cond:
                if self._stopping:
                    self._stats.dropped += 1
                    self._lost(steps)
                    if self._limiter.allow("closed") is not None:
                        log.warning("fp8guard shipper %s is closed; telemetry dropped", self._thread.name)
                    return
                if len(self._queue) >= self._max_queue:
                    self._lost(self._queue.popleft().steps)
                    self._stats.dropped += 1
                    if (suppressed := self._limiter.allow("full")) is not None:
                        log.warning("fp8guard shipper queue full (%d); dropped the oldest batch "
                                    "(transport too slow?)%s", self._max_queue,
                                    f" ({suppressed} more drops since the last message)" if suppressed else "")
                self._queue.append(_Item(self._next_seq, make_payload, steps))
                self._next_seq += 1
                self._stats.submitted += 1
                self._cond.notify_all()
        except Exception:  # pragma: no cover - only a broken interpreter gets here
            log.exception("fp8guard shipper: submit failed")

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything submitted so far was run and handed to the transport (or
        dropped). Returns False on timeout. Must not be called from a thunk."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            target = self._next_seq - 1
            while not self._done_up_to(target):
                if not self._thread.is_alive():
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Flush (up to ``timeout_s``), stop the thread, then close the transport. Idempotent.

        Thunks still queued when the time is up are dropped and counted. If the transport is
        still inside a ``send`` at that point it is not closed under the thread's feet: the
        daemon thread finishes on its own or dies with the process."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + timeout_s
        if not self.flush(timeout_s):
            log.warning("fp8guard shipper: flush did not finish within %.1f s", timeout_s)
        with self._cond:
            self._stopping = True
            left = len(self._queue)
            if left:
                for item in self._queue:
                    self._lost(item.steps)
                self._queue.clear()
                self._stats.dropped += left
                log.warning("fp8guard shipper: %d queued batches dropped at close", left)
            self._cond.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning("fp8guard shipper: transport still busy after %.1f s; not closing it", timeout_s)
            return
        self._report_losses()
        try:
            self._transport.close()
        except Exception:
            log.exception("fp8guard shipper: closing the transport failed")

    def stats(self) -> ShipperStats:
        with self._cond:
            return dataclasses.replace(self._stats, queued=len(self._queue))

    # ------------------------------------------------------------------ internals

    def _lost(self, steps: int) -> None:
        """Called with the lock held: remember a lost batch for the next report."""
        self._unreported[0] += 1
        self._unreported[1] += max(0, int(steps))

    def _report_losses(self) -> None:
        """Hand the losses to the transport, which reports them to the service (shipper's thread)."""
        with self._cond:
            batches, steps = self._unreported
            self._unreported = [0, 0]
        report = getattr(self._transport, "report_dropped", None)
        if batches and callable(report):
            try:
                report(batches, steps)
            except Exception:
                log.exception("fp8guard shipper: reporting lost batches failed")

    def _done_up_to(self, seq: int) -> bool:
        """True when no item numbered <= seq is queued or in flight (items run in seq order)."""
        if self._in_flight is not None and self._in_flight <= seq:
            return False
        return not self._queue or self._queue[0].seq > seq

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:  # stopping and drained
                    return
                item = self._queue.popleft()
                self._in_flight = item.seq
            try:
                self._process(item)
            finally:
                with self._cond:
                    self._in_flight = None
                    self._stats.processed += 1
                    self._cond.notify_all()

    def _process(self, item: _Item) -> None:
        self._report_losses()
        try:
            payload = item.thunk()
        except Exception:
            # A bad thunk must not end shipping; its batch is a loss like any other.
            with self._cond:
                self._stats.errors += 1
                self._lost(item.steps)
            if (suppressed := self._limiter.allow("error")) is not None:
                log.exception("fp8guard shipper: building a batch failed%s",
                              f" ({suppressed} similar errors suppressed)" if suppressed else "")
            return
        try:
            self._transport.send(payload)
        except Exception:
            # A transport breaking its never-raise promise must not end shipping either.
            with self._cond:
                self._stats.errors += 1
            if (suppressed := self._limiter.allow("error")) is not None:
                log.exception("fp8guard shipper: building or sending a batch failed%s",
                              f" ({suppressed} similar errors suppressed)" if suppressed else "")
