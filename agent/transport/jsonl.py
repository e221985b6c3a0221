"""``JsonlFileTransport``: telemetry appended to a file, for offline runs and later replay."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import IO, Any

from fp8guard import wire
from fp8guard.agent.transport.base import TransportStats
from fp8guard.agent.transport.payloads import batch_id_of, count_steps
from fp8guard.agent.transport.ratelimit import WARN_INTERVAL_S, RateLimiter, suppressed_note

__all__ = ["JsonlFileTransport"]

log = logging.getLogger("fp8guard.agent.transport")


class JsonlFileTransport:
    """Appends one JSON line per payload to ``path`` (created with its parents), for offline runs.

    Every line is a complete ingest body, so the file can be replayed later::

        curl -X PUT $URL/v1/runs/my-run -H 'content-type: application/json' -d '{"world_size": 1}'
        while IFS= read -r line; do
          printf '%s' "$line" | curl -sf -X POST $URL/v1/ingest -H 'content-type: application/json' --data-binary @-
        done < telemetry.jsonl
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)
        self._file: IO[bytes] | None = None
        self._lock = threading.Lock()
        self._stats = TransportStats()
        self._limiter = RateLimiter(WARN_INTERVAL_S, time.monotonic)

    @property
    def path(self) -> Path:
        return self._path

    def send(self, payload: dict[str, Any]) -> None:
        try:
            line = wire.dumps(payload) + b"\n"
        except (TypeError, ValueError) as exc:
            self._stats.rejected_batches += 1
            log.error("dropping batch %s: not serialisable as JSON (%s)", batch_id_of(payload), exc)
            return
        with self._lock:
            try:
                if self._file is None:
                    self._path.parent.mkdir(parents=True, exist_ok=True)
                    self._file = self._path.open("ab")
                self._file.write(line)
                # A line per payload reaches the OS at once, so a crash loses at most the current one.
                self._file.flush()
            except OSError as exc:
                self._stats.dropped_batches += 1
                self._stats.dropped_steps += count_steps(payload)
                if (suppressed := self._limiter.allow("write")) is not None:
                    log.warning("cannot append telemetry to %s (%s); batch dropped%s", self._path, exc,
                                suppressed_note(suppressed))
                return
        self._stats.sent_batches += 1
        self._stats.bytes_sent += len(line)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                try:
                    self._file.close()
                except OSError as exc:  # pragma: no cover - close after a failed flush
                    log.warning("closing %s failed: %s", self._path, exc)
                self._file = None

    def stats(self) -> TransportStats:
        return dataclasses.replace(self._stats)
