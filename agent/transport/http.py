"""``HttpTransport``: batches to the fp8guard service over HTTP, spooled while it cannot take them.

The public face: it checks the settings and joins the byte link to the payload side."""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import httpx

from fp8guard.agent.drop_reports import DropReports
from fp8guard.agent.transport.base import RunInfo, TransportStats
from fp8guard.agent.transport.link import Link, LinkSettings
from fp8guard.agent.transport.payloads import batch_id_of, count_steps
from fp8guard.agent.transport.ratelimit import WARN_INTERVAL_S, RateLimiter, suppressed_note

__all__ = ["HttpTransport"]

log = logging.getLogger("fp8guard.agent.transport")

_MiB: Final = 1024 * 1024


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

    Two halves: :class:`~fp8guard.agent.transport.link.Link` ships opaque bytes in order (retries,
    breaker, spool, backfill) and tells every loss to the payload side,
    :class:`~fp8guard.agent.drop_reports.DropReports`, which owns the drop reports and the
    tensor-table re-sends and seals each payload into bytes at its first attempt.

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

        self._run = run
        self._reports = DropReports(run.run_id)
        self._link = Link(
            LinkSettings(url=url.rstrip("/"), timeout_s=float(timeout_s), max_attempts=max_attempts,
                         backoff_base_s=float(backoff_base_s), backoff_max_s=float(backoff_max_s),
                         gzip_min_bytes=gzip_min_bytes, spool_dir=Path(spool_dir) if spool_dir is not None else None,
                         spool_max_bytes=spool_max_bytes, background=bool(background), max_in_memory=max_in_memory,
                         drain_s=float(drain_s)),
            run, self._reports, client=client, token=token, sleep=sleep,
            rng=rng if rng is not None else random.Random(), clock=clock, on_commands=on_commands)
        self._limiter = RateLimiter(WARN_INTERVAL_S, clock)

    @property
    def run(self) -> RunInfo:
        return self._run

    @property
    def spool_dir(self) -> Path | None:
        """Where batches are spooled; ``None`` while the default one waits for the first payload's rank."""
        return self._link.spool_dir

    def send(self, payload: dict[str, Any]) -> None:
        """Admit one batch: deliver it (``background=False``) or hand it to the transport's thread;
        spool it if it cannot go now; drop (and report) it only if the payload itself is wrong.
        Never raises."""
        try:
            if not isinstance(payload, Mapping):
                self._link.count_rejected()
                log.error("dropping a %s: a payload must be a dict built by fp8guard.wire.make_batch",
                          type(payload).__name__)
                return
            letter = self._reports.letter(payload)
            self._link.admit(letter, rank=self._reports.rank)
        except Exception:
            # A bug of ours, or a hostile client: lose this batch rather than the training run.
            self._link.lose(count_steps(payload))
            if (suppressed := self._limiter.allow("internal")) is not None:
                log.exception("fp8guard transport: unexpected error, batch %s dropped%s", batch_id_of(payload),
                              suppressed_note(suppressed))

    def report_dropped(self, batches: int, steps: int) -> None:
        """Count telemetry the caller lost before it reached this transport (a full queue upstream);
        the next batch that reaches the service reports it."""
        self._link.count_dropped(batches, steps)
        self._reports.add(batches, steps)

    def close(self) -> None:
        """Deliver what waits (up to ``drain_s``; each spooled file one attempt), report telemetry
        still known lost, and close the client if this transport created it. Idempotent."""
        self._link.close()

    def stats(self) -> TransportStats:
        return self._link.stats()


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _non_negative(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
