"""``TableSumOfSquares``: the gradients' sum of squares in one Triton launch, whatever their number.

Read through a device table of the tensors' addresses (:class:`~.staging.Staging`); one partial
per program, so the sum is deterministic. :class:`fp8guard.agent.telemetry.GradNorm` uses it on
CUDA; its torch path (foreach) gives the same value up to float32 summation order.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from fp8guard.agent.kernels._launch import (
    BLOCK,
    CompiledLaunch,
    device_index,
    max_programs,
    specialization_key,
    triton_modules,
)
from fp8guard.agent.kernels.staging import Staging

_TL_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

# Calibration (H200, bf16 gradients of two 605M-parameter TE stacks, 1.2 GB; ``python
# bench/gpu_table_norm.py``, docs/gpu-results/gpu_table_norm.2026-12-03.json): these defaults read
# 3.0 TB/s, 81 % of torch's vector_norm over one contiguous buffer of the same bytes (3.7 TB/s,
# the ceiling for one pass); the fastest of 81 configurations (block 2048, 4 loads per entry, 16
# warps, 2 programs per SM) 3.2 TB/s, 5 % more, with ten times the float32 rounding (fewer,
# longer partial sums: 8.9e-7 against 9.1e-8 from a float64 norm). Kept: the rounding matters more.
SUB_BLOCKS = 1
"""Blocks of ``BLOCK`` elements per entry of the block table (one chain of table reads each)."""
WARPS = 8
"""Warps per program."""
PROGRAMS_PER_SM = 8
"""Programs per multiprocessor (each loops over an equal run of entries)."""


@functools.cache
def _kernel() -> Any:
    """The compiled sum-of-squares kernel, or None when Triton cannot be imported."""
    if triton_modules() is None:
        return None
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator, unused-ignore]
    def table_sumsq_kernel(ptrs_ptr, blk_tensor_ptr, blk_start_ptr, numel_ptr, out_ptr, n_blocks,  # type: ignore[no-untyped-def]
                           DTYPE: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, ITERS: tl.constexpr):
        # Many tensors in one launch: program pid reads entries pid*ITERS .. pid*ITERS+ITERS-1 of
        # the block table (tensor index, start), the tensor's address from the pointer table. An
        # entry covers SUB consecutive blocks of BLOCK elements: the table reads (a chain of
        # dependent loads) are paid once per entry, the SUB data loads are independent.
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(ITERS):
            b = pid * ITERS + i
            valid = b < n_blocks
            t = tl.load(blk_tensor_ptr + b, mask=valid, other=0)
            start = tl.load(blk_start_ptr + b, mask=valid, other=0)
            n = tl.load(numel_ptr + t)
            base = tl.load(ptrs_ptr + t).to(tl.pointer_type(DTYPE))
            for j in tl.static_range(SUB):
                offs = start + j * BLOCK + tl.arange(0, BLOCK)
                x = tl.load(base + offs, mask=(offs < n) & valid, other=0.0).to(tl.float32)
                acc += x * x
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))  # one partial per program: deterministic

    return table_sumsq_kernel


class TableSumOfSquares:
    """``sum(t.float()**2)`` over a fixed list of tensor shapes of one dtype, in one Triton launch.

    Built once for the shapes (e.g. every gradient of a model): device tables of blocks (tensor
    index, start), of sizes and of the tensors' addresses. The addresses travel only when they
    change (:meth:`point`, through :class:`~.staging.Staging`: no host sync); a call then costs one
    launch and one sum, whatever the number of tensors. One program per group of consecutive
    blocks, one partial each: deterministic. The caller guarantees that the tensors at the
    addresses pointed to are alive, contiguous, of this dtype and of these sizes at each call.
    """

    def __init__(self, numels: Sequence[int], dtype: torch.dtype, device: torch.device, *,
                 block: int = BLOCK, sub: int = SUB_BLOCKS, warps: int = WARPS, per_sm: int = PROGRAMS_PER_SM) -> None:
        """``block`` elements per load, ``sub`` loads per block-table entry, ``warps`` per program,
        ``per_sm`` programs per multiprocessor: the defaults are calibrated (module constants)."""
        if block < 1 or sub < 1 or warps < 1 or per_sm < 1:
            raise ValueError("TableSumOfSquares: block, sub, warps and per_sm must be positive")
        if _kernel() is None:
            raise RuntimeError("TableSumOfSquares needs Triton")
        if dtype not in _TL_DTYPE:
            raise ValueError(f"TableSumOfSquares: unsupported dtype {dtype}")
        self.dtype, self.device, self.block, self.sub, self.warps = dtype, device, block, sub, warps
        tensor_of: list[int] = []
        start_of: list[int] = []
        for i, n in enumerate(numels):
            for start in range(0, int(n), block * sub):
                tensor_of.append(i)
                start_of.append(start)
        self.n_blocks = len(tensor_of)
        self.count = len(numels)
        # As many programs as fill the GPU per_sm deep, each over an equal run of entries (the
        # run length is exact, not a power of two: one compiled variant per model and dtype).
        self._iters = max(1, -(-self.n_blocks // max_programs(device_index(device), per_sm)))
        self._grid = max(1, -(-self.n_blocks // self._iters))
        self._blk_tensor = torch.tensor(tensor_of, dtype=torch.int32, device=device)
        self._blk_start = torch.tensor(start_of, dtype=torch.int64, device=device)
        self._numel = torch.tensor([int(n) for n in numels], dtype=torch.int64, device=device)
        self._partials = torch.empty(self._grid, dtype=torch.float32, device=device)
        self._staging = Staging(torch.zeros(max(1, self.count), dtype=torch.int64, device=device))
        self.pointed = False
        """Whether the address table was filled at least once (before that, calls return None)."""
        self._launch = CompiledLaunch()
        self._args = (self._staging.table, self._blk_tensor, self._blk_start, self._numel, self._partials,
                      self.n_blocks)
        self._key: tuple[object, ...] | None = None

    def point(self, addresses: Sequence[int]) -> bool:
        """Point the table at the tensors at ``addresses`` (one per shape, in order); False when
        it could not be done now (see :class:`~.staging.Staging`): the previous addresses stay."""
        if len(addresses) != self.count:
            raise ValueError(f"TableSumOfSquares: {len(addresses)} addresses for {self.count} tensors")
        done = self._staging.upload(addresses) if self.count else True
        self.pointed = self.pointed or done
        return done

    def __call__(self) -> torch.Tensor | None:
        """The sum of squares as a 0-d float32 device tensor (one launch, one sum); None before
        the first :meth:`point` or without elements."""
        if not self.pointed or not self.n_blocks:
            return None
        import triton.language as tl

        consts = (getattr(tl, _TL_DTYPE[self.dtype]), self.block, self.sub, self._iters)

        def jit() -> Any:
            return _kernel()[(self._grid,)](*self._args, DTYPE=consts[0], BLOCK=self.block, SUB=self.sub,
                                            ITERS=self._iters, num_warps=self.warps)

        # Every argument is this object's own buffer, at a fixed address: one key for good.
        self._key = self._key or (self.dtype, self.block, self.sub, self._iters, self.warps,
                                  *specialization_key(self._args))
        self._launch(self._grid, self._args, consts, jit, key=self._key)
        return self._partials.sum()
