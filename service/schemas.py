"""HTTP schemas: the pydantic mirror of ``fp8guard.wire`` (protocol v1) plus response models.

Floats accept JSON numbers and the strings "NaN", "Infinity", "-Infinity"; responses write
non-finite values the same way, because JSON itself has no NaN.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, field_validator, model_validator

from fp8guard import wire
from fp8guard.service.domain import (
    ActionRecord,
    CheckpointRecord,
    FindingRecord,
    PrecisionRecord,
    TokenRecord,
)
from fp8guard.service.kinds import ActionKind, ActionStatus, Precision, Role, Rule, Severity

__all__ = [
    "MAX_STEP",
    "RUN_PREFIX_PATTERN",
    "TOKEN_NAME_PATTERN",
    "ActionOut",
    "CheckpointOut",
    "CommandAckIn",
    "CommandOut",
    "EventIn",
    "EventOut",
    "FindingOut",
    "IngestBatchIn",
    "IngestResultOut",
    "JsonFloat",
    "PrecisionOut",
    "RankOut",
    "RunDetailOut",
    "RunIn",
    "RunOut",
    "ScalarSeriesOut",
    "StepIn",
    "TensorDefIn",
    "TensorMatrixOut",
    "TensorOut",
    "TensorSeriesOut",
    "TensorStatsIn",
    "TokenCreatedOut",
    "TokenIn",
    "TokenOut",
]

STAT_NAME = r"^[a-z][a-z0-9_]{0,63}$"
MAX_STEP = 2**53


def _encode(value: float | None) -> float | str | None:
    return wire.encode_float(value)


JsonFloat = Annotated[
    float,
    PlainSerializer(_encode, return_type=float | str | None, when_used="json"),
    Field(json_schema_extra={"description": 'a number, or "NaN", "Infinity", "-Infinity"'}),
]
"""A float that survives JSON: non-finite values travel as strings."""
OptJsonFloat = Annotated[
    float | None, PlainSerializer(_encode, return_type=float | str | None, when_used="json")
]

_strict = ConfigDict(extra="forbid")


def _check_text(value: Any, where: str) -> None:
    """Refuse strings that are not valid Unicode (lone surrogates such as "\\udfff" parse from JSON
    but cannot be stored and read back as UTF-8: the run answered 500 forever after)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where}: not valid Unicode (a lone surrogate escape such as \\udfff)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, where)
            _check_text(v, where)
    elif isinstance(value, list):
        for v in value:
            _check_text(v, where)


class TensorDefIn(BaseModel):
    model_config = _strict
    index: int = Field(ge=0, lt=wire.MAX_TENSORS, description="position of this tensor in every stats block")
    name: str = Field(min_length=1, max_length=512, description="unique label, e.g. 'blocks.0.fc1:fwd_input'")
    module: str | None = Field(default=None, max_length=512)
    role: str | None = Field(default=None, max_length=64, description="TE quantizer role, e.g. fwd_input")
    format: str | None = Field(default=None, max_length=16, description="e4m3 | e5m2 | ...")


class StepIn(BaseModel):
    model_config = _strict
    step: int = Field(ge=0, lt=MAX_STEP)
    time: float | None = Field(default=None, description="wall-clock time, Unix seconds")
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    tokens: int | None = Field(default=None, ge=0)
    loss_fp8: float | None = Field(default=None, description="harm probe: the training forward's loss")
    loss_bf16: float | None = Field(default=None, description="harm probe: the same batch's loss with FP8 off")
    fp8_loss_gap: float | None = Field(default=None, description="harm probe: (loss_fp8 - loss_bf16) / loss_bf16")


class TensorStatsIn(BaseModel):
    model_config = _strict
    stats: list[Annotated[str, Field(pattern=STAT_NAME)]] = Field(min_length=1, max_length=64)
    steps: list[Annotated[int, Field(ge=0, lt=MAX_STEP)]] = Field(min_length=1, max_length=wire.MAX_BATCH_STEPS)
    n_tensors: int = Field(ge=1, le=wire.MAX_TENSORS)
    dtype: Literal["<f4"] = "<f4"
    data: str = Field(description="base64 of little-endian float32, shape (steps, stats, n_tensors), C order")

    @field_validator("stats")
    @classmethod
    def _unique_stats(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("stat names must be unique within a block")
        return value

    @field_validator("steps")
    @classmethod
    def _unique_steps(cls, value: list[int]) -> list[int]:
        if len(set(value)) != len(value):
            raise ValueError("steps must be unique within a block")
        return value


class CommandAckIn(BaseModel):
    """Mirror of ``wire.CommandAck``: the data of a ``command_acknowledged`` event (other keys
    the agent adds, such as the command's kind or rollback details, are kept as they are)."""

    model_config = ConfigDict(extra="allow")
    command_id: int = Field(ge=0)
    status: wire.AckStatus
    applied_step: int | None = Field(default=None, ge=0, lt=MAX_STEP)
    error: str | None = None


class EventIn(BaseModel):
    model_config = _strict
    kind: wire.EventKind
    step: int | None = Field(default=None, ge=0, lt=MAX_STEP)
    time: float | None = None
    data: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _typed_ack(self) -> EventIn:
        _check_text(self.data, "event data")
        if self.kind is wire.EventKind.COMMAND_ACKNOWLEDGED:
            CommandAckIn.model_validate(self.data)  # a malformed ack is refused at the door, with its field
        return self


class IngestBatchIn(BaseModel):
    """One batch of telemetry from one rank (wire protocol v1)."""

    model_config = _strict
    protocol: int = Field(description=f"wire protocol version; this service speaks {wire.PROTOCOL_VERSION}",
                          json_schema_extra={"enum": [wire.PROTOCOL_VERSION]})
    batch_id: str = Field(pattern=wire.BATCH_ID_PATTERN, description="idempotency key; retries reuse it")
    run_id: str = Field(pattern=wire.RUN_ID_PATTERN)
    rank: int = Field(default=0, ge=0, lt=65536)
    segment: int = Field(default=0, ge=0, lt=2**31, description="incremented by the agent on every rollback")
    tensors: list[TensorDefIn] = Field(default_factory=list, max_length=wire.MAX_TENSORS)
    steps: list[StepIn] = Field(default_factory=list, max_length=wire.MAX_BATCH_STEPS)
    tensor_stats: list[TensorStatsIn] = Field(default_factory=list, max_length=64)
    events: list[EventIn] = Field(default_factory=list, max_length=10_000)

    @field_validator("protocol")
    @classmethod
    def _speaks(cls, value: int) -> int:
        if value != wire.PROTOCOL_VERSION:
            raise ValueError(f"protocol {value} is not supported; this service speaks {wire.PROTOCOL_VERSION}")
        return value

    @model_validator(mode="after")
    def _unique_tensors(self) -> IngestBatchIn:
        for t in self.tensors:
            _check_text([t.name, t.module, t.role, t.format], "tensors")
        if len({t.index for t in self.tensors}) != len(self.tensors):
            raise ValueError("tensors: each index may appear once per batch")
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("tensors: each name may appear once per batch")
        if len({s.step for s in self.steps}) != len(self.steps):
            raise ValueError("steps: each step may appear once per batch")
        return self


class CommandOut(BaseModel):
    """Mirror of ``wire.Command``: one command for the agent."""

    id: int
    kind: wire.CommandKind
    reason: str
    modules: list[str] | None = Field(description="fallback/promote: module names; null = the whole model")
    escalation: bool = Field(description="fallback: ordered by an escalation (stays in BF16 until a person acts)")
    checkpoint_step: int | None = Field(description="rollback: restore the checkpoint saved at this step")
    skip_batches: int = Field(description="rollback: data batches to skip after restoring")
    lr_scale: float = Field(description="rollback: learning-rate factor for lr_scale_steps steps")
    lr_scale_steps: int
    onset_step: int | None = Field(description="rollback: first step of the anomaly")
    spike_step: int | None = Field(description="rollback: last step of the anomaly the decision saw")

    @classmethod
    def of(cls, c: wire.Command) -> CommandOut:
        return cls.model_validate(c.to_json())


class IngestResultOut(BaseModel):
    batch_id: str
    duplicate: bool = Field(description="true when this batch id was already stored; nothing was written")
    steps: int
    samples: int = Field(description="tensor-samples stored (one tensor's stats at one step)")
    commands: list[CommandOut] = Field(
        default_factory=list,
        description="pending remediation commands for this run; acknowledge each with a command_acknowledged "
                    "event (data: CommandAckIn)")


def _guard_schema(schema: dict[str, Any]) -> None:
    """The OpenAPI of ``RunIn.guard`` names GuardConfig's fields and their bounds, so that the
    keys and values the service refuses are refused by the schema too."""
    from fp8guard.service.loop.config import GuardConfig

    guard = GuardConfig.model_json_schema()
    schema["properties"] = guard["properties"]
    schema["additionalProperties"] = False


class RunIn(BaseModel):
    model_config = _strict
    model: str | None = Field(default=None, max_length=256)
    recipe: dict[str, Any] | None = Field(default=None, description="FP8 recipe, e.g. {'kind': 'delayed', ...}")
    world_size: int = Field(default=1, ge=1, le=1_000_000)
    config: dict[str, Any] | None = Field(default=None, description="free-form training configuration")
    guard: dict[str, Any] | None = Field(default=None, description="detection thresholds and policy overrides "
                                         "(GuardConfig fields, e.g. {'dry_run': true, 'skip_batches': 300})",
                                         json_schema_extra=lambda s: _guard_schema(s))

    @model_validator(mode="after")
    def _valid_text(self) -> RunIn:
        for name in ("model", "recipe", "config", "guard"):
            _check_text(getattr(self, name), name)
        return self

    @field_validator("guard")
    @classmethod
    def _valid_guard(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            from fp8guard.service.loop.config import GuardConfig

            GuardConfig.model_validate(value)  # unknown keys and bad values are refused here, with their names
        return value


class RunOut(BaseModel):
    run_id: str
    model: str | None
    status: str
    world_size: int
    created_at: datetime
    updated_at: datetime
    last_step: int | None
    last_loss: OptJsonFloat
    samples: int


class RankOut(BaseModel):
    rank: int
    last_step: int | None
    last_segment: int
    last_time: float | None
    last_loss: OptJsonFloat
    batches: int
    samples: int


class RunDetailOut(RunOut):
    recipe: dict[str, Any] | None
    config: dict[str, Any] | None
    ranks: list[RankOut]
    num_tensors: int
    stats: list[str]


class TensorOut(BaseModel):
    index: int
    name: str
    module: str | None
    role: str | None
    format: str | None
    first_step: int


class ScalarSeriesOut(BaseModel):
    bucket: int = Field(description="steps per point; 1 means raw values")
    steps: list[int] = Field(description="first step of each bucket that holds data")
    min: dict[str, list[OptJsonFloat]]
    max: dict[str, list[OptJsonFloat]]


class TensorSeriesOut(BaseModel):
    tensor: TensorOut
    stat: str
    bucket: int
    steps: list[int]
    min: list[JsonFloat]
    max: list[JsonFloat]


class TensorMatrixOut(BaseModel):
    """A heatmap: tensors x columns for one stat, extremes kept per bucket.

    ``encoding="base64"``: ``min`` and ``max`` are base64 little-endian float32 of shape
    ``(len(tensors), len(steps))``; a cell with ``min > max`` (+inf, -inf) holds no data.
    ``encoding="json"``: nested lists; no-data cells are null, non-finite values strings.
    """

    stat: str
    bucket: int
    level: int = Field(description="stored block size the answer was computed from")
    steps: list[int] = Field(description="first step of each column")
    present: list[bool] = Field(description="whether each column holds any data")
    tensors: list[TensorOut]
    encoding: Literal["base64", "json"]
    min: str | list[list[OptJsonFloat]]
    max: str | list[list[OptJsonFloat]]


class EventOut(BaseModel):
    id: int
    kind: str
    step: int | None
    time: OptJsonFloat
    rank: int
    segment: int
    data: dict[str, Any]



class FindingOut(BaseModel):
    id: int
    rank: int
    segment: int
    step: int
    onset_step: int
    rule: Rule = Field(description="the detection rule (see docs/closed-loop.md)")
    severity: Severity
    explanation: str
    modules: list[str]
    evidence: dict[str, Any] = Field(description="tensors, values and thresholds behind the finding")

    @classmethod
    def of(cls, f: FindingRecord) -> FindingOut:
        return cls(id=f.id, rank=f.rank, segment=f.segment, step=f.step, onset_step=f.onset_step, rule=f.rule,
                   severity=f.severity, explanation=f.explanation, modules=f.modules, evidence=f.evidence)


class ActionOut(BaseModel):
    id: int
    kind: ActionKind
    status: ActionStatus
    step: int = Field(description="the step at which the service decided")
    reason: str
    payload: dict[str, Any] = Field(description="the decision's fields (modules, checkpoint_step, skip_batches...)")
    finding_ids: list[int]
    applied_step: int | None
    error: str | None

    @classmethod
    def of(cls, a: ActionRecord) -> ActionOut:
        return cls(id=a.id, kind=a.kind, status=a.status, step=a.step, reason=a.reason, payload=a.details,
                   finding_ids=a.finding_ids, applied_step=a.applied_step, error=a.error)


class PrecisionOut(BaseModel):
    module: str
    precision: Precision = Field(description="as the agent reported it applied")
    since_step: int

    @classmethod
    def of(cls, p: PrecisionRecord) -> PrecisionOut:
        return cls(module=p.module, precision=p.precision, since_step=p.since_step)


class CheckpointOut(BaseModel):
    rank: int
    segment: int
    step: int
    path: str | None
    known_good: bool = Field(description="no warning or critical finding followed it for known_good_after_steps")

    @classmethod
    def of(cls, c: CheckpointRecord) -> CheckpointOut:
        return cls(rank=c.rank, segment=c.segment, step=c.step, path=c.path, known_good=c.known_good)


TOKEN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._@:/+-]{0,127}$"
"""Token names appear in audit events and logs: printable, no spaces."""
RUN_PREFIX_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
"""An ingest token's run-id prefix: characters run ids may hold (``wire.RUN_ID_PATTERN``)."""


class TokenIn(BaseModel):
    model_config = _strict
    name: str = Field(pattern=TOKEN_NAME_PATTERN, description="who or what holds it")
    role: Role
    run_prefix: str | None = Field(default=None, pattern=RUN_PREFIX_PATTERN,
                                   description="ingest tokens only: the run ids it may write")


class TokenOut(BaseModel):
    name: str
    role: Role
    run_prefix: str | None
    hint: str = Field(description="the token's first characters")
    created_at: datetime
    revoked_at: datetime | None

    @classmethod
    def of(cls, t: TokenRecord) -> TokenOut:
        return cls(name=t.name, role=t.role, run_prefix=t.run_prefix, hint=t.hint, created_at=t.created_at,
                   revoked_at=t.revoked_at)


class TokenCreatedOut(TokenOut):
    token: str = Field(description="the secret: shown this once, stored only as a digest")
