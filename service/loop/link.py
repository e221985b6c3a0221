"""The messages between the serving process and its loop process, over one Unix socket pair.

A frame is ``<length: u32><kind: 1 byte><payload>``. Serving process -> loop process: ``HELD``
(a stored small batch: run, queue row, whether it is non-finite, and the decoded batch, pickled),
``BATCH`` (the same without the batch, which the loop process reads back from the database: a
large batch, or one the socket had no room for) and ``DRAIN`` (judge everything told so far, then
answer ``DRAINED``). Only the socket's trusted peer, a process this one spawned, sends pickles. Loop process -> serving process: ``READY``, ``COMMANDS`` (a run's
pending commands as the pass that issued them committed them: what wakes long-polls), ``STATS``
(the loop's counters, for ``/metrics``) and ``DRAINED``.
"""

from __future__ import annotations

import json
import pickle
import struct
from collections.abc import Iterator, Sequence
from enum import Enum
from typing import Any

from fp8guard import wire
from fp8guard.service.domain import Batch

__all__ = ["Frames", "Kind", "batch_frame", "commands_frame", "drain_frame", "drained_frame", "frame", "held_frame",
           "read_batch", "read_commands", "read_drain", "read_drained", "read_held", "read_stats", "stats_frame"]

_HEADER = struct.Struct("<IB")
_BATCH = struct.Struct("<qq?")
_DRAIN = struct.Struct("<Id")
_DRAINED = struct.Struct("<I?")


class Kind(bytes, Enum):
    BATCH = b"B"
    HELD = b"H"
    DRAIN = b"D"
    READY = b"R"
    COMMANDS = b"C"
    STATS = b"S"
    DRAINED = b"d"


def frame(kind: Kind, payload: bytes = b"") -> bytes:
    return _HEADER.pack(len(payload), kind[0]) + payload


def batch_frame(run_pk: int, queue_id: int | None, urgent: bool) -> bytes:
    return frame(Kind.BATCH, _BATCH.pack(run_pk, -1 if queue_id is None else queue_id, urgent))


def read_batch(payload: bytes) -> tuple[int, int | None, bool]:
    run_pk, queue_id, urgent = _BATCH.unpack_from(payload)
    return run_pk, None if queue_id < 0 else queue_id, urgent


def held_frame(run_pk: int, queue_id: int, urgent: bool, batch: Batch) -> bytes:
    """A stored batch with its decoded contents, so the loop process need not read it back."""
    return frame(Kind.HELD, _BATCH.pack(run_pk, queue_id, urgent) + pickle.dumps(batch, protocol=5))


def read_held(payload: bytes) -> tuple[int, int | None, bool, Batch]:
    batch = pickle.loads(memoryview(payload)[_BATCH.size:])
    assert isinstance(batch, Batch)
    return (*read_batch(payload), batch)


def drain_frame(token: int, timeout: float) -> bytes:
    return frame(Kind.DRAIN, _DRAIN.pack(token, timeout))


def read_drain(payload: bytes) -> tuple[int, float]:
    token, timeout = _DRAIN.unpack(payload)
    return int(token), float(timeout)


def drained_frame(token: int, ok: bool) -> bytes:
    return frame(Kind.DRAINED, _DRAINED.pack(token, ok))


def read_drained(payload: bytes) -> tuple[int, bool]:
    token, ok = _DRAINED.unpack(payload)
    return int(token), bool(ok)


def commands_frame(run_id: str, pending: Sequence[wire.Command]) -> bytes:
    body = {"run_id": run_id, "commands": [c.to_json() for c in pending]}
    return frame(Kind.COMMANDS, json.dumps(body, separators=(",", ":")).encode())


def read_commands(payload: bytes) -> tuple[str, list[wire.Command]]:
    body = json.loads(payload)
    return str(body["run_id"]), [wire.Command.from_json(c) for c in body["commands"]]


def stats_frame(counters: dict[str, float]) -> bytes:
    return frame(Kind.STATS, json.dumps(counters).encode())


def read_stats(payload: bytes) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(payload)
    return body


class Frames:
    """Splits a byte stream into frames: ``feed`` bytes as they come, iterate complete frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> Iterator[tuple[Kind, bytes]]:
        self._buf += data
        at = 0
        while len(self._buf) - at >= _HEADER.size:
            length, kind = _HEADER.unpack_from(self._buf, at)
            end = at + _HEADER.size + length
            if len(self._buf) < end:
                break
            yield Kind(bytes((kind,))), bytes(self._buf[at + _HEADER.size:end])
            at = end
        del self._buf[:at]
