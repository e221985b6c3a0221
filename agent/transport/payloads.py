"""What the transports need to know about a wire payload to count it: its id, its steps, the drop
reports it carries (a lost batch is reported by a ``telemetry_dropped`` event on a later one,
see :mod:`fp8guard.agent.drop_reports`). Read-only: nothing here changes a payload.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from fp8guard import wire

__all__ = ["TELEMETRY_DROPPED", "batch_id_of", "carried_drops", "count_steps", "int_or"]

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
