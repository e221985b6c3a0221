"""``CountBatch``: several FP8 casts counted in one launch of the count kernel.

:func:`~.counts.count_cast_into` costs one launch per operand: 144 for a counted step of the 604M
model, whose enqueue alone takes 1.0-1.6 ms on the H200's hosts whatever the Python (7-11 us per
call of Triton's C launcher; docs/gpu.md, eleventh session). A batch holds the operands handed to it
and counts up to :attr:`CountBatch.slots` (at most :data:`BATCH_SLOTS`) of them in one launch: the
batched kernel takes each operand's addresses and element count as arguments, and each of its
programs runs as a program of that operand's own launch would, so the integers are the same. Only the
FP8-bytes variant tested in words is batched, for operands whose addresses are 16-byte aligned and
whose element count is a multiple of 16 (what the JIT's specialisation would tell the compiler for a
launch of one; every operand of a transformer's GEMMs here); any other operand is counted at once,
by its own launch.

Holding an operand until its launch keeps its tensors alive that long: up to ``slots`` operands'
high-precision tensors and FP8 bytes per group (one group per FP8 format, dtype, device and
stream). The caller flushes before anything could free or change them:
:meth:`fp8guard.agent.sources.te_counts.InspectCounts.use_batch` says where. A launch goes on the
stream the operands were handed over on; the flushing stream then waits for it.

On by default (:data:`OPERANDS_PER_LAUNCH` 8) since it was measured on an H100 (fourteenth
session, docs/gpu.md): the 604M model's 144 operands eight to a launch took 2.51 ms of GPU time
against 3.73 ms one launch each, 10.2 against 19.5 us of host time an operand, and every operand's
counts equalled TE's on each of four counted steps (``bench/gpu_counts.py verify --batched``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fp8guard.agent.fp8 import Fp8Format
from fp8guard.agent.kernels import counts
from fp8guard.agent.kernels._launch import (
    CompiledLaunch,
    _stream_lookup,
    launch_shape,
    triton_available,
)

__all__ = ["BATCH_SLOTS", "OPERANDS_PER_LAUNCH", "CountBatch"]

BATCH_SLOTS = 8
"""Operands one launch of the batched count kernel takes at most (its signature has eight slots:
``_count_kernels.count_batch_kernel``)."""

OPERANDS_PER_LAUNCH = 8
"""Operands counted per launch under TE's inspection API (2 to :data:`BATCH_SLOTS`; 0 or 1: one
launch per operand, each cast counted as TE hands it over). Why more: under 0.5 ms of enqueue per
counted step needs at most 40-70 launches where the 604M model has 144 operands (docs/gpu.md);
counted at each module's forward end and eight gradients a launch, they take about 42. On an H100
the batched launches also took a third less GPU time (fewer, fuller waves; module docs)."""

_LAUNCH = CompiledLaunch()
"""The batched kernel's launches through its compiled handles (shared by every batch: a new batch
finds them compiled)."""

_UNUSED_FIRST = 2**31 - 1
"""An unused slot's first program: past every program, so none selects it."""


class _Held(NamedTuple):
    out: torch.Tensor
    x: torch.Tensor
    q: torch.Tensor
    scale_inv: torch.Tensor
    slot: tuple[int, int, int, int, int]
    """The operand's slot arguments: the four addresses and the element count (read once, at
    :meth:`CountBatch.add`; the tensors are held, so the allocator cannot free or move them. An
    in-place storage resize could, as FSDP2 frees a gathered weight: the caller launches before
    that, see ``InspectCounts.sync_hooks``)."""


class CountBatch:
    """Holds casts to count and counts up to ``slots`` of them per launch (see the module docs).

    :meth:`add` takes what :func:`~.counts.count_cast_into` takes (with the FP8 bytes); the counts
    land in each operand's ``out`` row by the time :meth:`flush` returns (enqueued, as always).
    """

    def __init__(self, slots: int = BATCH_SLOTS, *, max_held_bytes: int | None = None) -> None:
        """``max_held_bytes``: launch a group as soon as its held tensors (high-precision values
        and FP8 bytes) reach this many bytes, even with fewer than ``slots`` operands (None: no
        bound but ``slots``): for a run whose memory is too tight to keep a few large operands
        alive a little longer, at the price of launches."""
        if not 2 <= slots <= BATCH_SLOTS:
            raise ValueError(f"CountBatch: slots must be 2 to {BATCH_SLOTS}, got {slots}")
        if max_held_bytes is not None and max_held_bytes < 1:
            raise ValueError(f"CountBatch: max_held_bytes must be positive, got {max_held_bytes}")
        self.slots = slots
        self.max_held_bytes = max_held_bytes
        self._pending: dict[tuple[Any, ...], list[_Held]] = {}
        self._held_bytes: dict[tuple[Any, ...], int] = {}
        self.launches = 0
        """Batched launches made (a host-side tally, for tests and benches)."""
        self.alone = 0
        """Operands counted by a launch of their own (what the batched kernel does not take)."""

    def __len__(self) -> int:
        """Operands held now."""
        return sum(len(held) for held in self._pending.values())

    def add(self, out: torch.Tensor, x: torch.Tensor, *, scale: torch.Tensor, scale_inv: torch.Tensor,
            fmt: Fp8Format, fp8_bytes: torch.Tensor) -> None:
        """Count the cast ``x -> fp8_bytes`` into ``out`` at the group's next launch (at once when
        the operand cannot be batched). ``scale`` serves only a launch of its own: the FP8-bytes
        test reads no scale."""
        slot = self._slot(out, x, fp8_bytes, scale_inv)
        if slot is None:
            self.alone += 1
            counts.count_cast_into(out, x, scale=scale, scale_inv=scale_inv, fmt=fmt, fp8_bytes=fp8_bytes)
            return
        index = x.get_device()  # (-1 off CUDA; an integer: cheaper than x.device per operand)
        key = (fmt, x.dtype, index, _stream_lookup()() if index >= 0 else None)
        held = self._pending.setdefault(key, [])
        held.append(_Held(out, x, fp8_bytes, scale_inv, slot))
        if self.max_held_bytes is not None:
            size = self._held_bytes[key] = self._held_bytes.get(key, 0) + x.numel() * (x.element_size() + 1)
            if size >= self.max_held_bytes:
                self._flush_group(key, held)
                return
        if len(held) == self.slots:
            self._flush_group(key, held)

    def flush(self) -> None:
        """Enqueue the counting of every operand held."""
        for key, held in self._pending.items():
            if held:
                self._flush_group(key, held)

    def drop(self) -> None:
        """Forget the operands held, uncounted (their window was abandoned)."""
        for held in self._pending.values():
            held.clear()
        self._held_bytes.clear()

    @staticmethod
    def _slot(out: torch.Tensor, x: torch.Tensor, q: torch.Tensor,
              scale_inv: torch.Tensor) -> tuple[int, int, int, int, int] | None:
        """The operand's slot arguments if it holds to what the batched kernel's compiled code
        assumes, else None (checked cheapest first, each value read once: this runs per operand)."""
        n = x.numel()
        if not (0 < n <= counts.MAX_KERNEL_ELEMENTS and not n % 16 and q.numel() == n):
            return None
        xp, qp = x.data_ptr(), q.data_ptr()
        if (xp % 16 or qp % 16 or x.dtype not in counts._HP_KIND or q.element_size() != 1
                or scale_inv.dtype != torch.float32 or not x.is_contiguous() or not q.is_contiguous()
                or not counts.BYTES_IN_WORDS or not (x.is_cuda or triton_available(x.device))
                or counts._batch_kernel() is None):
            return None
        return xp, qp, scale_inv.data_ptr(), out.data_ptr(), n

    def _flush_group(self, key: tuple[Any, ...], held: list[_Held]) -> None:
        fmt, dtype, index, stream = key
        ops = list(held)
        held.clear()
        self._held_bytes.pop(key, None)
        device = ops[0].x.device
        rows, cols, per_sm, warps = counts.COUNT_SHAPES["bytes"]
        tile = rows * cols
        # one loop length for every slot: as a launch of all their elements would have it
        _, iters = launch_shape(sum(op.slot[4] for op in ops), device, tile, per_sm=per_sm)
        slot_args: list[int] = []
        firsts: list[int] = []
        grid = 0
        for op in ops:
            slot_args += op.slot
            firsts.append(grid)
            grid += -(-op.slot[4] // (tile * iters))
        # unused slots repeat slot 0 and start past the grid: no program selects them
        slot_args += slot_args[:5] * (BATCH_SLOTS - len(ops))
        firsts += [_UNUSED_FIRST] * (BATCH_SLOTS - len(ops))
        args = (*slot_args, *firsts[1:])
        consts = counts.kernel_consts(fmt, dtype, True, rows, cols, iters, True, counts.ROW_BY_ROW, counts.TILES_AHEAD)
        kernel = counts._batch_kernel()

        def jit() -> Any:
            return kernel[(grid,)](*args, **dict(zip(counts.CONST_NAMES, consts, strict=True)), num_warps=warps)

        # What the JIT specialises on is the same for every batch of these constants: the
        # operands' addresses are 16-byte aligned and their counts multiples of 16 (the batch
        # takes no other), the other arguments are not specialised (``do_not_specialize``).
        _on_stream(stream, lambda: _LAUNCH(grid, args, consts, jit, key=(*consts, warps, index)))
        self.launches += 1


def _on_stream(stream: int | None, fn: Callable[[], Any]) -> Any:
    """``fn()`` on ``stream`` (a raw CUDA handle, 0 for the default stream; None off CUDA), where
    the operands were made; the current stream then waits for it, so what the caller enqueues next
    (a read of the counts) comes after the launch."""
    if stream is None or stream == _stream_lookup()():  # (no torch Stream object on the usual path)
        return fn()
    current = torch.cuda.current_stream()
    other = torch.cuda.ExternalStream(stream) if stream else torch.cuda.default_stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(other):
        result = fn()
    current.wait_stream(other)
    return result
