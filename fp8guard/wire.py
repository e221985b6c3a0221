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

STEP_FIELDS: Final = ("loss", "grad_norm", "lr")
"""Float fields of a per-step record, in storage order (``tokens`` is an integer)."""

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
    NOTE = "note"


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
        "events": [dict(e) for e in events],
    }


def dumps(payload: Mapping[str, Any]) -> bytes:
    """Serialise a payload; refuses bare NaN/Inf (they must have been encoded as strings)."""
    return json.dumps(payload, allow_nan=False, separators=(",", ":")).encode("utf-8")


def gzip_body(body: bytes, *, level: int = 1) -> bytes:
    """gzip at a low level: the float32 blocks barely compress, so speed matters more."""
    return gzip.compress(body, compresslevel=level)
