"""From the validated wire batch to a domain ``Batch``: blob sizes checked, float32 decoded
without copying, steps ordered, event data bounded (per event and per batch)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from fp8guard import wire
from fp8guard.service.domain import Batch, EventRecord, StatBlock, StepRow, TensorInfo
from fp8guard.service.errors import InvalidPayload, PayloadTooLarge
from fp8guard.service.schemas import IngestBatchIn

__all__ = ["EventLimits", "decode_batch"]


@dataclass(frozen=True, slots=True)
class EventLimits:
    """Ceilings on event data (``Settings.max_event_data_bytes`` / ``max_batch_event_bytes``):
    a stored event is read back by every dashboard load, so its size is bounded at the door."""

    per_event: int = 64 * 2**10
    per_batch: int = 1 * 2**20


def _check_events(batch: IngestBatchIn, limits: EventLimits) -> None:
    total = 0
    for i, e in enumerate(batch.events):
        # Compact JSON, as stored; NaN is allowed here (it is written as the scalars are).
        size = len(json.dumps(e.data, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
        if size > limits.per_event:
            raise PayloadTooLarge(f"event data of {size} bytes exceeds the limit of {limits.per_event} per event",
                                  loc=("body", "events", i, "data"))
        total += size
        if total > limits.per_batch:
            raise PayloadTooLarge(f"the events' data exceed the limit of {limits.per_batch} bytes per batch",
                                  loc=("body", "events", i, "data"))


def decode_batch(batch: IngestBatchIn, limits: EventLimits | None = None) -> Batch:
    """Validate what pydantic cannot (blob sizes, event data sizes) and decode float32 blocks
    without copying."""
    _check_events(batch, limits or EventLimits())
    blocks: list[StatBlock] = []
    for i, block in enumerate(batch.tensor_stats):
        loc: tuple[Any, ...] = ("body", "tensor_stats", i, "data")
        try:
            raw = wire.decode_f32(block.data)
        except ValueError as exc:
            raise InvalidPayload(str(exc), loc=loc) from None
        shape = (len(block.steps), len(block.stats), block.n_tensors)
        expected = shape[0] * shape[1] * shape[2] * 4
        if len(raw) != expected:
            raise InvalidPayload(
                f"decodes to {len(raw)} bytes, expected {expected} = {shape[0]} steps x {shape[1]} stats x "
                f"{shape[2]} tensors x 4 (float32)", loc=loc)
        values = np.frombuffer(raw, dtype="<f4").reshape(shape)
        steps = np.asarray(block.steps, dtype=np.int64)
        if steps.size > 1 and np.any(steps[1:] <= steps[:-1]):
            order = np.argsort(steps, kind="stable")
            steps, values = steps[order], values[order]
        blocks.append(StatBlock(stats=tuple(block.stats), steps=steps, values=values))
    return Batch(
        run_id=batch.run_id,
        batch_id=batch.batch_id,
        rank=batch.rank,
        segment=batch.segment,
        tensors=[TensorInfo(index=t.index, name=t.name, module=t.module, role=t.role, fp8_format=t.format,
                            first_step=0) for t in batch.tensors],
        steps=[StepRow(step=s.step, time=s.time, tokens=s.tokens, **{f: getattr(s, f) for f in wire.STEP_FIELDS})
               for s in batch.steps],
        blocks=blocks,
        events=[EventRecord(kind=str(e.kind), step=e.step, time=e.time, rank=batch.rank, segment=batch.segment,
                            data=e.data) for e in batch.events],
    )
