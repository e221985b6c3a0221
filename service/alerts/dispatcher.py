"""``AlertDispatcher``: delivers due outbox rows, with retries, from a background thread.

Rows are claimed under a short lease (``store.outbox.claim_due``: disjoint claims across service
processes), then the HTTP requests go out with no transaction open, then each outcome is written
in its own short transaction. Each send first renews its row's lease for one request
(``request_timeout_s`` + ``LEASE_MARGIN_S``), compare-and-set on the lease it holds, so a row
whose lease ran out while earlier rows were sent, and that another process claimed meanwhile, is
left to that process. A process that dies mid-send leaves its row leased for at most that long
(30 s by default; a lease covering a whole batch of sends made it ~6 minutes); then it is due
again (at-least-once delivery, and webhook receivers dedupe on the unchanged ``webhook-id``).
"""

from __future__ import annotations

import logging
import random
import threading
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from sqlalchemy.engine import Engine

from fp8guard.service.alerts.config import AlertSettings
from fp8guard.service.alerts.model import Alert
from fp8guard.service.alerts.sinks import Delivery, build_request, send
from fp8guard.service.store import outbox
from fp8guard.service.store.outbox import OutboxEntry, utc

__all__ = ["LEASE_MARGIN_S", "OUTCOMES", "AlertDispatcher"]

log = logging.getLogger(__name__)

LEASE_MARGIN_S = 15.0
"""Added to ``request_timeout_s`` for a row's lease: room for building the request and writing
the outcome after a send that used its whole timeout."""

OUTCOMES = ("sent", "resent", "resolved", "retry", "failed")
"""``stats()`` keys: first delivery, Alertmanager re-send, Alertmanager resolve, a failure that
will be retried, giving up."""


def _now() -> datetime:
    return datetime.now(UTC)


class AlertDispatcher:
    """Delivers the alert outbox of ``engine`` to the sinks in ``settings``.

    ``run_once()`` does one pass (tests call it directly with an injected ``clock``); ``start()``
    runs passes every ``poll_interval_s`` in a daemon thread until ``stop()``. Rows of sinks that
    are not configured here are left alone, so they survive a configuration mistake.
    """

    def __init__(
        self,
        engine: Engine,
        settings: AlertSettings,
        *,
        client: httpx.Client | None = None,
        clock: Callable[[], datetime] = _now,
        sleep: Callable[[float], object] | None = None,
        rng: random.Random | None = None,
        batch_size: int = 20,
    ) -> None:
        """``client``: an httpx client to send with (owned and closed by ``close()`` when not given).
        ``clock``: current time (tz-aware). ``sleep``: waits between passes of the background thread
        (default: an interruptible wait, so ``stop()`` is immediate). ``rng``: backoff jitter."""
        self._engine = engine
        self._settings = settings
        self._owns_client = client is None
        self._client = client or httpx.Client(timeout=settings.request_timeout_s, follow_redirects=False)
        self._clock = clock
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._batch_size = batch_size
        self._stats: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._postgres = engine.dialect.name == "postgresql"

    @property
    def settings(self) -> AlertSettings:
        return self._settings

    # -- one pass ------------------------------------------------------------------------------

    def run_once(self) -> int:
        """Deliver every row due now (in batches); return how many deliveries were attempted."""
        return self._pass(None)

    def _pass(self, stop: threading.Event | None) -> int:
        names = [s.name for s in self._settings.sinks()]
        if not names:
            return 0
        attempted = 0
        while stop is None or not stop.is_set():
            rows = self._claim(names)
            for row in rows:
                self._deliver(row)
            attempted += len(rows)
            if len(rows) < self._batch_size:
                break
        return attempted

    def _lease(self) -> timedelta:
        return timedelta(seconds=self._settings.request_timeout_s + LEASE_MARGIN_S)

    def _claim(self, names: list[str]) -> list[OutboxEntry]:
        now = utc(self._clock())
        return outbox.claim_due(self._engine, names, now, now + self._lease(), self._batch_size)

    def _deliver(self, row: OutboxEntry) -> None:
        sink = self._settings.sink(row.sink)
        if sink is None:  # reconfigured between claim and send; the lease will expire and retry
            return
        now = utc(self._clock())
        if not outbox.renew(self._engine, row.id, row.next_attempt_at, now + self._lease()):
            return  # its lease ran out while earlier rows were sent, and another process took it
        try:
            delivery = Delivery(
                row_id=row.id, message_id=str(row.payload.get("message_id") or f"msg_fp8guard_{row.id}"),
                alert=Alert.from_json(row.payload["alert"]), created_at=row.created_at,
                active_until=row.active_until,
            )
            request = build_request(sink, delivery, self._settings, now)
        except Exception as exc:  # a corrupt payload can never be sent: give up on it at once
            log.exception("alert outbox row %s cannot be built", row.id)
            self._finish(row, status="failed", error=f"cannot build the request: {exc}"[:1000], outcome="failed")
            return
        result = send(self._client, request, timeout_s=self._settings.request_timeout_s, now=now)
        done = utc(self._clock())
        if result.ok:
            if not request.final:
                self._mark_active(row, done)
            elif row.active_until is not None:
                self._finish(row, status="resolved", error=None, outcome="resolved", sent_at=done)
            else:
                self._finish(row, status="sent", error=None, outcome="sent", sent_at=done)
            return
        attempts = row.attempts + 1
        if result.gone:
            log.warning("alert sink %s answered 410 Gone for row %s: giving up on it; remove the sink "
                        "from the configuration if it is permanently gone", row.sink, row.id)
            self._finish(row, status="failed", error=result.error, outcome="failed", attempts=attempts)
            return
        if attempts >= self._settings.max_attempts:
            log.error("alert row %s to sink %s failed %d times, giving up: %s", row.id, row.sink, attempts,
                      result.error)
            self._finish(row, status="failed", error=result.error, outcome="failed", attempts=attempts)
            return
        delay = self.backoff(attempts)
        if result.retry_after_s is not None:
            delay = max(delay, result.retry_after_s)
        log.info("alert row %s to sink %s failed (%s); retry %d in %.1f s", row.id, row.sink, result.error,
                 attempts, delay)
        outbox.record(self._engine, row.id, attempts=attempts, last_error=(result.error or "")[:1000],
                      next_attempt_at=done + timedelta(seconds=delay))
        self._count(row.sink, "retry")

    def backoff(self, attempts: int) -> float:
        """Delay after the ``attempts``-th failure in a row: base * 2^(n-1), capped, +-20% jitter."""
        base = min(self._settings.backoff_max_s, self._settings.backoff_base_s * 2.0 ** min(attempts - 1, 60))
        return base * self._rng.uniform(0.8, 1.2)

    def _mark_active(self, row: OutboxEntry, now: datetime) -> None:
        # Re-send after resend_interval_s, or at active_until to resolve.
        outbox.record_active(self._engine, row.id, now, now + timedelta(seconds=self._settings.resend_interval_s))
        self._count(row.sink, "resent" if row.status == "sent" else "sent")

    def _finish(self, row: OutboxEntry, *, status: str, error: str | None, outcome: str,
                sent_at: datetime | None = None, attempts: int | None = None) -> None:
        values: dict[str, Any] = {"status": status, "last_error": error}
        if sent_at is not None:
            values["sent_at"] = sent_at
        if attempts is not None:
            values["attempts"] = attempts
        elif status in ("sent", "resolved"):
            values["attempts"] = row.attempts + 1  # terminal: attempts = all tries, this one included
        outbox.record(self._engine, row.id, **values)
        self._count(row.sink, outcome)

    def _count(self, sink: str, outcome: str) -> None:
        with self._lock:
            self._stats[(sink, outcome)] += 1

    # -- observability -------------------------------------------------------------------------

    def stats(self) -> dict[str, dict[str, int]]:
        """Deliveries by sink and outcome since this dispatcher was made (for Prometheus counters),
        e.g. ``{"slack": {"sent": 3, "retry": 1, ...}}``; every configured sink lists every outcome."""
        with self._lock:
            counts = dict(self._stats)
        names = {s.name for s in self._settings.sinks()} | {sink for sink, _ in counts}
        return {name: {o: counts.get((name, o), 0) for o in OUTCOMES} for name in sorted(names)}

    def backlog(self) -> dict[str, dict[str, int]]:
        """Outbox rows by sink and status, read from the database (for gauges)."""
        with self._engine.connect() as conn:
            return outbox.backlog(conn)

    # -- background thread ---------------------------------------------------------------------

    def start(self) -> None:
        """Run ``run_once`` every ``poll_interval_s`` in a daemon thread (no-op if already running)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="fp8guard-alerts", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the thread to stop after its current delivery and wait for it."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("alert dispatcher thread did not stop within %.0f s", timeout)

    def close(self) -> None:
        """Stop, and close the HTTP client if this dispatcher made it."""
        self.stop()
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> AlertDispatcher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._pass(self._stop)
            except Exception:
                # A database hiccup must not kill alerting for the life of the process.
                log.exception("alert dispatcher pass failed; retrying in %.1f s", self._settings.poll_interval_s)
            if self._sleep is not None:
                self._sleep(self._settings.poll_interval_s)
            else:
                self._stop.wait(self._settings.poll_interval_s)
