"""``LoopProcess``: the closed loop in a process of its own, supervised by the serving process.

In one process the loop's passes (detector, policy, their transaction) took about a fifth of the
service's GIL time under one fast agent (py-spy), time the ingest path waited for. Here the
serving process keeps only what acknowledgement needs; for each stored batch it sends the loop
process one frame with one non-blocking ``send``: a small batch whole (``link.held_frame``,
pickled), a large one as 17 bytes (``link.batch_frame``: run, queue row, non-finite or not) that
the loop process reads back from the database's ``loop_queue`` (as the sweep always did for other
processes' batches); it judges them with the same ``LoopWorker`` (gathering, urgency, per-run
order, the loop lock). When a pass issues commands,
the loop process sends the run's pending commands back and ``on_commands`` wakes its long-polls
at once; its counters come back every ``STATS_INTERVAL_S`` for ``/metrics``.

Lifecycle: ``start`` spawns the process and waits until it is ready (a loop that cannot start
fails the service's start); ``drain`` has it judge everything sent so far; ``close`` ends it. If
it dies, the link thread logs an error, counts a restart (``fp8guard_loop_restarts``; ``fp8guard_loop_up``
is 0 meanwhile) and starts a new one after a back-off; batches sent to the dead one are still in
``loop_queue`` and the new one's first sweep picks them up. The loop process ends by itself when
the serving process's end of the socket closes (the serving process exited, however it did).

``run_loop`` is the loop process's main, also what ``fp8guard loop`` runs with no serving
process (then it finds work by its sweep only).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from fp8guard import wire
from fp8guard.service.domain import Batch
from fp8guard.service.loop import link
from fp8guard.service.loop.judge import Judge
from fp8guard.service.loop.link import Kind
from fp8guard.service.loop.worker import LoopStats, LoopWorker, nonfinite
from fp8guard.service.settings import Settings
from fp8guard.service.store import Store
from fp8guard.service.store.repository import WriteTurn

__all__ = ["LoopProcess", "loop_worker", "run_loop"]

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.5
"""How often the loop process reports its counters (``/metrics`` lags the loop by at most this)."""
START_TIMEOUT_S = 120.0
"""How long the loop process may take to import and open the database (about 1-2 s here)."""
MAX_PENDING_BYTES = 4 * 2**20
"""Frames the serving process keeps while the loop process's socket buffer is full (about 240,000
batches); beyond it, batches are not sent, and the loop's sweep finds them in ``loop_queue``."""
HAND_OVER_MAX_SAMPLES = 50_000
"""A stored batch of at most this many samples is handed to the loop process whole (pickled, ~0.1
ms and 33 KB for a batch of 200 tensors x 4 stats x 10 steps); a larger one is read back from the
database by the loop process. Read back, a small batch cost the loop process more than the
pickle costs here, inside the pass that holds SQLite's one write lock, which the ingest writer
then waited for."""
HAND_OVER_MAX_PENDING = 256 * 2**10
"""While this many bytes wait for the loop process's socket, batches are announced, not handed over."""
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
"""Waits before restarting a loop process that died: the n-th restart in a row waits the n-th."""


def loop_worker(settings: Settings, store: Store, on_commands: Callable[[str, Sequence[wire.Command]], None]
                ) -> LoopWorker:
    """The loop's worker as ``settings`` say (in a serving process's threads, or a loop process)."""
    postgres = store.engine.dialect.name == "postgresql"
    return LoopWorker(store, Judge(settings.alerts, batch_limit=settings.loop_batch_limit),
                      threads=settings.loop_threads or (2 if postgres else 1),
                      sweep_interval_s=settings.loop_sweep_interval_s, gather_s=settings.loop_gather_s,
                      on_commands=on_commands)


class LoopProcess:
    """The serving process's side: ``submit``, ``drain``, ``close`` and ``stats`` as ``LoopWorker``."""

    def __init__(self, settings: Settings, store: Store, *,
                 on_commands: Callable[[str, Sequence[wire.Command]], None] | None = None) -> None:
        self.settings = settings
        self._ctx = multiprocessing.get_context("spawn")  # never fork a process with threads
        self._turn = self._ctx.RawValue("i", 0)
        """SQLite: ingest writes waiting for the write lock hold the loop process's passes back."""
        if store.engine.dialect.name == "sqlite":
            store.write_turn = WriteTurn(self._turn, loop=False)
        self.on_commands = on_commands or (lambda run_id, pending: None)
        self.stats = LoopStats()
        self.stats.up = 0
        self._base = {name: 0.0 for name in LoopStats.COUNTERS}
        """Counters of the loop processes that died (each new one counts from zero)."""
        self._last = dict(self._base)
        self._send_lock = threading.Lock()
        self._pending = bytearray()
        self._sock: socket.socket | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._cv = threading.Condition()
        self._ready = False
        self._drained: dict[int, bool] = {}
        self._token = 0
        self._closing = False
        self._thread: threading.Thread | None = None
        self._dropped_warned = False

    # -- the ingest side ----------------------------------------------------------------------

    def submit(self, run_pk: int, queue_id: int | None, batch: Batch | None) -> None:
        """A batch is durable: tell the loop process (never waits; see ``MAX_PENDING_BYTES``)."""
        urgent = batch is not None and nonfinite(batch)
        if (batch is not None and queue_id is not None and batch.num_samples <= HAND_OVER_MAX_SAMPLES
                and len(self._pending) < HAND_OVER_MAX_PENDING):
            self._send(link.held_frame(run_pk, queue_id, urgent, batch), droppable=True)
        else:
            self._send(link.batch_frame(run_pk, queue_id, urgent), droppable=True)

    def _send(self, data: bytes, *, droppable: bool = False) -> None:
        with self._send_lock:
            sock = self._sock
            if sock is None:
                return  # no loop process right now: the next one's first sweep finds the batch
            if self._pending:
                if droppable and len(self._pending) > MAX_PENDING_BYTES:
                    if not self._dropped_warned:
                        self._dropped_warned = True
                        log.warning("fp8guard loop: the loop process is behind; batches are left to its sweep")
                    return
                self._pending += data
                return
            try:
                sent = sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                return  # the process died; the link thread restarts it
            if sent < len(data):
                self._pending += data[sent:]  # the link thread sends the rest when the socket drains

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._closing = False
        self._spawn()
        self._thread = threading.Thread(target=self._link, name="fp8guard-loop-link", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        failed = None
        with self._cv:
            while not self._ready and failed is None:
                proc = self._proc
                if proc is not None and proc.exitcode is not None:
                    failed = (f"the closed loop's process exited at its start (code {proc.exitcode}); "
                              "its error is logged above")
                elif time.monotonic() > deadline:
                    failed = f"the closed loop's process did not start within {START_TIMEOUT_S:g} s"
                else:
                    self._cv.wait(0.1)
        if failed is not None:
            self.close(timeout=1.0)
            raise RuntimeError(failed)

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            proc = self._ctx.Process(target=run_loop, args=(self.settings, theirs, self._turn),
                                     name="fp8guard-loop", daemon=True)
            proc.start()
        except BaseException:
            ours.close()
            theirs.close()
            raise
        theirs.close()  # only the child holds it now: its exit closes the socket
        ours.setblocking(False)
        with self._send_lock:
            self._sock, self._proc = ours, proc
            self._pending.clear()
            self._dropped_warned = False

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until the loop process judged every batch sent so far (False: not in ``timeout``)."""
        with self._cv:
            self._token += 1
            token = self._token
        self._send(link.drain_frame(token, timeout))
        deadline = time.monotonic() + timeout + 5.0
        with self._cv:
            while token not in self._drained:
                left = deadline - time.monotonic()
                if left <= 0 or self._sock is None:
                    return False
                self._cv.wait(min(left, 0.1))
            return self._drained.pop(token)

    def close(self, timeout: float = 10.0) -> None:
        """End the loop process (it judges what it was told first, bounded by ``loop_drain_timeout_s``)."""
        self._closing = True
        with self._send_lock:
            sock, proc = self._sock, self._proc
            self._sock = None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)  # end of input: the loop process finishes and exits
        if proc is not None:
            proc.join(timeout + self.settings.loop_drain_timeout_s)
            if proc.exitcode is None:
                log.error("fp8guard loop: the loop process did not exit; killing it")
                proc.kill()
                proc.join(5)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if sock is not None:
            sock.close()
        self.stats.up = 0

    # -- the link thread: answers in, pending frames out, restarts ----------------------------

    def _link(self) -> None:
        failures = 0
        while not self._closing:
            sock, proc = self._sock, self._proc
            assert sock is not None and proc is not None
            started = time.monotonic()
            try:
                self._serve(sock)
            except Exception:  # a frame this side cannot read: end that loop process, start another
                log.exception("fp8guard loop: the link to the loop process failed")
            if self._closing:
                return
            with self._send_lock:
                self._sock = None
            sock.close()  # a loop process still running (the link failed) ends at its socket's end
            proc.join(self.settings.loop_drain_timeout_s + 5)
            if proc.exitcode is None:
                proc.kill()
                proc.join(5)
            self._base = {k: self._base[k] + self._last[k] for k in self._base}
            self._last = dict.fromkeys(self._base, 0.0)
            self.stats.up = 0
            self.stats.restarts += 1
            with self._cv:
                self._drained.clear()
                self._cv.notify_all()
            failures = 1 if time.monotonic() - started > 60 else failures + 1  # deaths in a row
            wait = RESTART_BACKOFF_S[min(failures, len(RESTART_BACKOFF_S)) - 1]
            log.error("fp8guard loop: the loop process died (exit code %s); starting a new one in %g s "
                      "(restart %d); batches it had not judged wait in loop_queue", proc.exitcode, wait,
                      self.stats.restarts)
            time.sleep(wait)
            while not self._closing:
                try:
                    self._spawn()
                    break
                except Exception:  # e.g. out of file descriptors: keep trying, never leave the loop down
                    failures += 1
                    wait = RESTART_BACKOFF_S[min(failures, len(RESTART_BACKOFF_S)) - 1]
                    log.exception("fp8guard loop: starting the loop process failed; retrying in %g s", wait)
                    time.sleep(wait)
            if self._closing:  # close() came meanwhile: end what was just started (it ends at its socket's end)
                with self._send_lock:
                    sock, self._sock = self._sock, None
                if sock is not None:
                    sock.close()
                return

    def _serve(self, sock: socket.socket) -> None:
        """Exchange frames with one loop process until its socket closes."""
        frames = link.Frames()
        while True:
            with self._send_lock:
                want_write = bool(self._pending)
            try:
                readable, writable, _ = select.select([sock], [sock] if want_write else [], [], 0.5)
            except (OSError, ValueError):
                return
            if writable:
                with self._send_lock:
                    try:
                        sent = sock.send(self._pending)
                    except (BlockingIOError, InterruptedError):
                        sent = 0
                    except OSError:
                        return
                    del self._pending[:sent]
            if not readable:
                continue
            try:
                data = sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return
            if not data:
                return
            for kind, payload in frames.feed(data):
                self._handle(kind, payload)

    def _handle(self, kind: Kind, payload: bytes) -> None:
        if kind is Kind.COMMANDS:
            run_id, pending = link.read_commands(payload)
            self.on_commands(run_id, pending)
        elif kind is Kind.STATS:
            counters = link.read_stats(payload)
            self._last = {k: float(counters.get(k, 0)) for k in self._base}
            for name in LoopStats.COUNTERS:
                total = self._base[name] + self._last[name]
                setattr(self.stats, name, total if name == "seconds" else int(total))
        elif kind is Kind.DRAINED:
            token, ok = link.read_drained(payload)
            with self._cv:
                self._drained[token] = ok
                self._cv.notify_all()
        elif kind is Kind.READY:
            self.stats.up = 1
            with self._cv:
                self._ready = True
                self._cv.notify_all()


# -- the loop process ---------------------------------------------------------------------------

class _Parent:
    """The loop process's end of the socket: frames out, from any thread."""

    def __init__(self, sock: socket.socket | None) -> None:
        self.sock = sock
        self._lock = threading.Lock()

    def send(self, data: bytes) -> None:
        if self.sock is None:
            return
        with self._lock, contextlib.suppress(OSError):  # the serving process is gone: we exit soon
            self.sock.sendall(data)


def run_loop(settings: Settings, sock: socket.socket | None, turn: Any = None) -> None:
    """The loop process: judge what the serving process announces on ``sock`` (and what the sweep
    finds) until ``sock`` closes; with no ``sock`` (``fp8guard loop``), until SIGTERM or SIGINT.
    ``turn``: the serving process's ``RawValue`` of ``WriteTurn`` (SQLite)."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(levelname)s fp8guard loop process {os.getpid()}: %(message)s")
    log.setLevel(logging.INFO)
    stop = threading.Event()
    if sock is not None:
        # Its life is the socket's: a Ctrl-C meant for `fp8guard serve` reaches the whole process
        # group, and the serving process drains and ends it in order.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    sys.setswitchinterval(0.0005)  # its threads hand runs to each other, as the serving process's do
    parent = _Parent(sock)
    store = Store.open(settings.database_url, check_schema=sock is None)  # a serving process checked it
    if turn is not None and store.engine.dialect.name == "sqlite":
        store.write_turn = WriteTurn(turn, loop=True)
    worker = loop_worker(settings, store, lambda run_id, pending: parent.send(link.commands_frame(run_id, pending)))
    worker.start()
    worker.sweep_once()  # what a dead predecessor (or a stopped service) left unjudged
    # As `fp8guard serve` does: what was built so far lives as long as the process, out of the
    # collector's sight, so a full collection does not walk it.
    gc.collect()
    gc.freeze()
    parent.send(link.frame(Kind.READY))
    log.info("judging (database: %s)", store.engine.url.render_as_string(hide_password=True))
    reported: dict[str, float] = {}
    next_report = 0.0
    frames = link.Frames()
    try:
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_report:
                next_report = now + STATS_INTERVAL_S
                counters = {name: getattr(worker.stats, name) for name in LoopStats.COUNTERS}
                if counters != reported:
                    reported = counters
                    parent.send(link.stats_frame(counters))
            if sock is None:
                stop.wait(STATS_INTERVAL_S)
                continue
            readable, _, _ = select.select([sock], [], [], max(0.0, next_report - time.monotonic()))
            if not readable:
                continue
            data = sock.recv(1 << 16)
            if not data:
                break  # the serving process closed its end (shutdown) or exited
            for kind, payload in frames.feed(data):
                if kind is Kind.HELD:
                    run_pk, queue_id, urgent, batch = link.read_held(payload)
                    worker.submit(run_pk, queue_id, batch, urgent=urgent)
                elif kind is Kind.BATCH:
                    run_pk, queue_id, urgent = link.read_batch(payload)
                    worker.submit(run_pk, queue_id, None, urgent=urgent)
                elif kind is Kind.DRAIN:
                    token, timeout = link.read_drain(payload)
                    ok = worker.drain(timeout)
                    parent.send(link.stats_frame({n: getattr(worker.stats, n) for n in LoopStats.COUNTERS}))
                    parent.send(link.drained_frame(token, ok))
    finally:
        if not worker.drain(settings.loop_drain_timeout_s):
            log.warning("not everything was judged in %g s; the rest stays queued", settings.loop_drain_timeout_s)
        worker.close()
        parent.send(link.stats_frame({n: getattr(worker.stats, n) for n in LoopStats.COUNTERS}))
        store.close()
        if sock is not None:
            sock.close()
