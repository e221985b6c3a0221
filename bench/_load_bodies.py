"""The bodies the simulated agents of ``bench/load.py`` send.

Each simulated agent is one run (``PUT /v1/runs/{id}``) that ships its tensor table in its
first batch, then batches of ``--steps-per-batch`` steps (loss, grad_norm, lr, time) with one
gzip-compressed stats block of ``--stats`` stats x ``--tensors`` tensors, healthy values only
(no detector rule fires).
"""

from __future__ import annotations

import json
import math
import random
import time

import numpy as np

from fp8guard import wire

STAT_NAMES = ("amax", "scale", "saturation", "amax_history_max", "overflows", "underflows")
ROLES = (("fwd_input", "e4m3"), ("fwd_weight", "e4m3"), ("bwd_grad_output", "e5m2"))
VARIANTS = 8  # pre-encoded stats blocks, used in turn
_MARK = "@fp8guard-load-block@"  # where a block's pre-compressed JSON string goes in a body


class Batches:
    """Pre-encodes the float32 blocks once, shared by every agent; a batch adds ids, steps and scalars."""

    def __init__(self, tensors: int, stats: int, steps: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.stats = [*STAT_NAMES[:stats], *(f"extra{k}" for k in range(stats - len(STAT_NAMES)))]
        self.n_tensors, self.steps, self.rng = tensors, steps, random.Random(seed)
        level = rng.lognormal(0.0, 1.0, size=tensors)  # each tensor's typical amax
        hist = level * 1.25  # the amax history's maximum: the delayed-scaling scale keeps headroom
        self.blocks: list[str] = []
        self.gzipped: list[bytes] = []
        """Each block's JSON string, gzipped once: a body is sent as three gzip members (RFC 1952
        allows several; the service reads them whole), so the load generator compresses only the
        few hundred bytes that change. The service inflates exactly as many bytes either way."""
        for _ in range(VARIANTS):
            amax = level * np.exp(rng.normal(0.0, 0.02, size=(steps, tensors)))
            cols = {"amax": amax, "scale": np.broadcast_to(448.0 / hist, amax.shape),
                    "saturation": amax / hist, "amax_history_max": np.broadcast_to(hist, amax.shape)}
            values = np.stack([cols.get(name, np.zeros_like(amax)) for name in self.stats], axis=1)
            self.blocks.append(wire.encode_f32(values.astype("<f4").tobytes()))
            self.gzipped.append(wire.gzip_body(json.dumps(self.blocks[-1]).encode()))
        self.table = [{"index": i, "name": f"layers.{i // 3}.fc:{ROLES[i % 3][0]}",
                       "module": f"layers.{i // 3}.fc", "role": ROLES[i % 3][0], "format": ROLES[i % 3][1]}
                      for i in range(tensors)]

    def body(self, run_id: str, first_step: int, k: int, *, with_tensors: bool,
             nan_last: bool = False) -> bytes:
        head, packed, tail = self.parts(run_id, first_step, k, with_tensors=with_tensors, nan_last=nan_last)
        return head + packed + tail

    def parts(self, run_id: str, first_step: int, k: int, *, with_tensors: bool,
              nan_last: bool = False) -> tuple[bytes, bytes, bytes]:
        """A body as its three gzip members: the gzipped head and tail (ids, steps, scalars) and
        the shared pre-compressed block between them."""
        steps = list(range(first_step, first_step + self.steps))
        now, g = time.time(), self.rng.gauss
        rows = [{"step": s, "time": now, "loss": 2.5 + 0.01 * g(0, 1), "grad_norm": 1.0 + 0.05 * g(0, 1),
                 "lr": 3e-4} for s in steps]
        data, packed = self.blocks[k % VARIANTS], self.gzipped[k % VARIANTS]
        if nan_last:
            # A NaN loss and, on the same step, an infinite amax in one tensor: FP8 evidence, so the
            # service's answer is a BF16 fallback of that module (a NaN alone, with no checkpoint
            # to roll back to, pages a person instead).
            rows[-1]["loss"] = math.nan  # make_batch sends it as "NaN"
            values = np.frombuffer(wire.decode_f32(data), dtype="<f4").reshape(
                self.steps, len(self.stats), self.n_tensors).copy()
            values[-1, 0, 0] = np.inf
            data = wire.encode_f32(values.tobytes())
            packed = wire.gzip_body(json.dumps(data).encode())
        payload = wire.make_batch(
            run_id=run_id, tensors=self.table if with_tensors else (), steps=rows,
            tensor_stats=[{"stats": self.stats, "steps": steps, "n_tensors": self.n_tensors, "dtype": "<f4",
                           "data": _MARK}])
        head, tail = wire.dumps(payload).split(json.dumps(_MARK).encode())
        return wire.gzip_body(head), packed, wire.gzip_body(tail)


class Prepared:
    """``--pre-encode``: one agent's bodies, built before the timed window (distinct batch ids,
    steps increasing), so the window measures the HTTP round trips without the body building that
    a real agent does on the training host. Kept as gzip members (the stats block is shared), so
    thousands of them cost a few MB; an agent that sends more than were prepared builds the rest
    in the window and counts them (``pre_encoded.built_in_window``)."""

    def __init__(self, batches: Batches, run_id: str, count: int) -> None:
        self.parts = [batches.parts(run_id, k * batches.steps, k, with_tensors=k == 0) for k in range(count)]
        self.built_in_window = 0
