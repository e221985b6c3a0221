"""``HttpTransport``: batches to the fp8guard service over HTTP, spooled while it cannot take them."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from enum import Enum
from pathlib import Path
from typing import Any, Final

import httpx

from fp8guard import wire
from fp8guard.agent.transport.base import RunInfo, TransportStats
from fp8guard.agent.transport.payloads import (
    batch_id_of,
    count_steps,
    int_or,
    remember_tensors,
    with_drop_event,
    with_tensors,
)
from fp8guard.agent.transport.ratelimit import WARN_INTERVAL_S, RateLimiter, suppressed_note
from fp8guard.agent.transport.responses import describe_exception, error_detail, retry_after_s
from fp8guard.agent.transport.spool import Spool, SpoolFull

__all__ = ["HttpTransport"]

log = logging.getLogger("fp8guard.agent.transport")

_MiB: Final = 1024 * 1024


class _Outcome(Enum):
    DELIVERED = "delivered"  # stored, or a duplicate of a stored batch
    REJECTED = "rejected"  # the service refused the payload itself: never retry it
    FAILED = "failed"  # transient trouble outlasted the attempts: keep the payload


class _Retryable(Exception):
    """A transient failure inside one attempt (registration refused with 5xx, ...)."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


class HttpTransport:
    """Ships payloads to the fp8guard service over HTTP; survives outages without losing order.

    Example::

        run = RunInfo("gpt-7b-fp8", model="gpt-7b", recipe={"kind": "delayed"}, world_size=8)
        transport = HttpTransport("http://fp8guard:8000", run)
        shipper = Shipper(transport)          # sends from a background thread
        shipper.submit(lambda: wire.make_batch(run_id=run.run_id, steps=[{"step": 0, "loss": 2.5}]))
        shipper.close()                       # flushes, backfills the spool once, closes

    Behaviour of :meth:`send` (never raises; blocks at most ``max_attempts`` requests plus
    backoff, or one request while the service is known to be down):

    * the run is registered before the first batch and again whenever ingest answers 404;
    * bodies of ``gzip_min_bytes`` or more are gzipped;
    * connection errors, timeouts, 408, 429 and 5xx are retried with the same bytes
      (exponential backoff, full jitter, numeric ``Retry-After`` honoured up to ``backoff_max_s``);
    * other 4xx mean the payload is wrong: logged with the service's ``detail`` and dropped;
    * a batch that still fails is spooled to ``spool_dir`` (one gzip file per batch, named in
      send order) and the transport stops trying each batch: it probes again at most every
      ``backoff_max_s`` seconds, and once a probe succeeds it backfills the spool oldest first,
      then sends the new batch;
    * the spool is bounded by ``spool_max_bytes`` (0 disables spooling); the oldest files go
      first. The loss is reported by a ``telemetry_dropped`` event (numbers of batches and
      steps) together with every tensor definition seen so far (the lost batches may have held
      the run's tensor table, without which later stats blocks are refused): on a small batch
      of their own ahead of the backfill, or appended to the next live batch if nothing is
      spooled.

    ``client`` may be any ``httpx.Client`` (a starlette ``TestClient`` in tests); requests use
    paths relative to its ``base_url`` (absolute ones built from ``url`` if it has none) and its
    own timeouts. It is closed by :meth:`close` only if this transport created it.
    ``spool_dir`` defaults to ``<tempdir>/fp8guard-spool/<run_id>/rank-<rank>`` (the rank of the
    first payload), so ranks sharing a host never share a spool. ``clock`` is for tests.
    """

    def __init__(
        self,
        url: str,
        run: RunInfo,
        *,
        client: httpx.Client | None = None,
        timeout_s: float = 10.0,
        max_attempts: int = 4,
        backoff_base_s: float = 0.2,
        backoff_max_s: float = 5.0,
        gzip_min_bytes: int = 4096,
        spool_dir: str | os.PathLike[str] | None = None,
        spool_max_bytes: int = 256 * _MiB,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_commands: Callable[[list[dict[str, Any]]], None] | None = None,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        if not isinstance(run, RunInfo):
            raise ValueError(f"run must be a RunInfo, got {type(run).__name__}")
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
        # A client without base_url cannot resolve "/v1/ingest"; address the service absolutely then.
        self._prefix = "" if str(self._client.base_url) else self._url
        self._timeout_s = float(timeout_s)
        self._max_attempts = max_attempts
        self._backoff_base_s = float(backoff_base_s)
        self._backoff_max_s = float(backoff_max_s)
        self._gzip_min_bytes = gzip_min_bytes
        self._spool_dir_arg = Path(spool_dir) if spool_dir is not None else None
        self._spool_max_bytes = spool_max_bytes
        self._sleep = sleep
        self._rng = rng if rng is not None else random.Random()
        self._clock = clock
        self._on_commands = on_commands

        self._lock = threading.Lock()  # send() and close() may come from different threads
        self._stats = TransportStats()
        self._registered = False
        self._closed = False
        self._spool: Spool | None = None
        self._spool_unusable = False
        self._down_since: float | None = None  # circuit breaker: open while not None
        self._next_probe_at = 0.0
        self._last_failure = ""
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
        self._limiter = RateLimiter(WARN_INTERVAL_S, clock)

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
        return Path(tempfile.gettempdir()) / "fp8guard-spool" / self._run.run_id / f"rank-{self._last_rank}"

    def send(self, payload: dict[str, Any]) -> None:
        """Deliver, spool, or (if the payload itself is wrong) drop one batch. Never raises."""
        try:
            with self._lock:
                self._send(payload)
        except Exception:
            # A bug of ours, or a hostile client: lose this batch rather than the training run.
            self._count_dropped(count_steps(payload), (0, 0))
            if (suppressed := self._limiter.allow("internal")) is not None:
                log.exception("fp8guard transport: unexpected error, batch %s dropped%s", batch_id_of(payload),
                              suppressed_note(suppressed))

    def close(self) -> None:
        """Try once to backfill the spool (each file one attempt, ``timeout_s`` in all), report
        telemetry still known lost, and close the client if this transport created it. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                deadline = self._clock() + self._timeout_s
                spool = self._open_spool()
                done = True
                if spool is not None and len(spool):
                    done = self._backfill(first_attempts=1, attempts=1, deadline=deadline) == "done"
                if done and self._pending_drop[0] and self._seen_payload:
                    # No later batch will carry the drop report, so send it on its own.
                    report = wire.make_batch(run_id=self._run.run_id, rank=self._last_rank,
                                             segment=self._last_segment)
                    self._deliver_fresh(report, attempts=1, spool_on_failure=False)
                if spool is not None and len(spool):
                    log.warning("fp8guard: %d batches remain spooled in %s; they are sent by the next "
                                "transport on this spool_dir", len(spool), spool.directory)
            except Exception:
                log.exception("fp8guard transport: error while closing")
            finally:
                if self._owns_client:
                    self._client.close()

    def stats(self) -> TransportStats:
        return dataclasses.replace(self._stats)

    # ------------------------------------------------------------------ send path

    def _send(self, payload: dict[str, Any]) -> None:
        if not isinstance(payload, Mapping):
            self._stats.rejected_batches += 1
            log.error("dropping a %s: a payload must be a dict built by fp8guard.wire.make_batch",
                      type(payload).__name__)
            return
        self._seen_payload = True
        remember_tensors(self._tensor_table, payload)
        self._last_rank = int_or(payload.get("rank"), self._last_rank)
        self._last_segment = int_or(payload.get("segment"), self._last_segment)
        if self._closed:
            # The client may be closed already; keep the data for the next process.
            self._spool_payload(payload)
            return
        if self._down_since is not None and self._clock() < self._next_probe_at:
            self._spool_payload(payload)  # breaker open: do not pay a timeout per batch
            return
        probing = self._down_since is not None
        spool = self._open_spool()
        if spool is not None and len(spool):
            state = self._backfill(first_attempts=1 if probing else self._max_attempts,
                                   attempts=self._max_attempts, deadline=self._clock() + self._timeout_s)
            if state != "done":
                # Still down, or still catching up: queue behind the spool so order is kept.
                self._spool_payload(payload)
                return
            probing = False
        self._deliver_fresh(payload, attempts=1 if probing else self._max_attempts, spool_on_failure=True)

    def _deliver_fresh(self, payload: Mapping[str, Any], *, attempts: int, spool_on_failure: bool) -> _Outcome:
        """Send a batch live, carrying the pending drop report; spool it if delivery fails."""
        claimed = self._claim_drop_report()
        if claimed is not None:
            payload = with_drop_event(payload, claimed)
        with_table = self._resend_tensors and bool(self._tensor_table)
        if with_table:
            payload = with_tensors(payload, self._tensor_table)
            self._resend_tensors = False
        body = self._serialise(payload)
        if body is None:
            self._unclaim(claimed)
            self._resend_tensors |= with_table
            return _Outcome.REJECTED
        gzipped = len(body) >= self._gzip_min_bytes
        wire_body = wire.gzip_body(body, level=1) if gzipped else body
        outcome = self._deliver(wire_body, gzipped=gzipped, batch_id=batch_id_of(payload), attempts=attempts)
        if outcome is _Outcome.DELIVERED:
            self._mark_up()
        elif outcome is _Outcome.REJECTED:
            self._mark_up()  # it answered: the service is reachable
            self._unclaim(claimed)
            # The table is not re-attached again: if it caused the refusal (409) that would loop.
        else:
            self._trip()
            if spool_on_failure:
                # The exact JSON that was attempted (drop event included): the service may have
                # stored it without us hearing back, and a retry must not differ.
                self._spool_bytes(wire_body if gzipped else wire.gzip_body(body, level=1),
                                  steps=count_steps(payload), carried=claimed or (0, 0))
            else:
                self._unclaim(claimed)
                self._resend_tensors |= with_table
        return outcome

    def _deliver(self, body: bytes, *, gzipped: bool, batch_id: str, attempts: int,
                 deadline: float | None = None) -> _Outcome:
        """POST one body, retrying transient failures with these exact bytes."""
        headers = {"content-type": "application/json"}
        if gzipped:
            headers["content-encoding"] = "gzip"
        attempt = 1
        may_reregister = True
        while True:
            retry_after: float | None = None
            try:
                if not self._registered:
                    self._register()
                response = self._client.post(f"{self._prefix}/v1/ingest", content=body, headers=headers)
            except _Retryable as exc:
                reason, retry_after = exc.reason, exc.retry_after
            except Exception as exc:  # httpx errors, and anything a custom client throws
                reason = describe_exception(exc)
            else:
                status = response.status_code
                if 200 <= status < 300:
                    self._accepted(response, len(body))
                    return _Outcome.DELIVERED
                if status == 404:
                    # The run is unknown (say the service came back on a fresh database): register
                    # again and retry at once; once per call this costs no attempt, so even a
                    # single-attempt probe survives it.
                    self._registered = False
                    if may_reregister:
                        may_reregister = False
                        self._stats.retries += 1
                        continue
                    reason = "HTTP 404 (run not registered)"
                elif 400 <= status < 500 and status not in (408, 429):
                    self._reject(status, response, batch_id)
                    return _Outcome.REJECTED
                else:
                    retry_after = retry_after_s(response)
                    reason = f"HTTP {status}"
            self._last_failure = reason
            if attempt >= attempts:
                break
            delay = self._backoff(attempt, retry_after)
            if deadline is not None and self._clock() + delay >= deadline:
                break
            log.debug("batch %s: attempt %d/%d failed (%s); retrying in %.2f s", batch_id, attempt,
                      attempts, reason, delay)
            self._stats.retries += 1
            if delay > 0:
                self._sleep(delay)
            attempt += 1
        return _Outcome.FAILED

    def _register(self) -> None:
        try:
            response = self._client.put(f"{self._prefix}/v1/runs/{self._run.run_id}",
                                        json=self._run.registration_body())
        except Exception as exc:
            raise _Retryable(f"registering the run: {describe_exception(exc)}") from exc
        if response.status_code in (200, 201):
            self._registered = True
            return
        # A 4xx here is not transient, but the batches themselves are fine: keep them (spool) until
        # someone fixes the url or the run info and restarts, rather than dropping good data.
        refused = 400 <= response.status_code < 500 and response.status_code not in (408, 429)
        if refused and (suppressed := self._limiter.allow("register")) is not None:
            log.error("fp8guard: registering run %s at %s was refused: HTTP %d %s; batches are kept in "
                      "the spool%s", self._run.run_id, self._url, response.status_code, error_detail(response),
                      suppressed_note(suppressed))
        raise _Retryable(f"registering the run: HTTP {response.status_code}", retry_after_s(response))

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self._backoff_max_s)
        # Full jitter: ranks that failed together do not retry together.
        return self._rng.uniform(0.0, min(self._backoff_max_s, self._backoff_base_s * 2.0 ** (attempt - 1)))

    def _accepted(self, response: httpx.Response, n_bytes: int) -> None:
        self._stats.sent_batches += 1
        self._stats.bytes_sent += n_bytes
        try:
            body = response.json()
            duplicate = body.get("duplicate") is True
            commands = body.get("commands") or []
        except Exception:  # the status is authoritative; the body is informative
            duplicate, commands = False, []
        if duplicate:
            self._stats.duplicate_batches += 1
        if commands and self._on_commands is not None:
            try:  # remediation commands ride on ingest answers; hand them to the monitor
                self._on_commands(list(commands))
            except Exception:
                log.exception("fp8guard: handling commands from the service failed")

    def _reject(self, status: int, response: httpx.Response, batch_id: str) -> None:
        self._stats.rejected_batches += 1
        if (suppressed := self._limiter.allow(f"reject:{status}")) is not None:
            log.error("fp8guard: the service refused batch %s with HTTP %d, dropping it: %s%s", batch_id,
                      status, error_detail(response), suppressed_note(suppressed))

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
        if self._down_since is None:
            self._down_since = now
            self._backfilled_since_down = 0
            self._limiter.reset("down")  # every outage logs its first failure
        self._next_probe_at = now + self._backoff_max_s
        if self._limiter.allow("down") is None:
            return
        if first:
            where = self.spool_dir if self._spool_max_bytes and not self._spool_unusable else None
            log.warning("fp8guard service at %s unreachable (%s); %s, probing again every %.1f s", self._url,
                        self._last_failure, f"spooling batches to {where}" if where else "dropping batches (no spool)",
                        self._backoff_max_s)
        else:
            log.warning("fp8guard service at %s still unreachable after %.0f s (%s); %d batches spooled, "
                        "%d dropped", self._url, now - self._down_since, self._last_failure,
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
        directory = self.spool_dir
        if directory is None:
            return None
        try:
            self._spool = Spool(directory, self._spool_max_bytes)
        except OSError as exc:
            self._spool_unusable = True
            log.warning("fp8guard: cannot use spool directory %s (%s); batches that cannot be delivered "
                        "are dropped", directory, exc)
        return self._spool

    def _spool_payload(self, payload: Mapping[str, Any]) -> None:
        body = self._serialise(payload)
        if body is not None:
            self._spool_bytes(wire.gzip_body(body, level=1), steps=count_steps(payload), carried=(0, 0))

    def _spool_bytes(self, gz: bytes, *, steps: int, carried: tuple[int, int]) -> None:
        spool = self._open_spool()
        if spool is None:
            self._count_dropped(steps, carried)
            return
        try:
            evicted = spool.add(gz, steps=steps, carried=carried)
        except SpoolFull:
            self._count_dropped(steps, carried)
            return
        except OSError as exc:
            self._count_dropped(steps, carried)
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

    def _count_dropped(self, steps: int, carried: tuple[int, int]) -> None:
        self._stats.dropped_batches += 1
        self._stats.dropped_steps += steps
        # A lost batch that carried an earlier drop report loses that report too: fold it back in.
        self._pending_drop[0] += 1 + carried[0]
        self._pending_drop[1] += steps + carried[1]
        self._resend_tensors = True

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

    def _backfill(self, *, first_attempts: int, attempts: int, deadline: float) -> str:
        """Send spooled batches oldest first. Returns "done" (spool empty), "failed" (the service
        is down again; breaker tripped) or "partial" (time budget used up; the caller queues
        behind the spool so a long backlog never stalls the shipper for long)."""
        spool = self._spool
        first = True
        if spool is not None and len(spool) and (self._pending_drop[0] or
                                                 (self._resend_tensors and self._tensor_table)):
            # Batches were lost: before the survivors, a small batch reports the gap and re-sends
            # the tensor table (the lost batches may have held it, and the survivors' stats
            # blocks are refused without it).
            report = wire.make_batch(run_id=self._run.run_id, rank=self._last_rank, segment=self._last_segment)
            if self._deliver_fresh(report, attempts=first_attempts, spool_on_failure=False) is _Outcome.FAILED:
                return "failed"
            first = False
        while spool is not None and (entry := spool.oldest()) is not None:
            if not first and self._clock() >= deadline:
                return "partial"
            try:
                data = spool.read(entry)
            except FileNotFoundError:
                spool.remove(entry)  # another transport on this spool_dir sent it already
                continue
            except OSError as exc:
                log.warning("fp8guard: cannot read spooled batch %s (%s); dropping it", entry.path, exc)
                spool.remove(entry)
                self._count_dropped(entry.steps or 0, entry.carried or (0, 0))
                continue
            outcome = self._deliver(data, gzipped=True, batch_id=f"spool:{entry.path.name}",
                                    attempts=first_attempts if first else attempts,
                                    deadline=None if first else deadline)
            first = False
            if outcome is _Outcome.FAILED:
                self._trip()
                return "failed"
            if outcome is _Outcome.DELIVERED:
                self._stats.backfilled_batches += 1
                self._backfilled_since_down += 1
            else:
                # Refused (a stale run, a truncated file): its drop report must not vanish with it.
                self._unclaim(spool.describe(entry)[1])
            spool.remove(entry)
        self._mark_up()
        return "done"


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _non_negative(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
