"""The circuit breaker: after a batch failed, stop trying each batch and probe the service at a
fixed interval instead; say so in the log once per outage (and at most once a minute after)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from fp8guard.agent.transport.ratelimit import RateLimiter

__all__ = ["Breaker"]

log = logging.getLogger("fp8guard.agent.transport")


class Breaker:
    """Open after a failure: no request before ``next_probe_at`` (``probe_s`` later). The caller
    holds its own lock around every call; the breaker keeps no lock of its own."""

    def __init__(self, *, url: str, probe_s: float, clock: Callable[[], float], limiter: RateLimiter) -> None:
        self._url = url
        self._probe_s = probe_s
        self._clock = clock
        self._limiter = limiter
        self.open = False
        self.next_probe_at = 0.0
        self._down_since: float | None = None
        self._backfilled_since_down = 0

    def waiting(self) -> bool:
        """Open, and the next probe is not due yet."""
        return self.open and self._clock() < self.next_probe_at

    def probe_now(self) -> None:
        """One more try at once, whatever the interval says (closing)."""
        self.next_probe_at = self._clock()

    def answered(self) -> None:
        """The service answered (accepted or refused): close."""
        self.open = False

    def backfilled(self) -> None:
        self._backfilled_since_down += 1

    def trip(self, *, reason: str, auth_refused: bool, spooling_to: Path | None, spooled: int, dropped: int) -> None:
        """A batch could not be delivered: open until the next probe, and say why (rate-limited)."""
        now = self._clock()
        first = self._down_since is None
        self.open = True
        if self._down_since is None:
            self._down_since = now
            self._backfilled_since_down = 0
            self._limiter.reset("down")  # every outage logs its first failure
        self.next_probe_at = now + self._probe_s
        if auth_refused:
            return  # the courier said why, once; "unreachable" would mislead
        if self._limiter.allow("down") is None:
            return
        if first:
            log.warning("fp8guard service at %s unreachable (%s); %s, probing again every %.1f s", self._url, reason,
                        f"spooling batches to {spooling_to}" if spooling_to else "dropping batches (no spool)",
                        self._probe_s)
        else:
            log.warning("fp8guard service at %s still unreachable after %.0f s (%s); %d batches spooled, "
                        "%d dropped", self._url, now - self._down_since, reason, spooled, dropped)

    def recovered(self) -> None:
        """Nothing waits any more: the outage (if any) is over."""
        if self._down_since is not None:
            log.info("fp8guard service at %s reachable again after %.0f s; %d spooled batches backfilled",
                     self._url, self._clock() - self._down_since, self._backfilled_since_down)
            self._down_since = None
