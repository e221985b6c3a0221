"""Fused device kernels: exact FP8 cast counts, the gradients' sum of squares, TE's delayed-scaling reads.

The only module of fp8guard that imports Triton (optional: the agent's dependencies stay torch
and httpx). Every function has a torch path that gives the same integers (counts) or the same
value up to float32 summation order (sum of squares); it runs where Triton or a GPU is missing.
Triton's CPU interpreter (``TRITON_INTERPRET=1``) runs the Triton path on CPU tensors, which is
how CI checks the kernels against the torch reference.

Counting (:func:`count_cast_into`) follows Transformer Engine's ``LogFp8TensorStats``
definitions (see :func:`fp8guard.agent.fp8.count_overflow_underflow`) and reads as little as the
definition allows. Given the FP8 bytes TE produced from the high-precision tensor, an element can
only be an underflow if its byte is +/-0, and only be an overflow if its byte is the format's
maximum (satfinite casts clip there; a NaN or inf byte is looked at too): the kernel reads the
1-byte FP8 tensor and fetches the 2-byte high-precision value only where the byte says it might
count. On real tensors few bytes are 0 or max, so the pass reads a little over one byte per
element instead of two (on the H200 it still streamed slower than the plain variant: docs/gpu.md).
Without FP8 bytes it reads the high-precision tensor once, using the scale the cast used.

Nothing here synchronises with the host: results accumulate into device buffers.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from typing import Any

import torch

from fp8guard.agent.fp8 import Fp8Format, count_from_cast, count_overflow_underflow

__all__ = ["HistoryGather", "TableSumOfSquares", "count_cast_into", "triton_available"]

_BLOCK = 4096
_ROWS, _COLS = 64, 64
"""Counting tile: rows of 64 elements (128 bytes of BF16) decide together whether to fetch."""
_MAX_CODE = {Fp8Format.E4M3: 0x7E, Fp8Format.E5M2: 0x7B}
"""Magnitude bits of the largest finite value: 448 (E4M3 0x7E; 0x7F is NaN) and 57344 (E5M2 0x7B;
0x7C is inf and above are NaN). Bytes at or above it are checked against the threshold."""
_HP_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_BITS_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_NONZERO_MASK = {torch.bfloat16: 0x7FFF, torch.float16: 0x7FFF, torch.float32: 0x7FFFFFFF}
"""Zero test on the bits (sign cleared): correct for subnormal inputs whatever the float mode."""


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


@functools.cache
def _triton() -> Any:
    """The compiled kernels, or None when Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # not installed, or a broken install: the torch path is exact too
        return None

    @triton.jit  # type: ignore[untyped-decorator, unused-ignore]
    def count_kernel(x_ptr, q_ptr, scale_ptr, sinv_ptr, out_ptr, n,  # type: ignore[no-untyped-def]
                     FP8_MAX: tl.constexpr, HALF_SUB: tl.constexpr, MAX_CODE: tl.constexpr,
                     NZ_MASK: tl.constexpr, HP_KIND: tl.constexpr, FROM_BYTES: tl.constexpr,
                     ROWS: tl.constexpr, COLS: tl.constexpr, ITERS: tl.constexpr):
        # A tile is ROWS x COLS consecutive elements. From FP8 bytes, the high-precision values of
        # a row of COLS are fetched only when one of its bytes is +/-0 or the maximum: the
        # predicate is uniform along the row, so the fetch stays a vectorised load.
        pid = tl.program_id(0)
        # (9.09e-13, 1.54e-33 and 6.49e32 below are exactly 2**-40, 2**-109 and 2**109.)
        # TE's threshold: fp8_max * scale_inv, one float32 product. A scale near float32 max (TE's
        # value when the amax is tiny) has a subnormal scale_inv, which a flush-to-zero multiply
        # would turn into a threshold of 0: the product is formed from its integer significand
        # instead (power-of-two rescaling is exact in the normal range, where thr always lies).
        sinv = tl.load(sinv_ptr)
        sinv_bits = sinv.to(tl.int32, bitcast=True)
        sinv_sub = ((sinv_bits & 0x7FFFFFFF) < 0x00800000) & ((sinv_bits & 0x7FFFFF) != 0)
        thr = tl.where(sinv_sub, (((sinv_bits & 0x7FFFFF).to(tl.float32) * 9.094947017729282e-13) * FP8_MAX) * 1.5407439555097887e-33,
                       sinv * FP8_MAX)
        scale = tl.load(scale_ptr)
        # per-row tallies (not a full tile of them): fewer registers, more programs in flight
        over = tl.zeros([ROWS], dtype=tl.int32)
        under = tl.zeros([ROWS], dtype=tl.int32)
        tile = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
        for i in range(ITERS):  # program pid owns tiles pid*ITERS .. pid*ITERS+ITERS-1
            offs = (pid * ITERS + i) * (ROWS * COLS) + tile
            inside = offs < n
            if FROM_BYTES:
                mag = tl.load(q_ptr + offs, mask=inside, other=1) & 0x7F
                zero = mag == 0
                top = mag >= MAX_CODE
                row_needs = tl.max((zero | top).to(tl.int32), axis=1) > 0
                need = inside & row_needs[:, None]
                bits = tl.load(x_ptr + offs, mask=need, other=0)
            else:
                bits = tl.load(x_ptr + offs, mask=inside, other=0)
            nonzero = (bits & NZ_MASK) != 0
            # float32 bit patterns by integer moves (BF16 is the top half of a float32), so no
            # conversion instruction can flush a subnormal input to zero
            if HP_KIND == 0:
                b32 = bits.to(tl.int32) << 16
                x = b32.to(tl.float32, bitcast=True)
            elif HP_KIND == 1:  # every float16 value, subnormals included, is a normal float32
                x = bits.to(tl.float16, bitcast=True).to(tl.float32)
                b32 = x.to(tl.int32, bitcast=True)
            else:
                b32 = bits
                x = bits.to(tl.float32, bitcast=True)
            big = tl.abs(x) > thr  # NaN compares false, as in TE
            if FROM_BYTES:
                over += tl.sum((big & top & need).to(tl.int32), axis=1)
                under += tl.sum((nonzero & zero & need).to(tl.int32), axis=1)
            else:
                over += tl.sum(big.to(tl.int32), axis=1)
                # TE's cast rounds the float32 product x * scale; a zero byte is |product| <= half
                # the smallest subnormal (the tie rounds to even: zero). A subnormal float32 x
                # (|x| < 2**-126) goes through its integer significand m: x * scale equals
                # (m * 2**-40 * scale) * 2**-109, and the comparison moves by the same power of
                # two, which is exact: no flush-to-zero multiply can decide it.
                mant = b32 & 0x7FFFFF
                x_sub = ((b32 & 0x7FFFFFFF) < 0x00800000) & (mant != 0)
                small = tl.where(x_sub, tl.abs((mant.to(tl.float32) * 9.094947017729282e-13) * scale) <= HALF_SUB * 6.490371073168535e+32,
                                 tl.abs(x * scale) <= HALF_SUB)
                under += tl.sum((nonzero & small).to(tl.int32), axis=1)
        tl.atomic_add(out_ptr, tl.sum(over, axis=0).to(tl.int64))
        tl.atomic_add(out_ptr + 1, tl.sum(under, axis=0).to(tl.int64))

    return (count_kernel,)


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernels run for tensors on ``device`` (CUDA, or CPU when interpreting)."""
    if device.type != "cuda" and not (device.type == "cpu" and _interpret()):
        return False
    return _triton() is not None


@functools.cache
def _max_programs(device_index: int, per_sm: int = 8) -> int:
    """Enough programs to fill the GPU a few times over; each then loops over its blocks."""
    if _interpret():
        return 4
    return per_sm * torch.cuda.get_device_properties(device_index).multi_processor_count


def _launch_shape(n: int, device: torch.device, block: int = _BLOCK, per_sm: int = 8) -> tuple[int, int]:
    """(programs, blocks per program). Blocks per program is a power of two and a compile-time
    constant (a handful of kernel variants in all, and a loop the compiler can unroll)."""
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
    blocks = -(-n // block)
    iters = 1
    while blocks > iters * _max_programs(index, per_sm):
        iters *= 2
    return -(-blocks // iters), iters


COUNT_SHAPES: dict[str, tuple[int, int, int, int]] = {"hp": (_ROWS, _COLS, 8, 8), "bytes": (_ROWS, _COLS, 8, 8)}
"""Launch shape per variant: (rows, columns of a tile, programs per multiprocessor, warps). The
H200 figures of docs/gpu.md were taken with 64 x 64 tiles, 8 programs per SM and 8 warps for both;
``bench/gpu_counts.py kernels`` times alternatives (it sets this table) before a default moves."""

_COMPILED: dict[tuple[Any, ...], Any] = {}
"""Compiled count kernels by everything Triton specialises on (see :func:`_launch_count`)."""
_fast_launch = [True]
"""Launch through the cached compiled-kernel handle (off after any failure, and under the interpreter)."""


def count_cast_into(
    out: torch.Tensor,
    x: torch.Tensor,
    *,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    fmt: Fp8Format,
    fp8_bytes: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """Add the exact ``[overflows, underflows]`` of the cast ``x -> fmt`` to ``out`` (int64 ``[2]``).

    ``scale`` and ``scale_inv`` are 1-element float32 device tensors: the scale the cast used
    and TE's stored reciprocal. Two variants, the same integers whenever ``scale`` is the cast's:

    * without ``fp8_bytes`` (the high-precision variant) it reads ``x`` once and decides each
      element from the float32 product ``x * scale``, the value TE's cast rounds;
    * with ``fp8_bytes`` (the cast's rowwise FP8 data, same element order as ``x``) it reads the
      1-byte tensor and touches ``x`` only where a byte is +/-0 or at/above the maximum code. It
      needs no ``scale`` at all: the bytes are the cast's own result, so a scale updated in place
      since (delayed scaling, after the pass) cannot make it wrong.

    ``backend``: ``auto`` (Triton where available), ``triton`` or ``torch``. Enqueues only.
    """
    if x.numel() == 0:
        return
    if fp8_bytes is not None and (fp8_bytes.numel() != x.numel() or fp8_bytes.element_size() != 1):
        raise ValueError(f"fp8_bytes has {fp8_bytes.numel()} elements of {fp8_bytes.element_size()} bytes, "
                         f"the tensor {x.numel()} (one byte each expected)")
    use_triton = backend == "triton" or (backend == "auto" and triton_available(x.device))
    if not use_triton or x.dtype not in _HP_KIND or not x.is_contiguous() or (
            fp8_bytes is not None and not fp8_bytes.is_contiguous()):
        out.add_(_torch_counts(x, scale=scale, scale_inv=scale_inv, fmt=fmt, fp8_bytes=fp8_bytes))
        return
    kernels = _triton()
    if kernels is None:
        raise RuntimeError("backend='triton' but Triton cannot be imported")
    rows, cols, per_sm, warps = COUNT_SHAPES["bytes" if fp8_bytes is not None else "hp"]
    n = x.numel()
    # Up to per_sm programs per multiprocessor (enough loads in flight to stream at memory
    # bandwidth), each looping over its tiles; two atomics per program.
    grid, iters = _launch_shape(n, x.device, rows * cols, per_sm=per_sm)
    q = fp8_bytes if fp8_bytes is not None else x
    consts = (fmt.fp8_max, fmt.smallest_subnormal / 2, _MAX_CODE[fmt], _NONZERO_MASK[x.dtype], _HP_KIND[x.dtype],
              fp8_bytes is not None, rows, cols, iters)
    _launch_count(kernels[0], grid, warps, x, q, scale, scale_inv, out, n, consts)


def _launch_count(kernel: Any, grid: int, warps: int, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                  scale_inv: torch.Tensor, out: torch.Tensor, n: int, consts: tuple[Any, ...]) -> None:
    """One launch of the count kernel, through the compiled kernel's own handle when possible.

    Triton's JIT dispatch binds and specialises every argument in Python on each call (about
    30 us of host time here, 4.8 ms for a step's 144 operands on the H200's host). The compiled
    kernel's handle skips that: its C launcher only reads the tensors' addresses. It is reused
    only under the exact key Triton would compute: the constants, each address's 16-byte
    alignment, and the element count's divisibility by 16, equality to 1 and integer width
    (a kernel compiled for aligned addresses must never see unaligned ones).
    """
    bits_dtype = _BITS_VIEW[x.dtype]
    if not _fast_launch[0] or _interpret() or x.device.type != "cuda":
        _jit_launch(kernel, grid, warps, x, q, scale, scale_inv, out, n, consts, bits_dtype)
        return
    addresses = (x.data_ptr(), q.data_ptr(), scale.data_ptr(), scale_inv.data_ptr(), out.data_ptr())
    key = (consts, bits_dtype, q.element_size(), warps, x.device.index, tuple(a % 16 == 0 for a in addresses),
           n % 16 == 0, n == 1, n >= 2**31)
    compiled = _COMPILED.get(key)
    if compiled is None:
        handle = _jit_launch(kernel, grid, warps, x, q, scale, scale_inv, out, n, consts, bits_dtype)
        if handle is not None and hasattr(handle, "__getitem__"):
            _COMPILED[key] = handle
        return
    try:
        # the views are the JIT's argument types; the launcher reads data_ptr() alone, so the
        # tensors themselves go (same addresses), constants in signature order as the JIT passes them
        compiled[(grid, 1, 1)](x, q, scale, scale_inv, out, n, *consts)
    except Exception:  # an API drift in Triton's launcher: back to the JIT for good, same result
        _fast_launch[0] = False
        _COMPILED.clear()
        _jit_launch(kernel, grid, warps, x, q, scale, scale_inv, out, n, consts, bits_dtype)


def _jit_launch(kernel: Any, grid: int, warps: int, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                scale_inv: torch.Tensor, out: torch.Tensor, n: int, consts: tuple[Any, ...],
                bits_dtype: torch.dtype) -> Any:
    fp8_max, half_sub, max_code, nz_mask, hp_kind, from_bytes, rows, cols, iters = consts
    bits = x.view(bits_dtype).reshape(-1)
    qv = q.view(torch.uint8).reshape(-1) if from_bytes else bits
    return kernel[(grid,)](bits, qv, scale, scale_inv, out, n, FP8_MAX=fp8_max, HALF_SUB=half_sub,
                           MAX_CODE=max_code, NZ_MASK=nz_mask, HP_KIND=hp_kind, FROM_BYTES=from_bytes, ROWS=rows,
                           COLS=cols, ITERS=iters, num_warps=warps)


def _torch_counts(x: torch.Tensor, *, scale: torch.Tensor, scale_inv: torch.Tensor, fmt: Fp8Format,
                  fp8_bytes: torch.Tensor | None) -> torch.Tensor:
    if fp8_bytes is None:
        return count_overflow_underflow(x, scale.reshape(()), fmt, scale_inv=scale_inv.reshape(()))
    return count_from_cast(x, fp8_bytes, scale_inv.reshape(()), fmt)


# -- device tables: the gradients' sum of squares, TE's delayed-scaling reads ------------------------------


@functools.cache
def _table_kernels() -> Any:
    """The kernels that read many tensors in one launch through a device table of their addresses,
    or None when Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # not installed, or a broken install: the callers take their torch paths
        return None

    @triton.jit  # type: ignore[untyped-decorator, unused-ignore]
    def table_sumsq_kernel(ptrs_ptr, blk_tensor_ptr, blk_start_ptr, numel_ptr, out_ptr, n_blocks,  # type: ignore[no-untyped-def]
                           DTYPE: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        # Many tensors in one launch: program pid reads blocks pid*ITERS .. pid*ITERS+ITERS-1 of the
        # block table (tensor index, start), the tensor's address from the pointer table.
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(ITERS):
            b = pid * ITERS + i
            valid = b < n_blocks
            t = tl.load(blk_tensor_ptr + b, mask=valid, other=0)
            start = tl.load(blk_start_ptr + b, mask=valid, other=0)
            n = tl.load(numel_ptr + t)
            base = tl.load(ptrs_ptr + t).to(tl.pointer_type(DTYPE))
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=(offs < n) & valid, other=0.0).to(tl.float32)
            acc += x * x
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))  # one partial per program: deterministic

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

    return table_sumsq_kernel, history_gather_kernel


_TL_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_STAGING_SLOTS = 8
"""Host staging buffers in flight at once: a table re-pointed more often than this many times
while the device is behind is not re-pointed on that call (it never waits)."""


class _Staging:
    """Uploads an int64 table to the device without a host sync: pinned host buffers, each with
    its own event (created once), written with C-level slice assignment and copied non-blocking.
    On the CPU (Triton's interpreter) the table is written in place."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        n = table.numel()
        self._cuda = table.device.type == "cuda"
        if self._cuda:
            self._host = [torch.zeros(n, dtype=torch.int64, pin_memory=True) for _ in range(_STAGING_SLOTS)]
            self._events = [torch.cuda.Event() for _ in range(_STAGING_SLOTS)]  # type: ignore[no-untyped-call]
            self._used = [False] * _STAGING_SLOTS
            self._words = [(ctypes.c_int64 * n).from_address(h.data_ptr()) for h in self._host]
        else:
            self._words = [(ctypes.c_int64 * n).from_address(table.data_ptr())]
        self._slot = 0

    def upload(self, values: Sequence[int]) -> bool:
        """Enqueue the copy of ``values`` into the table; False (nothing enqueued) while the
        next staging buffer is still being copied from (a query, never a wait)."""
        if not self._cuda:
            self._words[0][:] = list(values)
            return True
        j = self._slot
        if self._used[j] and not self._events[j].query():  # type: ignore[no-untyped-call]
            return False
        self._words[j][:] = list(values)
        self.table.copy_(self._host[j], non_blocking=True)
        self._events[j].record()
        self._used[j] = True
        self._slot = (j + 1) % _STAGING_SLOTS
        return True


class TableSumOfSquares:
    """``sum(t.float()**2)`` over a fixed list of tensor shapes of one dtype, in one Triton launch.

    Built once for the shapes (e.g. every gradient of a model): device tables of blocks (tensor
    index, start), of sizes and of the tensors' addresses. The addresses travel only when they
    change (:meth:`point`, through :class:`_Staging`: no host sync); a call then costs one launch
    and one sum, whatever the number of tensors. One program per group of consecutive blocks,
    one partial each: deterministic. The caller guarantees that the tensors at the addresses
    pointed to are alive, contiguous, of this dtype and of these sizes at each call.
    """

    def __init__(self, numels: Sequence[int], dtype: torch.dtype, device: torch.device, *,
                 block: int = _BLOCK) -> None:
        if _table_kernels() is None:
            raise RuntimeError("TableSumOfSquares needs Triton")
        if dtype not in _TL_DTYPE:
            raise ValueError(f"TableSumOfSquares: unsupported dtype {dtype}")
        self.dtype, self.device, self.block = dtype, device, block
        tensor_of: list[int] = []
        start_of: list[int] = []
        for i, n in enumerate(numels):
            for start in range(0, int(n), block):
                tensor_of.append(i)
                start_of.append(start)
        self.n_blocks = len(tensor_of)
        self.count = len(numels)
        # As many programs as fill the GPU eight deep, each over an equal run of blocks (the
        # run length is exact, not a power of two: one compiled variant per model and dtype).
        index = device.index if device.index is not None else (
            torch.cuda.current_device() if device.type == "cuda" else 0)
        self._iters = max(1, -(-self.n_blocks // _max_programs(index, 8)))
        self._grid = max(1, -(-self.n_blocks // self._iters))
        self._blk_tensor = torch.tensor(tensor_of, dtype=torch.int32, device=device)
        self._blk_start = torch.tensor(start_of, dtype=torch.int64, device=device)
        self._numel = torch.tensor([int(n) for n in numels], dtype=torch.int64, device=device)
        self._partials = torch.empty(self._grid, dtype=torch.float32, device=device)
        self._staging = _Staging(torch.zeros(max(1, self.count), dtype=torch.int64, device=device))
        self.pointed = False
        """Whether the address table was filled at least once (before that, calls return None)."""

    def point(self, addresses: Sequence[int]) -> bool:
        """Point the table at the tensors at ``addresses`` (one per shape, in order); False when
        it could not be done now (see :class:`_Staging`): the previous addresses stay."""
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

        _table_kernels()[0][(self._grid,)](
            self._staging.table, self._blk_tensor, self._blk_start, self._numel, self._partials, self.n_blocks,
            DTYPE=getattr(tl, _TL_DTYPE[self.dtype]), BLOCK=self.block, ITERS=self._iters, num_warps=8)
        return self._partials.sum()


_GATHER_COLUMNS, _GATHER_ROWS = 32, 64
"""History gather tile: columns per program, history rows per loop iteration."""


class HistoryGather:
    """Transformer Engine's delayed-scaling reads of ``n`` columns in one Triton launch.

    Column ``c`` is one slot of a module's ``amax_history`` (``[L, slots]``, float32) and of its
    ``scale``; a device table holds, per column, the address of the slot's first history row, the
    history length, the row stride and the address of the slot's scale (:meth:`point`, when TE's
    tensors move: through :class:`_Staging`, no host sync). Each call writes, per column: AMAX =
    the last history row (length 1: ``fp8_max / (scale * div)``, TE having zeroed the row), the
    history's maximum (NaN if any row is NaN, as ``torch.amax``), SCALE = ``in_use`` (the scale
    seen at the previous call), and then ``in_use`` = the live scale; AMAX and the maximum are
    multiplied by ``keep``. The caller keeps the pointed-to tensors alive.
    """

    def __init__(self, fp8_max: Sequence[float], div: Sequence[float], device: torch.device) -> None:
        if _table_kernels() is None:
            raise RuntimeError("HistoryGather needs Triton")
        self.n = len(fp8_max)
        self._fp8_max = torch.tensor(list(fp8_max), dtype=torch.float32, device=device)
        self._div = torch.tensor(list(div), dtype=torch.float32, device=device)
        self._staging = _Staging(torch.zeros(4 * max(1, self.n), dtype=torch.int64, device=device))
        self._max_len = 0
        self.pointed = False

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
        _table_kernels()[1][(grid,)](
            self._staging.table, self._fp8_max, self._div, keep, in_use, out, self.n,
            amax * out.stride(0), scale * out.stride(0), hmax * out.stride(0), out.stride(1),
            MAX_LEN=self._max_len, BLOCK_C=_GATHER_COLUMNS, BLOCK_R=_GATHER_ROWS, num_warps=4)
