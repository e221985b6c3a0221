"""Domain objects the store takes and returns; the API and the CLI never see ORM rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np
import numpy.typing as npt

from fp8guard import wire
from fp8guard.service.kinds import ActionKind, ActionStatus, Precision, Role, Rule, Severity

__all__ = [
    "ActionRecord",
    "Batch",
    "CheckpointRecord",
    "Decision",
    "EventRecord",
    "Finding",
    "FindingRecord",
    "IngestResult",
    "PrecisionRecord",
    "QueuedBatch",
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
    "TokenRecord",
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
    guard: dict[str, Any] | None = None
    """The run's detection and policy overrides, as registered."""


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
    loss_fp8: float | None = None
    loss_bf16: float | None = None
    fp8_loss_gap: float | None = None


@dataclass(frozen=True, slots=True)
class StatBlock:
    """Decoded per-tensor statistics: ``values[i, k, t]`` is stat k of tensor t at steps[i]."""

    stats: tuple[str, ...]
    steps: npt.NDArray[np.int64]
    values: F32


@dataclass(frozen=True, slots=True)
class TokenRecord:
    """An API token as stored (never its secret)."""

    id: int
    name: str
    role: Role
    run_prefix: str | None
    hint: str
    created_at: datetime
    revoked_at: datetime | None = None


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
    commands: list[wire.Command] = field(default_factory=list)
    """Pending remediation commands for the run."""
    queue_id: int | None = None
    """The batch's place in the closed loop's queue (None for a duplicate or a batch with no steps)."""
    run_pk: int | None = None


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


# -- the closed loop ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QueuedBatch:
    """A stored batch waiting for the closed loop, in the order its rank wrote it."""

    queue_id: int
    rank: int
    segment: int
    first_step: int
    last_step: int


@dataclass(frozen=True, slots=True)
class Finding:
    """What a detection rule saw."""

    rule: Rule
    severity: Severity
    step: int
    onset_step: int
    explanation: str
    """One sentence, for people."""
    modules: tuple[str, ...] = ()
    evidence: dict[str, Any] = field(default_factory=dict)
    """Tensors, steps, values."""


@dataclass(frozen=True, slots=True)
class Decision:
    """What the policy decided, with the command fields its kind needs."""

    kind: ActionKind
    reason: str
    findings: tuple[int, ...]
    """Indexes into the findings the policy was given."""
    severity: Severity = Severity.WARNING
    modules: tuple[str, ...] | None = None
    """fallback/promote: the modules; None = the whole model."""
    escalation: bool = False
    checkpoint_step: int | None = None
    skip_batches: int = 0
    lr_scale: float = 1.0
    lr_scale_steps: int = 0
    onset_step: int | None = None
    spike_step: int | None = None
    rule: Rule | None = None
    """alert: the rule of the finding that is alerted."""

    def command(self, command_id: int) -> wire.Command:
        """The command this decision sends (commands only)."""
        return wire.Command(id=command_id, kind=wire.CommandKind(self.kind.value), reason=self.reason,
                            modules=self.modules, escalation=self.escalation, checkpoint_step=self.checkpoint_step,
                            skip_batches=self.skip_batches, lr_scale=self.lr_scale, lr_scale_steps=self.lr_scale_steps,
                            onset_step=self.onset_step, spike_step=self.spike_step)

    def details(self) -> dict[str, Any]:
        """The decision's fields as JSON (stored with the action, sent with its alert)."""
        out: dict[str, Any] = {"modules": list(self.modules) if self.modules is not None else None}
        if self.kind is ActionKind.FALLBACK:
            out["escalation"] = self.escalation
        if self.kind is ActionKind.ROLLBACK:
            out.update(checkpoint_step=self.checkpoint_step, skip_batches=self.skip_batches, lr_scale=self.lr_scale,
                       lr_scale_steps=self.lr_scale_steps, onset_step=self.onset_step, spike_step=self.spike_step)
        if self.rule is not None:
            out["rule"] = str(self.rule)
        return out


@dataclass(frozen=True, slots=True)
class FindingRecord:
    id: int
    rank: int
    segment: int
    step: int
    onset_step: int
    rule: Rule
    severity: Severity
    explanation: str
    modules: list[str]
    evidence: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ActionRecord:
    id: int
    kind: ActionKind
    status: ActionStatus
    step: int
    reason: str
    details: dict[str, Any]
    finding_ids: list[int]
    applied_step: int | None
    error: str | None


@dataclass(frozen=True, slots=True)
class PrecisionRecord:
    module: str
    precision: Precision
    since_step: int
    """The step the agent reported the switch applied."""


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    rank: int
    segment: int
    step: int
    path: str | None
    known_good: bool
