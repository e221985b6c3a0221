"""The transport surface every destination shares, the run's registration, and the no-op transport."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Final, Protocol, runtime_checkable

from fp8guard import wire

__all__ = ["NullTransport", "RunInfo", "Transport", "TransportStats"]

_RUN_ID_RE: Final = re.compile(wire.RUN_ID_PATTERN)


@dataclass(frozen=True)
class RunInfo:
    """What ``PUT /v1/runs/{run_id}`` registers; the same on every rank."""

    run_id: str
    model: str | None = None
    recipe: dict[str, Any] | None = None
    world_size: int = 1
    config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not _RUN_ID_RE.match(self.run_id):
            raise ValueError(f"run_id {self.run_id!r} must match {wire.RUN_ID_PATTERN} "
                             "(1-128 of letters, digits, '.', '_', ':', '-', starting alphanumeric)")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {self.world_size!r}")

    def registration_body(self) -> dict[str, Any]:
        """The JSON body of the registration request."""
        return {"model": self.model, "recipe": self.recipe, "world_size": self.world_size,
                "config": self.config}


@dataclass
class TransportStats:
    """Counters since the transport was created. ``sent_batches`` counts every batch the service
    accepted, including duplicates and backfilled ones (both are subsets of it)."""

    sent_batches: int = 0
    duplicate_batches: int = 0
    retries: int = 0
    spooled_batches: int = 0
    backfilled_batches: int = 0
    rejected_batches: int = 0
    """Refused by the service with a 4xx other than 404/408/429, or not serialisable: dropped."""
    dropped_batches: int = 0
    """Lost to the spool bound (or a spool that could not be written)."""
    dropped_steps: int = 0
    bytes_sent: int = 0
    """Bytes of accepted ingest bodies as they went on the wire (after gzip)."""


@runtime_checkable
class Transport(Protocol):
    """Where payloads go. ``send`` is called from a single thread, in order, and never raises."""

    def send(self, payload: dict[str, Any]) -> None: ...

    def close(self) -> None: ...

    def stats(self) -> TransportStats: ...


class NullTransport:
    """Discards every payload and counts it; for benchmarks and for turning shipping off."""

    delivers_commands = False
    """No service hears these payloads, so no decision can come back: the monitor never waits
    for one after a trip (a transport without this attribute is assumed to deliver commands)."""

    def __init__(self) -> None:
        self._stats = TransportStats()

    def send(self, payload: dict[str, Any]) -> None:
        self._stats.sent_batches += 1

    def close(self) -> None:
        pass

    def stats(self) -> TransportStats:
        return dataclasses.replace(self._stats)
