"""Telling the service what it did not get: drop reports and tensor-table re-sends.

Every batch the transport loses for good (the spool bound, a spool that cannot be written, a
refusal, a full shipper queue) is counted here and reported by a ``telemetry_dropped`` event
(numbers of batches and steps) on the next batch that goes out, or on a small batch of its own
ahead of a backfill. A lost batch may have held the run's tensor table (only the first batch
defines the tensors), and later stats blocks would then be refused for the rest of the run, so
after a loss the table is sent again with the report. Not after a refusal: the table may be why.

:class:`DropReports` is the payload side of :mod:`fp8guard.agent.transport.letters`: the byte
link tells it what became of batches, and it seals payloads into the bytes the link ships.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from fp8guard import wire
from fp8guard.agent.transport.letters import Sealed
from fp8guard.agent.transport.payloads import TELEMETRY_DROPPED, batch_id_of, count_steps, int_or

__all__ = ["DropReports", "PayloadLetter", "with_drop_event", "with_tensors"]

log = logging.getLogger("fp8guard.agent.transport")


class DropReports:
    """Pending drop counts and every tensor definition seen, for one run (thread-safe)."""

    def __init__(self, run_id: str) -> None:
        self._run_id = run_id
        self._lock = threading.Lock()
        self._pending = [0, 0]  # batches, steps lost but not yet reported to the service
        self._table: dict[int, dict[str, Any]] = {}
        self._resend_table = False
        self._rank = 0
        self._segment = 0
        self.seen_payload = False

    @property
    def rank(self) -> int:
        """The rank of the latest payload (0 before the first)."""
        return self._rank

    def letter(self, payload: Mapping[str, Any]) -> PayloadLetter:
        """Admit a payload: remember its tensors and rank; the letter seals it later."""
        with self._lock:
            self.seen_payload = True
            tensors = payload.get("tensors")
            if isinstance(tensors, list):
                for t in tensors:
                    if isinstance(t, Mapping) and isinstance(t.get("index"), int):
                        self._table[t["index"]] = dict(t)
            self._rank = int_or(payload.get("rank"), self._rank)
            self._segment = int_or(payload.get("segment"), self._segment)
        return PayloadLetter(self, payload, count_steps(payload))

    def add(self, batches: int, steps: int) -> None:
        """Telemetry lost before it reached the transport (a full queue upstream)."""
        with self._lock:
            self._pending[0] += batches
            self._pending[1] += steps

    # ------------------------------------------------------------------ the Ledger the link reports to

    def lost(self, steps: int, carried: tuple[int, int], *, refused: bool) -> None:
        with self._lock:
            # A lost batch that carried an earlier drop report loses that report too: fold it back in.
            self._pending[0] += 1 + carried[0]
            self._pending[1] += steps + carried[1]
            self._resend_table |= not refused

    def returned(self, claimed: tuple[int, int] | None, *, with_table: bool = False) -> None:
        with self._lock:
            if claimed is not None:
                self._pending[0] += claimed[0]
                self._pending[1] += claimed[1]
            self._resend_table |= with_table

    def report_due(self) -> bool:
        with self._lock:
            return bool(self._pending[0] or (self._resend_table and self._table))

    def has_drops(self) -> bool:
        with self._lock:
            return bool(self._pending[0]) and self.seen_payload

    def report(self) -> Sealed | None:
        with self._lock:
            batch = wire.make_batch(run_id=self._run_id, rank=self._rank, segment=self._segment)
            return self._seal(batch)

    # ------------------------------------------------------------------ sealing

    def seal(self, payload: Mapping[str, Any]) -> Sealed | None:
        with self._lock:
            return self._seal(payload)

    def _seal(self, payload: Mapping[str, Any]) -> Sealed | None:
        claimed = None
        if self._pending[0]:
            claimed = (self._pending[0], self._pending[1])
            self._pending = [0, 0]
            payload = with_drop_event(payload, claimed)
        with_table = self._resend_table and bool(self._table)
        if with_table:
            payload = with_tensors(payload, self._table)
            # Sent once per loss: not re-attached after a refusal (if the table caused it, a 409,
            # that would loop), nor after a failure to serialise (the table may be why).
            self._resend_table = False
        body = serialise(payload)
        if body is None:
            if claimed is not None:
                self._pending[0] += claimed[0]
                self._pending[1] += claimed[1]
            return None
        return Sealed(body, claimed, with_table)


class PayloadLetter:
    """One payload on its way: sealed at its first attempt (see :class:`DropReports`)."""

    def __init__(self, reports: DropReports, payload: Mapping[str, Any], steps: int) -> None:
        self._reports = reports
        self._payload = payload
        self._steps = steps

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def label(self) -> str:
        return batch_id_of(self._payload)

    def seal(self) -> Sealed | None:
        return self._reports.seal(self._payload)

    def plain(self) -> bytes | None:
        return serialise(self._payload)


def serialise(payload: Mapping[str, Any]) -> bytes | None:
    """Wire JSON, or None (logged) for a payload that is not."""
    try:
        return wire.dumps(payload)
    except (TypeError, ValueError) as exc:
        log.error("fp8guard: dropping batch %s: not serialisable as wire JSON (%s); non-finite "
                  "floats must be encoded with fp8guard.wire.encode_float", batch_id_of(payload), exc)
        return None


def with_tensors(payload: Mapping[str, Any], table: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """A copy of the payload whose tensor table holds every known definition (its own win)."""
    merged: dict[int, Any] = {i: dict(t) for i, t in table.items()}
    odd: list[Any] = []  # malformed entries stay, so the service names them as before
    own = payload.get("tensors")
    for t in own if isinstance(own, list) else ():
        if isinstance(t, Mapping) and isinstance(t.get("index"), int):
            merged[t["index"]] = t
        else:
            odd.append(t)
    return {**payload, "tensors": [merged[i] for i in sorted(merged)] + odd}


def with_drop_event(payload: Mapping[str, Any], counts: tuple[int, int]) -> dict[str, Any]:
    """A copy of the payload with the drop report appended; the caller's dict stays untouched."""
    events = payload.get("events")
    event = {"kind": TELEMETRY_DROPPED, "time": time.time(), "data": {"batches": counts[0], "steps": counts[1]}}
    return {**payload, "events": [*(events if isinstance(events, list) else ()), event]}
