"""``Link``: opaque batches to the service in order, from memory or the spool, through outages.

The link never parses nor rewrites a payload: it ships the bytes a
:class:`~fp8guard.agent.transport.letters.Letter` seals, and tells its
:class:`~fp8guard.agent.transport.letters.Ledger` every loss, so the payload side can report it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from fp8guard import wire
from fp8guard.agent.transport.base import RunInfo, TransportStats
from fp8guard.agent.transport.breaker import Breaker
from fp8guard.agent.transport.delivery import Answer, Courier, Outcome
from fp8guard.agent.transport.letters import Ledger, Letter
from fp8guard.agent.transport.private_dir import UnsafeDirectory
from fp8guard.agent.transport.ratelimit import WARN_INTERVAL_S, RateLimiter, suppressed_note
from fp8guard.agent.transport.spool import SpoolEntry, SpoolFull
from fp8guard.agent.transport.spool_site import SpoolSite

__all__ = ["Link", "LinkSettings"]

log = logging.getLogger("fp8guard.agent.transport")

_PumpState = Literal["idle", "down", "partial", "closing"]


@dataclass(frozen=True)
class LinkSettings:
    """Validated by :class:`~fp8guard.agent.transport.http.HttpTransport`, which documents them."""

    url: str
    timeout_s: float
    max_attempts: int
    backoff_base_s: float
    backoff_max_s: float
    gzip_min_bytes: int
    spool_dir: Path | None
    spool_max_bytes: int
    background: bool
    max_in_memory: int
    drain_s: float


@dataclass(eq=False)
class _Pending:
    """A batch admitted but not yet delivered, refused or spooled; ``seq`` is its place in the order."""

    seq: int
    letter: Letter
    body: bytes | None = None  # the exact bytes once attempted: a retry or the spool must not differ
    gzipped: bool = False
    claimed: tuple[int, int] | None = None  # the drop report it carries


class Link:
    """Delivers letters in admission order (see :class:`~fp8guard.agent.transport.http.HttpTransport`
    for the behaviour): retries through the :class:`Courier`, a :class:`Breaker` while the service
    is down, the spool behind, a backfill once it answers again."""

    def __init__(self, settings: LinkSettings, run: RunInfo, ledger: Ledger, *, client: httpx.Client | None,
                 token: str | None, sleep: Callable[[float], None], rng: random.Random,
                 clock: Callable[[], float],
                 on_commands: Callable[[list[dict[str, Any]]], None] | None) -> None:
        self._s = settings
        self._url = settings.url
        self._ledger = ledger
        self._owns_client = client is None
        self._client = client if client is not None else httpx.Client(base_url=self._url, timeout=settings.timeout_s)
        self._clock = clock
        # Two locks: _state guards the bookkeeping and is never held across a request, so admit()
        # never waits for the network; _lock serialises whoever delivers.
        self._state = threading.RLock()
        self._wake = threading.Condition(self._state)
        self._lock = threading.Lock()
        self._stats = TransportStats()
        self._limiter = RateLimiter(WARN_INTERVAL_S, clock)
        self._courier = Courier(
            url=self._url, run=run, client=self._client,
            # A client without base_url cannot resolve "/v1/ingest"; address the service absolutely then.
            prefix="" if str(self._client.base_url) else self._url, token=token,
            backoff_base_s=settings.backoff_base_s, backoff_max_s=settings.backoff_max_s, sleep=sleep, rng=rng,
            limiter=self._limiter)
        self._on_commands = on_commands
        self._breaker = Breaker(url=self._url, probe_s=settings.backoff_max_s, clock=clock, limiter=self._limiter)
        self._site = SpoolSite(run, settings.spool_dir, settings.spool_max_bytes)
        self._closed = False
        self._closing = False
        self._thread: threading.Thread | None = None
        self._outbox: collections.deque[_Pending] = collections.deque()
        self._next_seq = 1
        self._rank: int | None = None  # the rank of the latest batch (None before the first)

    @property
    def spool_dir(self) -> Path | None:
        return self._site.directory(self._rank)

    def admit(self, letter: Letter, *, rank: int) -> None:
        """Give the letter its place; deliver it now (``background=False``) or wake the thread."""
        with self._state:
            queued = self._admit(letter, rank)
            if queued and self._s.background:
                self._start_thread()
                self._wake.notify_all()
        if queued and not self._s.background:
            with self._lock:
                self._pump(deadline=self._clock() + self._s.timeout_s)
                with self._state:
                    self._spill_outbox()  # still down, or catching up: behind the spool, in order

    def count_rejected(self) -> None:
        """A batch refused before admission (not a payload at all)."""
        with self._state:
            self._stats.rejected_batches += 1

    def lose(self, steps: int) -> None:
        """A batch lost to an error of ours before it could be admitted."""
        with self._state:
            self._lose(steps, (0, 0), refused=False)

    def count_dropped(self, batches: int, steps: int) -> None:
        """Telemetry lost upstream (the ledger reports it; the link only counts it)."""
        with self._state:
            self._stats.dropped_batches += batches
            self._stats.dropped_steps += steps

    def stats(self) -> TransportStats:
        with self._state:
            return dataclasses.replace(self._stats)

    def close(self) -> None:
        """Deliver what waits (up to ``drain_s``; each spooled file one attempt), report telemetry
        still known lost, and close the client if the link created it. Idempotent."""
        with self._state:
            if self._closing:
                return
            self._closing = True
            self._wake.notify_all()
            thread = self._thread
        deadline = self._clock() + self._s.drain_s
        if thread is not None:
            thread.join(self._s.drain_s)
            if thread.is_alive():
                # Stuck in a request to a hung service: keep everything for the next process.
                with self._state:
                    self._closed = True
                    self._spill_outbox()
                log.warning("fp8guard: the service at %s did not answer within %.0f s; %d batches stay spooled "
                            "in %s for the next transport on this spool_dir (or fp8guard spool flush)", self._url,
                            self._s.drain_s, self._site.count(), self.spool_dir)
                return
        with self._lock:
            try:
                with self._state:
                    self._closed = True
                    self._breaker.probe_now()  # one last try, whatever the breaker says
                # The usual retries (a service catching up after a stall answers slowly), but
                # never past the deadline: close() costs at most drain_s plus one request.
                state = self._pump(deadline=deadline, strict_deadline=True)
                with self._state:
                    self._spill_outbox()
                if state == "idle" and self._ledger.has_drops():
                    self._send_report(attempts=1)  # no later batch will carry it
                if self._site.count():
                    log.warning("fp8guard: %d batches remain spooled in %s; they are sent by the next transport "
                                "on this spool_dir, or by fp8guard spool flush", self._site.count(), self.spool_dir)
            except Exception:
                log.exception("fp8guard transport: error while closing")
            finally:
                if self._owns_client:
                    self._client.close()

    # ------------------------------------------------------------------ admission (caller's thread)

    def _admit(self, letter: Letter, rank: int) -> bool:
        """True if the letter waits in memory for delivery, False if it went to the spool."""
        self._rank = rank
        seq = self._take_seq()
        if self._closed:
            # The client may be closed already; keep the data for the next process.
            self._spool_plain(letter, seq)
            return False
        if self._s.background and (self._breaker.open or len(self._outbox) >= self._s.max_in_memory):
            # The delivering thread is busy (or the service down): to disk, never dropped.
            self._spool_plain(letter, seq)
            return False
        self._outbox.append(_Pending(seq, letter))
        return True

    def _take_seq(self) -> int:
        spool = self._site.open(self._rank)
        if spool is not None:
            self._next_seq = max(self._next_seq, spool.next_seq)
        seq = self._next_seq
        self._next_seq += 1
        if spool is not None:
            spool.next_seq = self._next_seq
        return seq

    # ------------------------------------------------------------------ delivery (one thread at a time)

    def _start_thread(self) -> None:
        if self._thread is None and not self._closing:
            self._thread = threading.Thread(target=self._run_thread, name="fp8guard-transport", daemon=True)
            self._thread.start()

    def _run_thread(self) -> None:
        while True:
            with self._wake:
                while not self._closing and not self._ready():
                    wait = (self._breaker.next_probe_at - self._clock()
                            if self._breaker.open and self._has_items() else None)
                    self._wake.wait(wait if wait is None else max(wait, 0.001))
                if self._closing:
                    return
            try:
                with self._lock:
                    if self._pump(deadline=None) == "down":
                        with self._state:
                            self._spill_outbox()
            except Exception:
                log.exception("fp8guard transport: delivery thread error; carrying on")
                time.sleep(0.1)

    def _has_items(self) -> bool:
        return bool(self._outbox) or self._site.count() > 0

    def _ready(self) -> bool:
        return self._has_items() and not self._breaker.waiting()

    def _pump(self, *, deadline: float | None, strict_deadline: bool = False) -> _PumpState:
        """Deliver waiting batches in order (memory and spool together) until none is left, the
        service fails, ``deadline`` passes (checked between batches, and from the first batch on
        with ``strict_deadline``) or close() begins."""
        first = not strict_deadline
        while True:
            with self._state:
                if self._closing and not self._closed:
                    return "closing"  # close() takes over
                if self._breaker.waiting():
                    return "down"
                item = self._outbox[0] if self._outbox else None
                spool = self._site.spool
                entry = spool.oldest() if spool is not None else None
                if item is None and entry is None:
                    return "idle"
                if not first and deadline is not None and self._clock() >= deadline:
                    return "partial"
                tries = 1 if self._breaker.open else self._s.max_attempts
                if entry is not None and (item is None or entry.seq < item.seq):
                    item = None
                    report_first = self._ledger.report_due()
                else:
                    entry, report_first = None, False
            if report_first:
                # Batches were lost: before the survivors, a small batch reports the gap and re-sends
                # the tensor table (the lost batches may have held it; the survivors' stats need it).
                if self._send_report(attempts=tries) is Outcome.FAILED:
                    return "down"
            elif entry is not None:
                if self._backfill_one(entry, attempts=tries, deadline=None if first else deadline) is Outcome.FAILED:
                    return "down"
            elif item is not None and self._deliver_item(item, attempts=tries,
                                                         deadline=None if first else deadline) is Outcome.FAILED:
                return "down"
            first = False

    def _deliver(self, body: bytes, *, gzipped: bool, label: str, attempts: int,
                 deadline: float | None = None) -> Outcome:
        answer = self._courier.deliver(body, gzipped=gzipped, batch_id=label, attempts=attempts, deadline=deadline,
                                       clock=self._clock, spool_note=self._spool_note())
        with self._state:
            self._stats.retries += answer.retries
            if answer.outcome is Outcome.DELIVERED:
                self._stats.sent_batches += 1
                self._stats.bytes_sent += len(body)
                self._stats.duplicate_batches += answer.duplicate
            elif answer.outcome is Outcome.REJECTED:
                self._stats.rejected_batches += 1
        if answer.outcome is Outcome.REJECTED:
            self._log_refusal(label, answer)
        if answer.commands and self._on_commands is not None:
            try:  # remediation commands ride on ingest answers; hand them to the monitor
                self._on_commands(answer.commands)
            except Exception:
                log.exception("fp8guard: handling commands from the service failed")
        return answer.outcome

    def _deliver_item(self, item: _Pending, *, attempts: int, deadline: float | None) -> Outcome:
        with self._state:
            if item.body is None and not self._prepare(item):
                return Outcome.REJECTED
            body = item.body
            assert body is not None
        outcome = self._deliver(body, gzipped=item.gzipped, label=item.letter.label, attempts=attempts,
                                deadline=deadline)
        with self._state:
            if item not in self._outbox:
                return outcome  # close() spooled it meanwhile; a duplicate is harmless
            self._outbox.remove(item)
            if outcome is Outcome.DELIVERED:
                self._answered()
            elif outcome is Outcome.REJECTED:
                self._breaker.answered()  # it answered: the service is reachable
                self._ledger.returned(item.claimed)
                self._lose(item.letter.steps, (0, 0), refused=True)
            else:
                self._trip()
                # The exact bytes that were attempted (drop report included): the service may have
                # stored them without us hearing back, and a retry must not differ.
                self._spool_item(item)
        return outcome

    def _prepare(self, item: _Pending) -> bool:
        """Seal an item for its first attempt (the ledger adds any pending drop report)."""
        sealed = item.letter.seal()
        if sealed is None:
            self._outbox.remove(item)
            self._stats.rejected_batches += 1
            self._lose(item.letter.steps, (0, 0), refused=True)
            return False
        item.gzipped = len(sealed.body) >= self._s.gzip_min_bytes
        item.body = wire.gzip_body(sealed.body, level=1) if item.gzipped else sealed.body
        item.claimed = sealed.claimed
        return True

    def _send_report(self, *, attempts: int) -> Outcome:
        """A batch of its own with the drop report and the tensor table (never spooled)."""
        with self._state:
            sealed = self._ledger.report()
            if sealed is None:
                self._stats.rejected_batches += 1
        outcome = Outcome.REJECTED if sealed is None else self._deliver(
            sealed.body, gzipped=False, label="drop-report", attempts=attempts)
        with self._state:
            if outcome is Outcome.DELIVERED:
                self._answered()
                return outcome
            if sealed is not None:
                self._ledger.returned(sealed.claimed, with_table=sealed.with_table and outcome is Outcome.FAILED)
            if outcome is Outcome.FAILED:
                self._trip()
            else:
                self._breaker.answered()
        return outcome

    def _backfill_one(self, entry: SpoolEntry, *, attempts: int, deadline: float | None) -> Outcome:
        spool = self._site.spool
        assert spool is not None
        try:
            data = spool.read(entry)
        except FileNotFoundError:
            with self._state:
                spool.remove(entry)  # another transport on this spool_dir sent it already
            return Outcome.DELIVERED
        except OSError as exc:
            log.warning("fp8guard: cannot read spooled batch %s (%s); dropping it", entry.path, exc)
            with self._state:
                spool.remove(entry)
                self._lose(entry.steps or 0, entry.carried or (0, 0), refused=False)
            return Outcome.REJECTED
        outcome = self._deliver(data, gzipped=True, label=f"spool:{entry.path.name}", attempts=attempts,
                                deadline=deadline)
        with self._state:
            if outcome is Outcome.FAILED:
                self._trip()
                return outcome
            if outcome is Outcome.DELIVERED:
                self._stats.backfilled_batches += 1
                self._breaker.backfilled()
            else:
                # Refused (a stale run, a truncated file): its data and the drop report it carried are lost.
                steps, carried = spool.describe(entry)
                self._ledger.returned(carried)
                self._lose(steps, (0, 0), refused=True)
            spool.remove(entry)
            self._answered()
        return outcome

    def _answered(self) -> None:
        """The service answered: close the breaker; once nothing waits, the outage is over."""
        self._breaker.answered()
        if not self._outbox and not self._site.count():
            self._breaker.recovered()

    def _trip(self) -> None:
        self._breaker.trip(reason=self._courier.last_failure, auth_refused=self._courier.auth_refused,
                           spooling_to=self._site.usable_directory(self._rank), spooled=self._site.count(),
                           dropped=self._stats.dropped_batches)

    def _log_refusal(self, label: str, answer: Answer) -> None:
        if (suppressed := self._limiter.allow(f"reject:{answer.status}")) is not None:
            log.error("fp8guard: the service refused batch %s with %s, dropping it (reported as "
                      "telemetry_dropped)%s", label, answer.reason, suppressed_note(suppressed))

    def _spool_note(self) -> str:
        where = self._site.usable_directory(self._rank)
        return f" in the spool {where}" if where is not None else " (no spool: lost)"

    # ------------------------------------------------------------------ spool

    def _spill_outbox(self) -> None:
        """Move every batch waiting in memory to the spool, each at its own place."""
        while self._outbox:
            self._spool_item(self._outbox.popleft())

    def _spool_item(self, item: _Pending) -> None:
        if item.body is None:
            self._spool_plain(item.letter, item.seq)
            return
        gz = item.body if item.gzipped else wire.gzip_body(item.body, level=1)
        self._spool_bytes(gz, seq=item.seq, steps=item.letter.steps, carried=item.claimed or (0, 0))

    def _spool_plain(self, letter: Letter, seq: int) -> None:
        body = letter.plain()
        if body is None:
            self._stats.rejected_batches += 1
            self._lose(letter.steps, (0, 0), refused=True)
        else:
            self._spool_bytes(wire.gzip_body(body, level=1), seq=seq, steps=letter.steps, carried=(0, 0))

    def _spool_bytes(self, gz: bytes, *, seq: int, steps: int, carried: tuple[int, int]) -> None:
        spool = self._site.open(self._rank)
        if spool is None:
            self._lose(steps, carried, refused=False)
            return
        try:
            evicted = spool.add(gz, seq=seq, steps=steps, carried=carried)
        except SpoolFull:
            self._lose(steps, carried, refused=False)
            return
        except OSError as exc:
            self._lose(steps, carried, refused=False)
            if isinstance(exc, UnsafeDirectory):
                self._site.unusable = True
            if (suppressed := self._limiter.allow("spool-write")) is not None:
                log.warning("fp8guard: cannot write to spool %s (%s); batch dropped%s", spool.directory, exc,
                            suppressed_note(suppressed))
            return
        self._stats.spooled_batches += 1
        for entry in evicted:
            entry_steps, entry_carried = spool.describe(entry)
            self._lose(entry_steps, entry_carried, refused=False)
        if evicted and (suppressed := self._limiter.allow("spool-full")) is not None:
            log.warning("fp8guard: spool %s is full (%d bytes); dropped the oldest batches (%d so far)%s",
                        spool.directory, self._s.spool_max_bytes, self._stats.dropped_batches,
                        suppressed_note(suppressed))

    def _lose(self, steps: int, carried: tuple[int, int], *, refused: bool) -> None:
        """One batch lost for good: counted here, reported by the ledger on a later batch."""
        self._stats.dropped_batches += 1
        self._stats.dropped_steps += steps
        self._ledger.lost(steps, carried, refused=refused)
