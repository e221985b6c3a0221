"""Rate-limited warnings: an outage must not write one log line per batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

__all__ = ["WARN_INTERVAL_S", "RateLimiter", "suppressed_note"]

WARN_INTERVAL_S: Final = 60.0


class RateLimiter:
    """At most one log line per key and interval; counts what it held back."""

    def __init__(self, interval_s: float, clock: Callable[[], float]) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def allow(self, key: str) -> int | None:
        """None to stay quiet; otherwise how many messages were suppressed since the last one."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._suppressed.pop(key, 0)

    def reset(self, key: str) -> None:
        self._last.pop(key, None)
        self._suppressed.pop(key, None)


def suppressed_note(suppressed: int) -> str:
    return f" ({suppressed} similar messages suppressed)" if suppressed else ""
