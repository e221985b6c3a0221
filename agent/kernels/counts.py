"""Exact FP8 cast counts (:func:`count_cast_into`): overflows and underflows of a cast, on the device.

Counting follows Transformer Engine's ``LogFp8TensorStats`` definitions (see
:func:`fp8guard.agent.fp8.count_overflow_underflow`) and reads as little as the definition allows.
Given the FP8 bytes TE produced from the high-precision tensor, an element can only be an underflow
if its byte is +/-0, and only be an overflow if its byte is the format's maximum (satfinite casts
clip there; a NaN or inf byte is looked at too): the kernel reads the 1-byte FP8 tensor and fetches
the 2-byte high-precision value only where the byte says it might count. On real tensors few bytes
are 0 or max, so the pass reads a little over one byte per element instead of two, and a tile of
bytes with none of them skips the fetch and the arithmetic (a branch per tile). The bytes are
tested four to a 32-bit word with integer arithmetic, and the next tile's words are loaded before
the current one is tested. On the H200 the 144 operands of the 604M model took 3.2 ms (2.2 TB/s of
bytes), against 4.4 ms testing them one by one and 10.1 doing the arithmetic on every tile, and
2.0 ms for a plain streaming read of the same bytes (docs/gpu.md). Without FP8 bytes it reads the
high-precision tensor once, using the scale the cast used. The torch path gives the same integers.

Nothing here synchronises with the host: results accumulate into a device buffer.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from fp8guard.agent.fp8 import Fp8Format, count_from_cast, count_overflow_underflow
from fp8guard.agent.kernels._launch import (
    CompiledLaunch,
    launch_shape,
    triton_available,
    triton_modules,
)

__all__ = ["COUNT_SHAPES", "count_cast_into"]

_MAX_CODE = {Fp8Format.E4M3: 0x7E, Fp8Format.E5M2: 0x7B}
"""Magnitude bits of the largest finite value: 448 (E4M3 0x7E; 0x7F is NaN) and 57344 (E5M2 0x7B;
0x7C is inf and above are NaN). Bytes at or above it are checked against the threshold."""
_HP_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_BITS_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_NONZERO_MASK = {torch.bfloat16: 0x7FFF, torch.float16: 0x7FFF, torch.float32: 0x7FFFFFFF}
"""Zero test on the bits (sign cleared): correct for subnormal inputs whatever the float mode."""


@functools.cache
def _kernel() -> Any:
    """The compiled count kernel (``_count_kernels.count_kernel``), or None when Triton cannot be
    imported."""
    if triton_modules() is None:
        return None
    from fp8guard.agent.kernels import _count_kernels

    return _count_kernels.count_kernel


@functools.cache
def _batch_kernel() -> Any:
    """The batched count kernel (``_count_kernels.count_batch_kernel``), or None without Triton."""
    if triton_modules() is None:
        return None
    from fp8guard.agent.kernels import _count_kernels

    return _count_kernels.count_batch_kernel


CONST_NAMES = ("FP8_MAX", "HALF_SUB", "MAX_CODE", "NZ_MASK", "HP_KIND", "FROM_BYTES", "ROWS", "COLS", "ITERS", "WORDS",
               "ROW_BY_ROW", "AHEAD")
"""The count kernels' constexpr parameters, in signature order (both kernels of ``_count_kernels``)."""


def kernel_consts(fmt: Fp8Format, dtype: torch.dtype, from_bytes: bool, rows: int, cols: int, iters: int,
                  words: bool, row_by_row: int, ahead: int) -> tuple[Any, ...]:
    """The constexpr values of a count launch, in :data:`CONST_NAMES`' order."""
    return (fmt.fp8_max, fmt.smallest_subnormal / 2, _MAX_CODE[fmt], _NONZERO_MASK[dtype], _HP_KIND[dtype],
            from_bytes, rows, cols, iters, words, row_by_row, ahead)


COUNT_SHAPES: dict[str, tuple[int, int, int, int]] = {"hp": (16, 128, 32, 4), "bytes": (32, 64, 32, 2)}
"""Launch shape per variant: (rows, columns of a tile, programs per multiprocessor, warps).
``bench/gpu_counts.py kernels`` times alternatives (it sets this table) before a default moves.
Calibration (H200, the 604M model's 144 operand shapes, graph-replayed,
docs/gpu-results/gpu_counts_kernels.shapes.2026-12-03d.json): with the bytes tested in words, 32 x
64 tiles, 32 programs per SM and 2 warps were the fastest of twelve shapes for the FP8-bytes
variant (3.16 ms against 3.35 for 64 x 64, 16 and 4, the earlier default), and 16 x 128, 32 and 4
for the high-precision one (10.1 against 11.2), with the same counts everywhere."""

MAX_KERNEL_ELEMENTS = 2**30
"""Larger operands are counted by the torch path (exact, slower, with temporaries the size of the
operand): the kernel's element offsets are 32-bit, and a launch's last tiles run past ``n`` by up
to a program's share, so 2**30 keeps every offset below 2**31."""

BYTES_IN_WORDS = True
"""Whether the FP8-bytes variant tests its bytes four to a 32-bit word, with the next tile's
words loaded before the current one is tested (for 4-byte-aligned bytes; False: byte by byte, as
unaligned bytes always are: the ninth session's kernel less its second load of a flagged tile's
bytes). ``bench/gpu_counts.py kernels`` times both side by side."""

ROW_BY_ROW = 0
"""In the word test, a flagged tile with at most this many rows holding a byte at +/-0 or the
maximum reads only those rows again, one at a time (each row's high-precision values fetched
only where a byte asks), instead of the whole tile's bytes and every element's arithmetic; a
tile with more takes the whole-tile path. 0: always the whole tile (the kernel measured so far).
Why: on the H200 the flagged tiles (about 5 % of the 32-row tiles, one or two flagged rows each)
cost 0.40-0.43 of 3.12-3.13 ms (docs/gpu.md), the whole tile's per-element work for a row or two.
Not yet timed on a GPU: ``bench/gpu_counts.py kernels`` sweeps it before the default moves."""

TILES_AHEAD = 1
"""In the word test, how many tiles' words a program has loading while it tests one: 1 (the
kernel measured so far) or 2 (larger values act as 2). Why 2 might pay: resident by registers, a multiprocessor keeps about
32 KB of the count kernel's loads in flight against 256 KB for a plain read of the same bytes, which
reaches 3.6 TB/s where the count kernel's clean tiles reach 2.6 (docs/gpu.md, twelfth session).
Not yet timed on a GPU: ``bench/gpu_counts.py kernels`` and ``bench/gpu_count_kernel_ab.py`` time it."""

_LAUNCH = CompiledLaunch()
"""The count kernel's launches through its compiled handle (see :func:`_launch_count`)."""


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
    n = x.numel()
    if n == 0:
        return
    if fp8_bytes is not None and (fp8_bytes.numel() != n or fp8_bytes.element_size() != 1):
        raise ValueError(f"fp8_bytes has {fp8_bytes.numel()} elements of {fp8_bytes.element_size()} bytes, "
                         f"the tensor {n} (one byte each expected)")
    if backend == "auto":
        # x.is_cuda first: the common case without building a torch.device
        use_triton = (triton_modules() is not None) if x.is_cuda else triton_available(x.device)
    else:
        use_triton = backend == "triton"
    if not use_triton or n > MAX_KERNEL_ELEMENTS or x.dtype not in _HP_KIND or not x.is_contiguous() or (
            fp8_bytes is not None and not fp8_bytes.is_contiguous()):
        out.add_(_torch_counts(x, scale=scale, scale_inv=scale_inv, fmt=fmt, fp8_bytes=fp8_bytes))
        return
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("backend='triton' but Triton cannot be imported")
    from_bytes = fp8_bytes is not None
    q = fp8_bytes if fp8_bytes is not None else x
    words = from_bytes and BYTES_IN_WORDS and q.data_ptr() % 4 == 0
    if x.is_cuda:
        plan = _plan(n, x.dtype, fmt, from_bytes, x.get_device(), words, ROW_BY_ROW if words else 0,
                     TILES_AHEAD if words else 1)
        _launch_planned(kernel, plan, x, q, scale, scale_inv, out, n)
        return
    rows, cols, per_sm, warps = COUNT_SHAPES["bytes" if from_bytes else "hp"]
    # Up to per_sm programs per multiprocessor (enough loads in flight to stream at memory
    # bandwidth), each looping over its tiles; two atomics per program.
    grid, iters = launch_shape(n, x.device, rows * cols, per_sm=per_sm)
    consts = kernel_consts(fmt, x.dtype, from_bytes, rows, cols, iters, words, ROW_BY_ROW if words else 0,
                           TILES_AHEAD if words else 1)
    _launch_count(kernel, grid, warps, x, q, scale, scale_inv, out, n, consts)


class _Plan(NamedTuple):
    """What a launch on a CUDA tensor depends on besides the addresses: the grid, the warps, the
    constants and the part of the compiled handle's key that only the shape decides, as a small
    integer (:data:`_KEY_IDS`) so that a launch's key is one integer, not a tuple hashed anew."""

    grid: int
    warps: int
    consts: tuple[Any, ...]
    bits_dtype: torch.dtype
    key: int


_KEY_IDS: dict[tuple[Any, ...], int] = {}
"""The shape-decided part of a compiled handle's key (constants, dtypes, warps, device, the
element count's divisibility by 16, equality to 1 and width) -> a small integer. As many as the
kernel has specialisations (tens in a run; a few hundred with every launch shape the bench
sweeps), and never dropped: two plans with the same part share the id, so their launches share
the compiled handle."""


_PLANS: dict[tuple[Any, ...], _Plan] = {}
"""Per (elements, dtype, format, variant, device) and launch shape: a step hands the same few
dozen operand shapes to the kernel every time, so each launch looks its plan up instead of
re-deriving the grid, the constants and the key (host time per counted step, docs/gpu.md)."""

MAX_PLANS = 1024
"""Plans kept at most. A run whose operands change size from step to step (sequences of varying
length, no packing) would otherwise add one per size for as long as it trains; past this many
the plans are dropped and rebuilt as operands come (a plan costs microseconds to make)."""


def _plan(n: int, dtype: torch.dtype, fmt: Fp8Format, from_bytes: bool, device_index: int,
          words: bool = False, row_by_row: int = 0, ahead: int = 1) -> _Plan:
    shape = COUNT_SHAPES["bytes" if from_bytes else "hp"]
    cache_key = (n, dtype, fmt, from_bytes, device_index, shape, words, row_by_row, ahead)
    plan = _PLANS.get(cache_key)
    if plan is None:
        rows, cols, per_sm, warps = shape
        grid, iters = launch_shape(n, torch.device("cuda", device_index), rows * cols, per_sm=per_sm)
        consts = kernel_consts(fmt, dtype, from_bytes, rows, cols, iters, words, row_by_row, ahead)
        bits_dtype = _BITS_VIEW[dtype]
        q_size = 1 if from_bytes else torch.empty((), dtype=dtype).element_size()
        # the key _launch_count builds, less the addresses' alignment (added per launch)
        key = (consts, bits_dtype, q_size, warps, device_index, n % 16 == 0, n == 1, n >= 2**31)
        key_id = _KEY_IDS.setdefault(key, len(_KEY_IDS))
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[cache_key] = _Plan(grid, warps, consts, bits_dtype, key_id)
    return plan


def _launch_planned(kernel: Any, plan: _Plan, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                    scale_inv: torch.Tensor, out: torch.Tensor, n: int) -> None:
    """:func:`_launch_count` for a CUDA tensor with its plan: what decides the compiled kernel
    (the plan's key id, and which of the five addresses are 16-byte aligned, one bit each) as one
    integer key, the same launch. Planned keys are negative, so they never meet the tuples
    :func:`_launch_count` uses in the same cache."""
    key = -1 - (plan.key << 5 | (x.data_ptr() & 15 == 0) | (q.data_ptr() & 15 == 0) << 1
                | (scale.data_ptr() & 15 == 0) << 2 | (scale_inv.data_ptr() & 15 == 0) << 3
                | (out.data_ptr() & 15 == 0) << 4)
    grid, warps, consts, bits_dtype = plan.grid, plan.warps, plan.consts, plan.bits_dtype
    _LAUNCH(grid, (x, q, scale, scale_inv, out, n), consts,
            lambda: _jit_launch(kernel, grid, warps, x, q, scale, scale_inv, out, n, consts, bits_dtype), key=key)


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
    if x.device.type != "cuda":
        _jit_launch(kernel, grid, warps, x, q, scale, scale_inv, out, n, consts, bits_dtype)
        return
    addresses = (x.data_ptr(), q.data_ptr(), scale.data_ptr(), scale_inv.data_ptr(), out.data_ptr())
    key = (consts, bits_dtype, q.element_size(), warps, x.device.index, tuple(a % 16 == 0 for a in addresses),
           n % 16 == 0, n == 1, n >= 2**31)
    # the views are the JIT's argument types; the launcher reads data_ptr() alone, so the tensors
    # themselves go (same addresses), constants in signature order as the JIT passes them
    _LAUNCH(grid, (x, q, scale, scale_inv, out, n), consts,
            lambda: _jit_launch(kernel, grid, warps, x, q, scale, scale_inv, out, n, consts, bits_dtype), key=key)


def _jit_launch(kernel: Any, grid: int, warps: int, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                scale_inv: torch.Tensor, out: torch.Tensor, n: int, consts: tuple[Any, ...],
                bits_dtype: torch.dtype) -> Any:
    bits = x.view(bits_dtype).reshape(-1)
    qv = q.view(torch.uint8).reshape(-1) if consts[CONST_NAMES.index("FROM_BYTES")] else bits
    return kernel[(grid,)](bits, qv, scale, scale_inv, out, n, **dict(zip(CONST_NAMES, consts, strict=True)),
                           num_warps=warps)


def _torch_counts(x: torch.Tensor, *, scale: torch.Tensor, scale_inv: torch.Tensor, fmt: Fp8Format,
                  fp8_bytes: torch.Tensor | None) -> torch.Tensor:
    if fp8_bytes is None:
        return count_overflow_underflow(x, scale.reshape(()), fmt, scale_inv=scale_inv.reshape(()))
    return count_from_cast(x, fp8_bytes, scale_inv.reshape(()), fmt)
