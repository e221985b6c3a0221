"""Encoding one drained flush of the step ring into a wire batch (on the shipper's thread)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from fp8guard import wire
from fp8guard.agent.sources.base import COUNT_STATS, STATS, TensorSpec
from fp8guard.agent.telemetry import FlushPacket

__all__ = ["encode_flush"]


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().astype("<f4", copy=False).tobytes()


def encode_flush(packet: FlushPacket, *, run_id: str, rank: int, segment: int, specs: Iterable[TensorSpec],
                 include_table: bool) -> dict[str, Any]:
    """Runs on the shipper's thread: waits for the copies, then encodes."""
    packet.wait()
    specs = list(specs)
    blocks = []
    if specs and packet.steps:
        blocks.append(wire.tensor_stats_block(stats=STATS, steps=packet.steps, n_tensors=len(specs),
                                              data=_to_bytes(packet.stats)))
    if specs and packet.count_steps and packet.counts is not None:
        blocks.append(wire.tensor_stats_block(stats=COUNT_STATS, steps=packet.count_steps, n_tensors=len(specs),
                                              data=_to_bytes(packet.counts)))
    table = [{"index": i, "name": s.name, "module": s.module, "role": s.role, "format": s.fp8_format}
             for i, s in enumerate(specs)] if include_table else []
    return wire.make_batch(run_id=run_id, rank=rank, segment=segment, tensors=table,
                           steps=packet.step_records(), tensor_stats=blocks, events=packet.events)
