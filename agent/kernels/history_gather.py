"""``HistoryGather``: Transformer Engine's delayed-scaling reads of every module in one Triton launch.

Read through a device table of TE's tensors' addresses (:class:`~.staging.Staging`);
:mod:`fp8guard.agent.sources.te_delayed` uses it on CUDA and reads through torch ops elsewhere.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from fp8guard.agent.kernels._launch import CompiledLaunch, triton_modules
from fp8guard.agent.kernels.staging import Staging

_GATHER_COLUMNS, _GATHER_ROWS = 32, 64
"""History gather tile: columns per program, history rows per loop iteration."""


@functools.cache
def _kernel() -> Any:
    """The compiled gather kernel, or None when Triton cannot be imported."""
    if triton_modules() is None:
        return None
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator, unused-ignore]
    def history_gather_kernel(table_ptr, fp8_max_ptr, div_ptr, mask_ptr, in_use_ptr, out_ptr,  # type: ignore[no-untyped-def]
                              n, out_amax, out_scale, out_hmax, out_col,
                              MAX_LEN: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
        # Column c: its history slot at table[0, c] (address of row 0), table[1, c] rows of stride
        # table[2, c] elements, its live scale at table[3, c]. One program per BLOCK_C columns.
        pid = tl.program_id(0)
        cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
        valid = cols < n
        base = tl.load(table_ptr + cols, mask=valid, other=0).to(tl.pointer_type(tl.float32))
        length = tl.load(table_ptr + n + cols, mask=valid, other=1)
        stride = tl.load(table_ptr + 2 * n + cols, mask=valid, other=0)
        scale_at = tl.load(table_ptr + 3 * n + cols, mask=valid, other=0).to(tl.pointer_type(tl.float32))
        scale_now = tl.load(scale_at, mask=valid, other=1.0)
        latest = tl.load(base + (length - 1) * stride, mask=valid, other=0.0)
        top = tl.full([BLOCK_C], float("-inf"), tl.float32)
        nan = tl.zeros([BLOCK_C], dtype=tl.int32)
        for r0 in range(0, MAX_LEN, BLOCK_R):  # the longest history: a compile-time bound
            rows = r0 + tl.arange(0, BLOCK_R)
            inside = (rows[:, None] < length[None, :]) & valid[None, :]
            x = tl.load(base[None, :] + rows[:, None] * stride[None, :], mask=inside, other=float("-inf"))
            # torch's amax propagates NaN; a NaN-free max plus a NaN flag gives that on every backend
            nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), axis=0))
            top = tl.maximum(top, tl.max(tl.where(x != x, float("-inf"), x), axis=0))
        hmax = tl.where(nan > 0, float("nan"), top)
        # history length 1: TE zeroed the only row after using it; the amax is fp8_max / (scale * 2**margin)
        derived = tl.math.div_rn(tl.load(fp8_max_ptr + cols, mask=valid, other=1.0),
                                 scale_now * tl.load(div_ptr + cols, mask=valid, other=1.0))
        single = length == 1
        amax = tl.where(single, derived, latest)
        hmax = tl.where(single, derived, hmax)
        keep = tl.load(mask_ptr + cols, mask=valid, other=1.0)
        in_use = tl.load(in_use_ptr + cols, mask=valid, other=0.0)
        tl.store(out_ptr + out_amax + cols * out_col, amax * keep, mask=valid)
        tl.store(out_ptr + out_hmax + cols * out_col, hmax * keep, mask=valid)
        tl.store(out_ptr + out_scale + cols * out_col, in_use, mask=valid)
        tl.store(in_use_ptr + cols, scale_now, mask=valid)

    return history_gather_kernel


class HistoryGather:
    """Transformer Engine's delayed-scaling reads of ``n`` columns in one Triton launch.

    Column ``c`` is one slot of a module's ``amax_history`` (``[L, slots]``, float32) and of its
    ``scale``; a device table holds, per column, the address of the slot's first history row, the
    history length, the row stride and the address of the slot's scale (:meth:`point`, when TE's
    tensors move: through :class:`~.staging.Staging`, no host sync). Each call writes, per column:
    AMAX = the last history row (length 1: ``fp8_max / (scale * div)``, TE having zeroed the row),
    the history's maximum (NaN if any row is NaN, as ``torch.amax``), SCALE = ``in_use`` (the scale
    seen at the previous call), and then ``in_use`` = the live scale; AMAX and the maximum are
    multiplied by ``keep``. The caller keeps the pointed-to tensors alive.
    """

    def __init__(self, fp8_max: Sequence[float], div: Sequence[float], device: torch.device) -> None:
        if _kernel() is None:
            raise RuntimeError("HistoryGather needs Triton")
        self.n = len(fp8_max)
        self._fp8_max = torch.tensor(list(fp8_max), dtype=torch.float32, device=device)
        self._div = torch.tensor(list(div), dtype=torch.float32, device=device)
        self._staging = Staging(torch.zeros(4 * max(1, self.n), dtype=torch.int64, device=device))
        self._max_len = 0
        self.pointed = False
        self._launch = CompiledLaunch()

    def point(self, history_at: Sequence[int], lengths: Sequence[int], strides: Sequence[int],
              scale_at: Sequence[int]) -> bool:
        """Point the table at TE's tensors (addresses in bytes, lengths and strides in float32
        elements, per column); False when it could not be done now (the caller reads another way)."""
        if not (len(history_at) == len(lengths) == len(strides) == len(scale_at) == self.n):
            raise ValueError("HistoryGather.point: one address, length, stride and scale address per column")
        done = self._staging.upload([*history_at, *lengths, *strides, *scale_at])
        if done:
            self._max_len = max(lengths, default=1)
            self.pointed = True
        return done

    def __call__(self, out: torch.Tensor, *, in_use: torch.Tensor, keep: torch.Tensor,
                 rows: tuple[int, int, int]) -> None:
        """Write rows ``rows`` = (AMAX, SCALE, HISTORY_MAX) of ``out`` (``[rows, n]``, any strides)."""
        if not self.pointed:
            raise RuntimeError("HistoryGather: point() first")
        amax, scale, hmax = rows
        grid = -(-self.n // _GATHER_COLUMNS)
        args = (self._staging.table, self._fp8_max, self._div, keep, in_use, out, self.n,
                amax * out.stride(0), scale * out.stride(0), hmax * out.stride(0), out.stride(1))
        consts = (self._max_len, _GATHER_COLUMNS, _GATHER_ROWS)
        self._launch(grid, args, consts, lambda: _kernel()[(grid,)](
            *args, MAX_LEN=self._max_len, BLOCK_C=_GATHER_COLUMNS, BLOCK_R=_GATHER_ROWS, num_warps=4))
