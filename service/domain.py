"""Domain objects the store takes and returns; the API and the CLI never see ORM rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "Batch",
    "EventRecord",
    "IngestResult",
    "RankProgress",
    "RunDetail",
    "RunSpec",
    "RunSummary",
    "ScalarSeries",
    "StatBlock",
    "StepRow",
    "TensorInfo",
    "TensorMatrix",
    "TensorSeries",
]

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class RunSpec:
    run_id: str
    model: str | None = None
    recipe: dict[str, Any] | None = None
    world_size: int = 1
    config: dict[str, Any] | None = None
    guard: dict[str, Any] | None = None
    """Detection/policy overrides (GuardConfig fields)."""


@dataclass(frozen=True, slots=True)
class RankProgress:
    rank: int
    last_step: int | None
    last_segment: int
    last_time: float | None
    last_loss: float | None
    batches: int
    samples: int


@dataclass(frozen=True, slots=True)
class RunSummary:
    run_id: str
    model: str | None
    status: str
    world_size: int
    created_at: datetime
    updated_at: datetime
    last_step: int | None
    last_loss: float | None
    samples: int


@dataclass(frozen=True, slots=True)
class RunDetail:
    summary: RunSummary
    recipe: dict[str, Any] | None
    config: dict[str, Any] | None
    ranks: list[RankProgress]
    num_tensors: int
    stats: list[str]


@dataclass(frozen=True, slots=True)
class TensorInfo:
    index: int
    name: str
    module: str | None
    role: str | None
    fp8_format: str | None
    first_step: int


@dataclass(frozen=True, slots=True)
class StepRow:
    step: int
    time: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    tokens: int | None = None


@dataclass(frozen=True, slots=True)
class StatBlock:
    """Decoded per-tensor statistics: ``values[i, k, t]`` is stat k of tensor t at steps[i]."""

    stats: tuple[str, ...]
    steps: npt.NDArray[np.int64]
    values: F32


@dataclass(frozen=True, slots=True)
class EventRecord:
    kind: str
    step: int | None = None
    time: float | None = None
    rank: int = 0
    segment: int = 0
    data: dict[str, Any] = field(default_factory=dict)
    id: int | None = None


@dataclass(frozen=True, slots=True)
class Batch:
    """A validated, decoded ingest batch."""

    run_id: str
    batch_id: str
    rank: int
    segment: int
    tensors: list[TensorInfo]
    steps: list[StepRow]
    blocks: list[StatBlock]
    events: list[EventRecord]

    @property
    def num_samples(self) -> int:
        """One sample = one tensor's statistics at one step."""
        return sum(int(b.values.shape[0]) * int(b.values.shape[2]) for b in self.blocks)


@dataclass(frozen=True, slots=True)
class IngestResult:
    batch_id: str
    duplicate: bool
    steps: int
    samples: int
    commands: list[dict[str, Any]] = field(default_factory=list)
    """Pending remediation commands for the run (see fp8guard.agent.commands)."""


@dataclass(frozen=True, slots=True)
class ScalarSeries:
    """Bucketed scalar series. ``steps[c]`` is the first step of bucket c actually present;
    ``minimum``/``maximum`` per field, None where the bucket had no value."""

    bucket: int
    steps: list[int]
    minimum: dict[str, list[float | None]]
    maximum: dict[str, list[float | None]]


@dataclass(frozen=True, slots=True)
class TensorSeries:
    tensor: TensorInfo
    stat: str
    bucket: int
    steps: list[int]
    minimum: list[float]
    maximum: list[float]


@dataclass(frozen=True, slots=True)
class TensorMatrix:
    """All tensors x bucketed steps for one stat. ``minimum``/``maximum`` are (tensors, columns);
    ``present[c]`` says whether column c holds data; a cell (t, c) with
    ``column_steps[c] + bucket <= first_step[t]`` predates the tensor and is also "no data"."""

    stat: str
    bucket: int
    level: int
    column_steps: npt.NDArray[np.int64]
    present: npt.NDArray[np.bool_]
    minimum: F32
    maximum: F32
    tensors: list[TensorInfo]
