"""``HttpTransport``: batches to the fp8guard service over HTTP, spooled while it cannot take them."""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import httpx

from fp8guard import wire
from fp8guard.agent.transport.base import RunInfo, TransportStats
from fp8guard.agent.transport.delivery import Answer, Courier, Outcome
from fp8guard.agent.transport.payloads import (
    batch_id_of,
    count_steps,
    int_or,
    remember_tensors,
    with_drop_event,
    with_tensors,
)
from fp8guard.agent.transport.private_dir import (
    UnsafeDirectory,
    default_spool_root,
    ensure_private_dir,
    user_cache_root,
)
from fp8guard.agent.transport.ratelimit import WARN_INTERVAL_S, RateLimiter, suppressed_note
from fp8guard.agent.transport.spool import Spool, SpoolEntry, SpoolFull

__all__ = ["HttpTransport"]

log = logging.getLogger("fp8guard.agent.transport")

_MiB: Final = 1024 * 1024
_PumpState = Literal["idle", "down", "partial", "closing"]


@dataclass(eq=False)
class _Pending:
    """A batch admitted but not yet delivered, refused or spooled; ``seq`` is its place in the order."""

    seq: int
    payload: Mapping[str, Any]
    steps: int
    body: bytes | None = None  # the exact bytes once attempted: a retry or the spool must not differ
    gzipped: bool = False
    claimed: tuple[int, int] | None = None  # the drop report it carries


class HttpTransport:
    """Ships payloads to the fp8guard service over HTTP; survives outages without losing order.

    Example::

        run = RunInfo("gpt-7b-fp8", model="gpt-7b", recipe={"kind": "delayed"}, world_size=8)
        transport = HttpTransport("http://fp8guard:8000", run, token=os.environ["FP8GUARD_TOKEN"],
                                  background=True)
        shipper = Shipper(transport)          # builds payloads on a background thread
        shipper.submit(lambda: wire.make_batch(run_id=run.run_id, steps=[{"step": 0, "loss": 2.5}]))
        shipper.close()                       # flushes, backfills the spool once, closes

    Every payload gets a place in the send order when :meth:`send` admits it, and is delivered
    in that order, from memory or from the spool:

    * ``background=False``: :meth:`send` delivers on the caller's thread and returns after
      delivering, spooling or refusing the batch (at most ``max_attempts`` requests plus
      backoff, or one request while the service is known to be down);
    * ``background=True`` (what the Monitor uses): :meth:`send` never waits for the network.
      A thread of the transport delivers; while it is busy (a hung service answers nothing
      for ``timeout_s`` per attempt) up to ``max_in_memory`` batches wait in memory and the
      rest go straight to the spool, in order. Nothing is dropped because the service is slow.

    Delivery (see :class:`~fp8guard.agent.transport.delivery.Courier`): the run is registered
    first; transient failures are retried with the same bytes; a batch the service refuses for
    what it is (4xx) is dropped, and reported; a refused token (401/403) is logged once and its
    batches spooled. A batch that still fails is spooled to ``spool_dir`` (one gzip file per
    batch, named by its place) and the transport stops trying each batch: it probes again at
    most every ``backoff_max_s`` seconds, and once a probe succeeds it backfills the spool
    oldest first.

    Every loss is counted (``dropped_batches``, ``dropped_steps``) and reported to the service
    by a ``telemetry_dropped`` event (numbers of batches and steps) together with every tensor
    definition seen so far (the lost batches may have held the run's tensor table): on a small
    batch of its own ahead of the backfill, or appended to the next live batch. Losses are:
    the spool bound ``spool_max_bytes`` (0 disables spooling; the oldest files go first), a
    spool that cannot be written, batches the service refused, and what callers report through
    :meth:`report_dropped`.

    ``client`` may be any ``httpx.Client`` (a starlette ``TestClient`` in tests); requests use
    paths relative to its ``base_url`` (absolute ones built from ``url`` if it has none) and its
    own timeouts. It is closed by :meth:`close` only if this transport created it. ``token`` is
    sent as ``Authorization: Bearer`` on every request and never logged.
    ``spool_dir`` defaults to ``<user cache>/fp8guard/spool/<run_id>/rank-<rank>`` (the rank of
    the first payload; ``~/.cache`` on Linux), created private (0700), so neither other users
    nor ranks sharing a host share a spool. ``clock`` is for tests.
    """

    def __init__(
        self,
        url: str,
        run: RunInfo,
        *,
        client: httpx.Client | None = None,
        token: str | None = None,
        timeout_s: float = 10.0,
        max_attempts: int = 4,
        backoff_base_s: float = 0.2,
        backoff_max_s: float = 5.0,
        gzip_min_bytes: int = 4096,
        spool_dir: str | os.PathLike[str] | None = None,
        spool_max_bytes: int = 256 * _MiB,
        background: bool = False,
        max_in_memory: int = 4,
        drain_s: float = 30.0,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_commands: Callable[[list[dict[str, Any]]], None] | None = None,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        if not isinstance(run, RunInfo):
            raise ValueError(f"run must be a RunInfo, got {type(run).__name__}")
        if token is not None and (not isinstance(token, str) or not token.strip() or "\n" in token):
            raise ValueError("token must be a non-empty single-line string (or None)")
        if not _positive(timeout_s):
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts must be an int >= 1 (1 = no retries), got {max_attempts!r}")
        if not _non_negative(backoff_base_s):
            raise ValueError(f"backoff_base_s must be a finite number >= 0, got {backoff_base_s!r}")
        if not _non_negative(backoff_max_s) or backoff_max_s < backoff_base_s:
            raise ValueError(f"backoff_max_s must be a finite number >= backoff_base_s ({backoff_base_s!r}), "
                             f"got {backoff_max_s!r}")
        if isinstance(gzip_min_bytes, bool) or not isinstance(gzip_min_bytes, int) or gzip_min_bytes < 0:
            raise ValueError(f"gzip_min_bytes must be an int >= 0 (0 = always gzip), got {gzip_min_bytes!r}")
        if isinstance(spool_max_bytes, bool) or not isinstance(spool_max_bytes, int) or spool_max_bytes < 0:
            raise ValueError(f"spool_max_bytes must be an int >= 0 (0 = no spooling), got {spool_max_bytes!r}")
        if isinstance(max_in_memory, bool) or not isinstance(max_in_memory, int) or max_in_memory < 1:
            raise ValueError(f"max_in_memory must be an int >= 1, got {max_in_memory!r}")
        if not _positive(drain_s):
            raise ValueError(f"drain_s must be a finite number > 0, got {drain_s!r}")
        if not callable(sleep) or not callable(clock):
            raise ValueError("sleep and clock must be callables")
        # Duck-typed: any client with httpx.Client's post/put works (httpx, or the httpx2 fork
        # that starlette's TestClient switches to when it is installed).
        if client is not None and not all(callable(getattr(client, m, None)) for m in ("post", "put")):
            raise ValueError(f"client must be an httpx.Client-like object (or None), got {type(client).__name__}")

        self._url = url.rstrip("/")
        self._run = run
        self._owns_client = client is None
        self._client = client if client is not None else httpx.Client(base_url=self._url, timeout=timeout_s)
        self._timeout_s = float(timeout_s)
        self._max_attempts = max_attempts
        self._backoff_max_s = float(backoff_max_s)
        self._gzip_min_bytes = gzip_min_bytes
        self._spool_dir_arg = Path(spool_dir) if spool_dir is not None else None
        self._spool_max_bytes = spool_max_bytes
        self._background = bool(background)
        self._max_in_memory = max_in_memory
        self._drain_s = float(drain_s)
        self._clock = clock

        # Two locks: _state guards the bookkeeping and is never held across a request, so send()
        # (admission) never waits for the network; _lock serialises whoever delivers.
        self._state = threading.RLock()
        self._wake = threading.Condition(self._state)
        self._lock = threading.Lock()
        self._stats = TransportStats()
        self._limiter = RateLimiter(WARN_INTERVAL_S, clock)
        self._courier = Courier(
            url=self._url, run=run, client=self._client,
            # A client without base_url cannot resolve "/v1/ingest"; address the service absolutely then.
            prefix="" if str(self._client.base_url) else self._url, token=token,
            stats=self._stats, stats_lock=self._state, backoff_base_s=float(backoff_base_s),
            backoff_max_s=self._backoff_max_s, sleep=sleep, rng=rng if rng is not None else random.Random(),
            limiter=self._limiter, on_commands=on_commands)
        self._closed = False
        self._closing = False
        self._thread: threading.Thread | None = None
        self._outbox: collections.deque[_Pending] = collections.deque()
        self._next_seq = 1
        self._spool: Spool | None = None
        self._spool_unusable = False
        self._default_root: Path | None = None
        self._open = False  # circuit breaker: no request before _next_probe_at while open
        self._down_since: float | None = None
        self._next_probe_at = 0.0
        self._backfilled_since_down = 0
        self._pending_drop = [0, 0]  # batches, steps lost but not yet reported to the service
        # Every tensor definition seen, by index: if the batch that defined them is lost, later
        # stats blocks would be refused (422) for the rest of the run, so after a drop the table
        # is sent again with the drop report.
        self._tensor_table: dict[int, dict[str, Any]] = {}
        self._resend_tensors = False
        self._last_rank = 0
        self._last_segment = 0
        self._seen_payload = False

    # ------------------------------------------------------------------ public API

    @property
    def run(self) -> RunInfo:
        return self._run

    @property
    def spool_dir(self) -> Path | None:
        """Where batches are spooled; ``None`` while the default one waits for the first payload's rank."""
        if self._spool is not None:
            return self._spool.directory
        if self._spool_dir_arg is not None:
            return self._spool_dir_arg
        if not self._seen_payload:
            return None
        root = self._default_root or user_cache_root() / "spool"
        return root / self._run.run_id / f"rank-{self._last_rank}"

    def send(self, payload: dict[str, Any]) -> None:
        """Admit one batch: deliver it (``background=False``) or hand it to the transport's thread;
        spool it if it cannot go now; drop (and report) it only if the payload itself is wrong.
        Never raises."""
        try:
            with self._state:
                queued = self._admit(payload)
                if queued and self._background:
                    self._start_thread()
                    self._wake.notify_all()
            if queued and not self._background:
                with self._lock:
                    self._pump(deadline=self._clock() + self._timeout_s)
                    with self._state:
                        self._spill_outbox()  # still down, or catching up: behind the spool, in order
        except Exception:
            # A bug of ours, or a hostile client: lose this batch rather than the training run.
            with self._state:
                self._count_dropped(count_steps(payload), (0, 0))
            if (suppressed := self._limiter.allow("internal")) is not None:
                log.exception("fp8guard transport: unexpected error, batch %s dropped%s", batch_id_of(payload),
                              suppressed_note(suppressed))

    def report_dropped(self, batches: int, steps: int) -> None:
        """Count telemetry the caller lost before it reached this transport (a full queue upstream);
        the next batch that reaches the service reports it."""
        with self._state:
            self._stats.dropped_batches += batches
            self._stats.dropped_steps += steps
            self._pending_drop[0] += batches
            self._pending_drop[1] += steps

    def close(self) -> None:
        """Deliver what waits (up to ``drain_s``; each spooled file one attempt), report telemetry
        still known lost, and close the client if this transport created it. Idempotent."""
        with self._state:
            if self._closing:
                return
            self._closing = True
            self._wake.notify_all()
            thread = self._thread
        deadline = self._clock() + self._drain_s
        if thread is not None:
            thread.join(self._drain_s)
            if thread.is_alive():
                # Stuck in a request to a hung service: keep everything for the next process.
                with self._state:
                    self._closed = True
                    self._spill_outbox()
                log.warning("fp8guard: the service at %s did not answer within %.0f s; %d batches stay spooled "
                            "in %s for the next transport on this spool_dir", self._url, self._drain_s,
                            len(self._spool) if self._spool is not None else 0, self.spool_dir)
                return
        with self._lock:
            try:
                with self._state:
                    self._closed = True
                    self._next_probe_at = self._clock()  # one last try, whatever the breaker says
                # The usual retries (a service catching up after a stall answers slowly), but
                # never past the deadline: close() costs at most drain_s plus one request.
                state = self._pump(deadline=deadline, strict_deadline=True)
                with self._state:
                    self._spill_outbox()
                if state == "idle" and self._pending_drop[0] and self._seen_payload:
                    self._send_report(attempts=1)  # no later batch will carry it
                spool = self._spool
                if spool is not None and len(spool):
                    log.warning("fp8guard: %d batches remain spooled in %s; they are sent by the next "
                                "transport on this spool_dir", len(spool), spool.directory)
            except Exception:
                log.exception("fp8guard transport: error while closing")
            finally:
                if self._owns_client:
                    self._client.close()

    def stats(self) -> TransportStats:
        with self._state:
            return dataclasses.replace(self._stats)

    # ------------------------------------------------------------------ admission (caller's thread)

    def _admit(self, payload: Mapping[str, Any]) -> bool:
        """Give the payload its place; True if it waits in memory for delivery, False if it went
        to the spool (or was refused)."""
        if not isinstance(payload, Mapping):
            self._stats.rejected_batches += 1
            log.error("dropping a %s: a payload must be a dict built by fp8guard.wire.make_batch",
                      type(payload).__name__)
            return False
        self._seen_payload = True
        remember_tensors(self._tensor_table, payload)
        self._last_rank = int_or(payload.get("rank"), self._last_rank)
        self._last_segment = int_or(payload.get("segment"), self._last_segment)
        seq = self._take_seq()
        if self._closed:
            # The client may be closed already; keep the data for the next process.
            self._spool_payload(payload, seq)
            return False
        if self._background and (self._open or len(self._outbox) >= self._max_in_memory):
            # The delivering thread is busy (or the service down): to disk, never dropped.
            self._spool_payload(payload, seq)
            return False
        self._outbox.append(_Pending(seq, payload, count_steps(payload)))
        return True

    def _take_seq(self) -> int:
        spool = self._open_spool()
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
                    wait = self._next_probe_at - self._clock() if self._open and self._has_items() else None
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
        return bool(self._outbox) or (self._spool is not None and len(self._spool) > 0)

    def _ready(self) -> bool:
        return self._has_items() and not (self._open and self._clock() < self._next_probe_at)

    def _pump(self, *, deadline: float | None, strict_deadline: bool = False) -> _PumpState:
        """Deliver waiting batches in order (memory and spool together) until none is left, the
        service fails, ``deadline`` passes (checked between batches, and from the first batch on
        with ``strict_deadline``) or close() begins."""
        first = not strict_deadline
        while True:
            with self._state:
                if self._closing and not self._closed:
                    return "closing"  # close() takes over
                if self._open and self._clock() < self._next_probe_at:
                    return "down"
                item = self._outbox[0] if self._outbox else None
                entry = self._spool.oldest() if self._spool is not None else None
                if item is None and entry is None:
                    return "idle"
                if not first and deadline is not None and self._clock() >= deadline:
                    return "partial"
                tries = 1 if self._open else self._max_attempts
                if entry is not None and (item is None or entry.seq < item.seq):
                    item = None
                    report_first = bool(self._pending_drop[0] or (self._resend_tensors and self._tensor_table))
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

    def _deliver_item(self, item: _Pending, *, attempts: int, deadline: float | None) -> Outcome:
        with self._state:
            if item.body is None and not self._prepare(item):
                return Outcome.REJECTED
            body = item.body
            assert body is not None
        answer = self._courier.deliver(body, gzipped=item.gzipped, batch_id=batch_id_of(item.payload),
                                       attempts=attempts, deadline=deadline, clock=self._clock,
                                       spool_note=self._spool_note())
        outcome = answer.outcome
        if outcome is Outcome.REJECTED:
            self._log_refusal(batch_id_of(item.payload), answer)
        with self._state:
            if item not in self._outbox:
                return outcome  # close() spooled it meanwhile; a duplicate is harmless
            self._outbox.remove(item)
            if outcome is Outcome.DELIVERED:
                self._answered()
            elif outcome is Outcome.REJECTED:
                self._open = False  # it answered: the service is reachable
                self._unclaim(item.claimed)
                self._count_dropped(item.steps, (0, 0), resend_tensors=False)
            else:
                self._trip()
                # The exact JSON that was attempted (drop event included): the service may have
                # stored it without us hearing back, and a retry must not differ.
                self._spool_item(item)
        return outcome

    def _prepare(self, item: _Pending) -> bool:
        """Serialise an item for its first attempt, carrying the pending drop report."""
        payload = item.payload
        claimed = self._claim_drop_report()
        if claimed is not None:
            payload = with_drop_event(payload, claimed)
        with_table = self._resend_tensors and bool(self._tensor_table)
        if with_table:
            payload = with_tensors(payload, self._tensor_table)
        body = self._serialise(payload)
        if body is None:
            self._outbox.remove(item)
            self._unclaim(claimed)
            self._count_dropped(item.steps, (0, 0), resend_tensors=False)
            return False
        if with_table:
            # Not re-attached after a refusal either: if the table caused it (409), that would loop.
            self._resend_tensors = False
        item.gzipped = len(body) >= self._gzip_min_bytes
        item.body = wire.gzip_body(body, level=1) if item.gzipped else body
        item.claimed = claimed
        return True

    def _send_report(self, *, attempts: int) -> Outcome:
        """A batch of its own with the drop report and the tensor table (never spooled)."""
        with self._state:
            report: Mapping[str, Any] = wire.make_batch(run_id=self._run.run_id, rank=self._last_rank,
                                                        segment=self._last_segment)
            claimed = self._claim_drop_report()
            if claimed is not None:
                report = with_drop_event(report, claimed)
            with_table = self._resend_tensors and bool(self._tensor_table)
            if with_table:
                report = with_tensors(report, self._tensor_table)
                self._resend_tensors = False
            body = self._serialise(report)
        answer = Answer(Outcome.REJECTED) if body is None else self._courier.deliver(
            body, gzipped=False, batch_id=batch_id_of(report), attempts=attempts, clock=self._clock,
            spool_note=self._spool_note())
        outcome = answer.outcome
        if outcome is Outcome.REJECTED and body is not None:
            self._log_refusal(batch_id_of(report), answer)
        with self._state:
            if outcome is Outcome.DELIVERED:
                self._answered()
                return outcome
            self._unclaim(claimed)
            if outcome is Outcome.FAILED:
                self._resend_tensors |= with_table
                self._trip()
            else:
                self._open = False
        return outcome

    def _backfill_one(self, entry: SpoolEntry, *, attempts: int, deadline: float | None) -> Outcome:
        spool = self._spool
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
                self._count_dropped(entry.steps or 0, entry.carried or (0, 0))
            return Outcome.REJECTED
        answer = self._courier.deliver(data, gzipped=True, batch_id=f"spool:{entry.path.name}",
                                       attempts=attempts, deadline=deadline, clock=self._clock,
                                       spool_note=self._spool_note())
        outcome = answer.outcome
        if outcome is Outcome.REJECTED:
            self._log_refusal(f"spool:{entry.path.name}", answer)
        with self._state:
            if outcome is Outcome.FAILED:
                self._trip()
                return outcome
            if outcome is Outcome.DELIVERED:
                self._stats.backfilled_batches += 1
                self._backfilled_since_down += 1
            else:
                # Refused (a stale run, a truncated file): its data and the drop report it carried are lost.
                steps, carried = spool.describe(entry)
                self._unclaim(carried)
                self._count_dropped(steps, (0, 0), resend_tensors=False)
            spool.remove(entry)
            self._answered()
        return outcome

    def _answered(self) -> None:
        """The service answered: close the breaker; once nothing waits, the outage is over."""
        self._open = False
        if not self._outbox and (self._spool is None or not len(self._spool)):
            self._mark_up()

    def _log_refusal(self, batch_id: str, answer: Answer) -> None:
        if (suppressed := self._limiter.allow(f"reject:{answer.status}")) is not None:
            log.error("fp8guard: the service refused batch %s with %s, dropping it (reported as "
                      "telemetry_dropped)%s", batch_id, answer.reason, suppressed_note(suppressed))

    def _spool_note(self) -> str:
        where = self.spool_dir if self._spool_max_bytes and not self._spool_unusable else None
        return f" in the spool {where}" if where is not None else " (no spool: lost)"

    def _serialise(self, payload: Mapping[str, Any]) -> bytes | None:
        try:
            return wire.dumps(payload)
        except (TypeError, ValueError) as exc:
            self._stats.rejected_batches += 1
            log.error("fp8guard: dropping batch %s: not serialisable as wire JSON (%s); non-finite "
                      "floats must be encoded with fp8guard.wire.encode_float", batch_id_of(payload), exc)
            return None

    # ------------------------------------------------------------------ circuit breaker

    def _trip(self) -> None:
        """Open the breaker: until the next probe, batches go straight to the spool."""
        now = self._clock()
        first = self._down_since is None
        self._open = True
        if self._down_since is None:
            self._down_since = now
            self._backfilled_since_down = 0
            self._limiter.reset("down")  # every outage logs its first failure
        self._next_probe_at = now + self._backoff_max_s
        if self._courier.auth_refused:
            return  # the courier said why, once; "unreachable" would mislead
        if self._limiter.allow("down") is None:
            return
        if first:
            where = self.spool_dir if self._spool_max_bytes and not self._spool_unusable else None
            log.warning("fp8guard service at %s unreachable (%s); %s, probing again every %.1f s", self._url,
                        self._courier.last_failure,
                        f"spooling batches to {where}" if where else "dropping batches (no spool)",
                        self._backoff_max_s)
        else:
            log.warning("fp8guard service at %s still unreachable after %.0f s (%s); %d batches spooled, "
                        "%d dropped", self._url, now - self._down_since, self._courier.last_failure,
                        len(self._spool) if self._spool is not None else 0, self._stats.dropped_batches)

    def _mark_up(self) -> None:
        if self._down_since is not None:
            log.info("fp8guard service at %s reachable again after %.0f s; %d spooled batches backfilled",
                     self._url, self._clock() - self._down_since, self._backfilled_since_down)
            self._down_since = None

    # ------------------------------------------------------------------ spool

    def _open_spool(self) -> Spool | None:
        if self._spool is not None or self._spool_unusable or self._spool_max_bytes == 0:
            return self._spool
        if self._spool_dir_arg is None and self._seen_payload and self._default_root is None:
            try:
                self._default_root = default_spool_root()
            except OSError as exc:
                self._spool_unusable = True
                log.error("fp8guard: no private spool folder (%s); batches that cannot be delivered are "
                          "dropped (and reported); pass spool_dir= to choose one", exc)
                return None
        directory = self.spool_dir
        if directory is None:
            return None
        make_dir = None
        if self._default_root is not None and self._spool_dir_arg is None:
            root = self._default_root.parent

            def make_dir(d: Path) -> None:
                ensure_private_dir(root, d)
        try:
            self._spool = Spool(directory, self._spool_max_bytes, make_dir=make_dir, run=self._run)
        except OSError as exc:
            self._spool_unusable = True
            log.warning("fp8guard: cannot use spool directory %s (%s); batches that cannot be delivered "
                        "are dropped", directory, exc)
        return self._spool

    def _spill_outbox(self) -> None:
        """Move every batch waiting in memory to the spool, each at its own place."""
        while self._outbox:
            self._spool_item(self._outbox.popleft())

    def _spool_item(self, item: _Pending) -> None:
        if item.body is None:
            self._spool_payload(item.payload, item.seq)
            return
        gz = item.body if item.gzipped else wire.gzip_body(item.body, level=1)
        self._spool_bytes(gz, seq=item.seq, steps=item.steps, carried=item.claimed or (0, 0))

    def _spool_payload(self, payload: Mapping[str, Any], seq: int) -> None:
        body = self._serialise(payload)
        if body is None:
            self._count_dropped(count_steps(payload), (0, 0), resend_tensors=False)
        else:
            self._spool_bytes(wire.gzip_body(body, level=1), seq=seq, steps=count_steps(payload), carried=(0, 0))

    def _spool_bytes(self, gz: bytes, *, seq: int, steps: int, carried: tuple[int, int]) -> None:
        spool = self._open_spool()
        if spool is None:
            self._count_dropped(steps, carried)
            return
        try:
            evicted = spool.add(gz, seq=seq, steps=steps, carried=carried)
        except SpoolFull:
            self._count_dropped(steps, carried)
            return
        except OSError as exc:
            self._count_dropped(steps, carried)
            if isinstance(exc, UnsafeDirectory):
                self._spool_unusable = True
            if (suppressed := self._limiter.allow("spool-write")) is not None:
                log.warning("fp8guard: cannot write to spool %s (%s); batch dropped%s", spool.directory, exc,
                            suppressed_note(suppressed))
            return
        self._stats.spooled_batches += 1
        for entry in evicted:
            entry_steps, entry_carried = spool.describe(entry)
            self._count_dropped(entry_steps, entry_carried)
        if evicted and (suppressed := self._limiter.allow("spool-full")) is not None:
            log.warning("fp8guard: spool %s is full (%d bytes); dropped the oldest batches (%d so far)%s",
                        spool.directory, self._spool_max_bytes, self._stats.dropped_batches,
                        suppressed_note(suppressed))

    # ------------------------------------------------------------------ drop reports

    def _count_dropped(self, steps: int, carried: tuple[int, int], *, resend_tensors: bool = True) -> None:
        """One batch lost for good: counted, and reported by a later batch. ``resend_tensors``:
        it may have held the tensor table (not after a refusal: the table may be why)."""
        self._stats.dropped_batches += 1
        self._stats.dropped_steps += steps
        # A lost batch that carried an earlier drop report loses that report too: fold it back in.
        self._pending_drop[0] += 1 + carried[0]
        self._pending_drop[1] += steps + carried[1]
        self._resend_tensors |= resend_tensors

    def _claim_drop_report(self) -> tuple[int, int] | None:
        if not self._pending_drop[0]:
            return None
        claimed = (self._pending_drop[0], self._pending_drop[1])
        self._pending_drop = [0, 0]
        return claimed

    def _unclaim(self, claimed: tuple[int, int] | None) -> None:
        if claimed is not None:
            self._pending_drop[0] += claimed[0]
            self._pending_drop[1] += claimed[1]


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _non_negative(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
