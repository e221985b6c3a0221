"""Wire protocol v1 between the fp8guard agent and service (standard library only).

This module is the single definition both sides share: the agent builds payloads with it
and the service's pydantic schemas mirror it; ``tests/test_wire_contract.py`` pins the two
together. ``docs/protocol.md`` is the prose version.

Design points:
- JSON envelope, optionally gzip-compressed (``Content-Encoding: gzip``).
- Per-tensor statistics travel as one base64 little-endian float32 block per group of
  stats, shaped ``(len(steps), len(stats), n_tensors)``; a tensor-name table is sent once
  per run (re-sending it is harmless).
- JSON has no NaN or Infinity, and they are the events fp8guard exists for: scalar floats
  that are not finite travel as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``;
  inside float32 blocks they are plain IEEE values.
- ``batch_id`` makes a retried batch a no-op on the service.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import json
import math
import re
import sys
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

_fast_b64: Any
try:  # optional SIMD base64 (60x faster than binascii); the service installs it, the agent need not
    import pybase64 as _fast_b64
except ImportError:  # pragma: no cover - exercised where pybase64 is absent
    _fast_b64 = None

__all__ = [
    "BATCH_ID_PATTERN",
    "MAX_BATCH_STEPS",
    "MAX_TENSORS",
    "NONFINITE_STRINGS",
    "PROTOCOL_VERSION",
    "RUN_ID_PATTERN",
    "STEP_FIELDS",
    "AckStatus",
    "Command",
    "CommandAck",
    "CommandKind",
    "EventKind",
    "decode_f32",
    "decode_float",
    "dumps",
    "encode_f32",
    "encode_float",
    "gzip_body",
    "make_batch",
    "new_batch_id",
    "tensor_stats_block",
]

PROTOCOL_VERSION: Final = 1
"""Bumped on any incompatible change; the service answers 400 to versions it does not speak."""

RUN_ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
BATCH_ID_PATTERN: Final = r"^[A-Za-z0-9._:-]{8,128}$"
MAX_BATCH_STEPS: Final = 100_000
MAX_TENSORS: Final = 1_000_000

STEP_FIELDS: Final = ("loss", "grad_norm", "lr", "loss_fp8", "loss_bf16", "fp8_loss_gap")
"""Float fields of a per-step record, in storage order (``tokens`` is an integer). The last three
come from the harm probe, at the steps it ran: the loss of the training forward (FP8), the same
batch's loss with FP8 off (same weights, no grad), and ``(loss_fp8 - loss_bf16) / loss_bf16``."""

NONFINITE_STRINGS: Final = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

_RUN_ID_RE = re.compile(RUN_ID_PATTERN)


class EventKind(StrEnum):
    """Kinds of run events. Unknown kinds are refused so typos do not become silent data."""

    RUN_STARTED = "run_started"
    RUN_RESUMED = "run_resumed"
    RUN_FINISHED = "run_finished"
    RUN_FAILED = "run_failed"
    CHECKPOINT_SAVED = "checkpoint_saved"
    FALLBACK_APPLIED = "fallback_applied"
    PROMOTION_APPLIED = "promotion_applied"
    ROLLBACK_APPLIED = "rollback_applied"
    COMMAND_ACKNOWLEDGED = "command_acknowledged"
    TELEMETRY_DROPPED = "telemetry_dropped"
    HARM_ATTRIBUTED = "harm_attributed"
    """The harm probe's gap left its band; ``data.modules`` carry it (bisection): ``gap`` before,
    ``gap_after`` with them in high precision, ``band_high``."""
    PROMOTION_TRIAL = "promotion_trial"
    """Modules held in BF16 tried back in FP8 inside the probe: ``gap``, ``band_high``, ``harmful``."""
    NOTE = "note"


class CommandKind(StrEnum):
    """What the service may order the agent to do (the remediation half of the protocol)."""

    FALLBACK = "fallback"
    """Switch ``modules`` (None: the whole model) to BF16."""
    PROMOTE = "promote"
    """Switch ``modules`` back to FP8 with a fresh amax history and scale."""
    ROLLBACK = "rollback"
    """Restore the checkpoint of ``checkpoint_step``, skip ``skip_batches``, scale the LR."""


class AckStatus(StrEnum):
    """How the agent answers a command (``command_acknowledged`` event)."""

    APPLIED = "applied"
    FAILED = "failed"
    IGNORED = "ignored"


def _opt_int(raw: Mapping[str, Any], key: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key} must be an integer or null, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Command:
    """One command from the service, as it travels in ingest answers and on
    ``GET /v1/runs/{run_id}/commands``. Ids make delivery idempotent: an agent never applies an
    id twice."""

    id: int
    kind: CommandKind
    reason: str = ""
    modules: tuple[str, ...] | None = None
    """fallback/promote: qualified module names; None means the whole model."""
    escalation: bool = False
    """fallback: ordered by an escalation; the modules stay in BF16 until a person promotes them."""
    checkpoint_step: int | None = None
    """rollback: restore the checkpoint saved at this step."""
    skip_batches: int = 0
    """rollback: data batches to skip after restoring."""
    lr_scale: float = 1.0
    """rollback: multiply the learning rate by this for ``lr_scale_steps`` steps."""
    lr_scale_steps: int = 0
    onset_step: int | None = None
    """rollback: first step of the anomaly."""
    spike_step: int | None = None
    """rollback: last step of the anomaly the decision saw."""

    def __post_init__(self) -> None:
        if self.kind is CommandKind.ROLLBACK and self.checkpoint_step is None:
            raise ValueError("a rollback command needs a checkpoint_step")
        if self.skip_batches < 0 or self.lr_scale_steps < 0:
            raise ValueError("skip_batches and lr_scale_steps must not be negative")
        if not (0 < self.lr_scale <= 1):
            raise ValueError(f"lr_scale must be in (0, 1], got {self.lr_scale}")

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "kind": str(self.kind), "reason": self.reason,
                "modules": list(self.modules) if self.modules is not None else None,
                "escalation": self.escalation, "checkpoint_step": self.checkpoint_step,
                "skip_batches": self.skip_batches, "lr_scale": self.lr_scale, "lr_scale_steps": self.lr_scale_steps,
                "onset_step": self.onset_step, "spike_step": self.spike_step}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Command:
        """Validate one command; raises ValueError naming the bad field. Unknown fields are
        ignored (a newer service may add some)."""
        try:
            kind = CommandKind(str(raw.get("kind")))
        except ValueError:
            raise ValueError(f"command kind {raw.get('kind')!r} is not one of {[str(k) for k in CommandKind]}") from None
        cid = raw.get("id")
        if not isinstance(cid, int) or isinstance(cid, bool):
            raise ValueError(f"command id must be an int, got {cid!r}")
        modules = raw.get("modules")
        if modules is not None and (not isinstance(modules, list) or not all(isinstance(m, str) for m in modules)):
            raise ValueError("command modules must be a list of module names or null")
        lr_scale = raw.get("lr_scale", 1.0)
        if not isinstance(lr_scale, int | float) or isinstance(lr_scale, bool):
            raise ValueError(f"lr_scale must be a number, got {lr_scale!r}")
        return cls(id=cid, kind=kind, reason=str(raw.get("reason") or ""),
                   modules=tuple(modules) if modules is not None else None,
                   escalation=bool(raw.get("escalation", False)), checkpoint_step=_opt_int(raw, "checkpoint_step"),
                   skip_batches=_opt_int(raw, "skip_batches") or 0, lr_scale=float(lr_scale),
                   lr_scale_steps=_opt_int(raw, "lr_scale_steps") or 0, onset_step=_opt_int(raw, "onset_step"),
                   spike_step=_opt_int(raw, "spike_step"))


@dataclass(frozen=True, slots=True)
class CommandAck:
    """The agent's answer to a command: the ``data`` of a ``command_acknowledged`` event."""

    command_id: int
    status: AckStatus
    applied_step: int | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"command_id": self.command_id, "status": str(self.status), "applied_step": self.applied_step,
                "error": self.error}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> CommandAck:
        """Validate an acknowledgement; raises ValueError naming the bad field."""
        cid = raw.get("command_id")
        if not isinstance(cid, int) or isinstance(cid, bool):
            raise ValueError(f"command_id must be an int, got {cid!r}")
        try:
            status = AckStatus(str(raw.get("status")))
        except ValueError:
            raise ValueError(f"status {raw.get('status')!r} is not one of {[str(s) for s in AckStatus]}") from None
        error = raw.get("error")
        return cls(command_id=cid, status=status, applied_step=_opt_int(raw, "applied_step"),
                   error=None if error is None else str(error))


def encode_float(value: float | None) -> float | str | None:
    """Encode one float for JSON: finite values as numbers, NaN/+-Inf as strings."""
    if value is None:
        return None
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return float(value)


def decode_float(value: float | int | str | None) -> float | None:
    """Inverse of :func:`encode_float`; raises ValueError on anything else."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return NONFINITE_STRINGS[value]
        except KeyError:
            raise ValueError(f"expected a number, 'NaN', 'Infinity' or '-Infinity', got {value!r}") from None
    return float(value)


def encode_f32(data: bytes | bytearray | memoryview) -> str:
    """Base64 of little-endian float32 bytes (the caller guarantees dtype and byte order)."""
    if _fast_b64 is not None:
        return str(_fast_b64.b64encode_as_string(data))
    return base64.b64encode(data).decode("ascii")


def decode_f32(text: str) -> bytes:
    """Strict base64 decode; raises ValueError naming the problem."""
    try:
        if _fast_b64 is not None:
            return bytes(_fast_b64.b64decode(text, validate=True))
        return binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"invalid base64: {exc}") from None


def tensor_stats_block(
    *, stats: Sequence[str], steps: Sequence[int], n_tensors: int, data: bytes | bytearray | memoryview
) -> dict[str, Any]:
    """One block of per-tensor statistics.

    ``data`` holds float32 values laid out ``[step][stat][tensor]`` (C order). On a
    big-endian host the caller must byteswap first; we refuse rather than corrupt.
    """
    if sys.byteorder != "little":  # pragma: no cover - no such training hosts in practice
        raise ValueError("tensor_stats_block expects little-endian float32 data")
    expected = len(steps) * len(stats) * n_tensors * 4
    if len(data) != expected:
        raise ValueError(
            f"data has {len(data)} bytes, expected {expected} = {len(steps)} steps x {len(stats)} stats "
            f"x {n_tensors} tensors x 4"
        )
    return {
        "stats": list(stats),
        "steps": [int(s) for s in steps],
        "n_tensors": int(n_tensors),
        "dtype": "<f4",
        "data": encode_f32(data),
    }


def new_batch_id() -> str:
    """A fresh idempotency key; retries of one batch must reuse it."""
    return uuid.uuid4().hex


def make_batch(
    *,
    run_id: str,
    rank: int = 0,
    segment: int = 0,
    batch_id: str | None = None,
    tensors: Iterable[Mapping[str, Any]] = (),
    steps: Iterable[Mapping[str, Any]] = (),
    tensor_stats: Iterable[Mapping[str, Any]] = (),
    events: Iterable[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """Assemble an ingest batch; step and event floats are encoded for JSON here."""
    if not _RUN_ID_RE.match(run_id):
        raise ValueError(f"run_id {run_id!r} must match {RUN_ID_PATTERN}")
    encoded_steps = []
    for rec in steps:
        out = dict(rec)
        for key in ("time", *STEP_FIELDS):
            if key in out:
                out[key] = encode_float(out[key])
        encoded_steps.append(out)
    return {
        "protocol": PROTOCOL_VERSION,
        "batch_id": batch_id or new_batch_id(),
        "run_id": run_id,
        "rank": rank,
        "segment": segment,
        "tensors": [dict(t) for t in tensors],
        "steps": encoded_steps,
        "tensor_stats": [dict(b) for b in tensor_stats],
        "events": [_encode_nonfinite(dict(e)) for e in events],
    }


def _encode_nonfinite(value: Any) -> Any:
    """Event data travels as the scalars do: NaN/+-Inf anywhere in it become "NaN", "Infinity",
    "-Infinity" (JSON has none; PostgreSQL refused the whole batch with bare literals)."""
    if isinstance(value, float):
        return encode_float(value) if not math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: _encode_nonfinite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encode_nonfinite(v) for v in value]
    return value


def dumps(payload: Mapping[str, Any]) -> bytes:
    """Serialise a payload; refuses bare NaN/Inf (they must have been encoded as strings)."""
    return json.dumps(payload, allow_nan=False, separators=(",", ":")).encode("utf-8")


def gzip_body(body: bytes, *, level: int = 1) -> bytes:
    """gzip at a low level: the float32 blocks barely compress, so speed matters more."""
    return gzip.compress(body, compresslevel=level)
