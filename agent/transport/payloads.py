"""What the transports need to know about a wire payload: its steps, its drop reports, its tensor table.

A lost batch is reported by a ``telemetry_dropped`` event carried by a later one; these helpers
count what a payload holds and build the copies that carry the report (never the caller's dict).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any, Final

from fp8guard import wire

__all__ = ["TELEMETRY_DROPPED", "batch_id_of", "carried_drops", "count_steps", "int_or", "remember_tensors",
           "with_drop_event", "with_tensors"]

TELEMETRY_DROPPED: Final = str(wire.EventKind.TELEMETRY_DROPPED)


def int_or(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def batch_id_of(payload: object) -> str:
    if isinstance(payload, Mapping):
        return str(payload.get("batch_id", "?"))
    return "?"


def _int_steps(values: Iterable[Any]) -> set[int]:
    return {v for v in values if isinstance(v, int) and not isinstance(v, bool)}


def count_steps(payload: object) -> int:
    """Distinct training steps a payload holds data for (step records and stats blocks together)."""
    if not isinstance(payload, Mapping):
        return 0
    steps: set[int] = set()
    records = payload.get("steps")
    if isinstance(records, list):
        steps |= _int_steps(r.get("step") for r in records if isinstance(r, Mapping))
    blocks = payload.get("tensor_stats")
    if isinstance(blocks, list):
        for block in blocks:
            if isinstance(block, Mapping) and isinstance(block.get("steps"), list):
                steps |= _int_steps(block["steps"])
    return len(steps)


def carried_drops(payload: object) -> tuple[int, int]:
    """Counts of the ``telemetry_dropped`` events inside a payload."""
    batches = steps = 0
    events = payload.get("events") if isinstance(payload, Mapping) else None
    if isinstance(events, list):
        for event in events:
            if isinstance(event, Mapping) and event.get("kind") == TELEMETRY_DROPPED:
                data = event.get("data")
                if isinstance(data, Mapping):
                    batches += int_or(data.get("batches"), 0)
                    steps += int_or(data.get("steps"), 0)
    return batches, steps


def remember_tensors(table: dict[int, dict[str, Any]], payload: Mapping[str, Any]) -> None:
    tensors = payload.get("tensors")
    if isinstance(tensors, list):
        for t in tensors:
            if isinstance(t, Mapping) and isinstance(t.get("index"), int):
                table[t["index"]] = dict(t)


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
