"""The count kernels' Triton code: one program's count (:func:`_count_program`), the launch of one
operand (:func:`count_kernel`) and of up to eight (:func:`count_batch_kernel`, for
:class:`~fp8guard.agent.kernels.count_batch.CountBatch`).

Imported only where Triton imports (:func:`fp8guard.agent.kernels.counts._kernel`); what the
kernels compute, and why, is :mod:`fp8guard.agent.kernels.counts`' docstring. The helpers are
inlined by Triton's compiler: the one-operand kernel's machine code is what it was when its body
was written inside it (compared instruction by instruction, ``bench/count_kernel_resources.py``).
"""

# mypy: ignore-errors

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _values(bits, HP_KIND: tl.constexpr):
    """float32 values from the high-precision tensor's bits, by integer moves where the format
    allows (BF16 is the top half of a float32), so no conversion can flush a subnormal to zero."""
    if HP_KIND == 0:
        x = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif HP_KIND == 1:
        x = bits.to(tl.float16, bitcast=True).to(tl.float32)
    else:
        x = bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _count_program(x_ptr, q_ptr, scale_ptr, sinv_ptr, out_ptr, n, pid,
                   FP8_MAX: tl.constexpr, HALF_SUB: tl.constexpr, MAX_CODE: tl.constexpr,
                   NZ_MASK: tl.constexpr, HP_KIND: tl.constexpr, FROM_BYTES: tl.constexpr,
                   ROWS: tl.constexpr, COLS: tl.constexpr, ITERS: tl.constexpr, WORDS: tl.constexpr,
                   ROW_BY_ROW: tl.constexpr, AHEAD: tl.constexpr):
    """Program ``pid`` of a launch over one operand: its tiles' counts added into ``out_ptr``."""
    # A tile is ROWS x COLS consecutive elements. From FP8 bytes, the high-precision values of
    # a row of COLS are fetched only when one of its bytes is +/-0 or the maximum: the
    # predicate is uniform along the row, so the fetch stays a vectorised load.
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
    # the rows of flagged tiles read one by one (ROW_BY_ROW), tallied per column
    over_r = tl.zeros([COLS], dtype=tl.int32)
    under_r = tl.zeros([COLS], dtype=tl.int32)
    tile = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    if WORDS:
        # The FP8 bytes read four to a 32-bit word (the tensor is 4-byte aligned): a tile of
        # ROWS x COLS bytes is ROWS x COLS/4 words, each tested for a byte at +/-0 or at/above
        # the maximum code with a few integer operations on all four bytes at once, and the
        # next tile's words are loaded before this one is tested, so every program keeps two
        # tiles' loads in flight. Only a tile that has such a byte is read again byte by byte.
        qw_ptr = q_ptr.to(tl.pointer_type(tl.int32))
        wtile = tl.arange(0, ROWS)[:, None] * (COLS // 4) + tl.arange(0, COLS // 4)[None, :]
        nw = n // 4
        first = pid * ITERS * (ROWS * COLS // 4)
        # masked words read as 0x01 bytes: nonzero, below the maximum: nothing to count
        w_next = tl.load(qw_ptr + first + wtile, mask=first + wtile < nw, other=0x01010101)
        if AHEAD > 1:  # and the tile after it (ITERS >= 2 whenever a program has two tiles)
            second = first + (ROWS * COLS // 4) + wtile
            w_after = tl.load(qw_ptr + second, mask=(second < nw) & (ITERS > 1), other=0x01010101)
    for i in range(ITERS):  # program pid owns tiles pid*ITERS .. pid*ITERS+ITERS-1
        start = (pid * ITERS + i) * (ROWS * COLS)
        if FROM_BYTES:
            if WORDS:
                w = w_next
                if AHEAD > 1:  # two tiles' loads in flight while this one is tested
                    w_next = w_after
                    nxt = first + (i + 2) * (ROWS * COLS // 4) + wtile
                    w_after = tl.load(qw_ptr + nxt, mask=(nxt < nw) & (i + 2 < ITERS), other=0x01010101)
                else:
                    nxt = first + (i + 1) * (ROWS * COLS // 4) + wtile
                    w_next = tl.load(qw_ptr + nxt, mask=(nxt < nw) & (i + 1 < ITERS), other=0x01010101)
                # the magnitudes; each byte <= 0x7F, so no carry leaves a byte below
                v = w.to(tl.uint32, bitcast=True) & 0x7F7F7F7F
                # some byte of v is 0 <=> subtracting 1 from every byte sets a top bit (the
                # lowest zero byte turns 0xFF; without one, no byte borrows and each stays
                # below 0x80); a byte is >= MAX_CODE <=> adding 0x80 - MAX_CODE sets its top bit
                zero_or_top = (v - 0x01010101) | (v + (0x80 - MAX_CODE) * 0x01010101)
                # (the top bits themselves folded: no per-word compare or conversion), row by
                # row, then over the tile
                row_top = tl.max(zero_or_top & 0x80808080, axis=1)
                flagged = tl.max(row_top, axis=0) != 0
                # the last 1-3 bytes of a length that is not a multiple of 4 are in no word
                # (nw * 4 - start: start + ROWS * COLS could pass 2**31 for n just below it)
                tail = (nw * 4 < n) & (nw * 4 - start < ROWS * COLS) & (start < n)
                go = flagged | tail
            else:
                offs = start + tile
                inside = offs < n
                mag = tl.load(q_ptr + offs, mask=inside, other=1) & 0x7F
                go = tl.max(tl.max(((mag == 0) | (mag >= MAX_CODE)).to(tl.int32), axis=1), axis=0) > 0
            # A tile with no byte at +/-0 or the maximum counts nothing: on real tensors almost
            # every tile (the model's rows that need a fetch: ~0.04 %), so the fetch and the
            # arithmetic below run for the few that have one (a branch per tile, not per row).
            if go:
                if WORDS and ROW_BY_ROW > 0:
                    # Which rows hold such a byte (or the tail's bytes: then every row), as
                    # bits of one integer; with at most ROW_BY_ROW of them only those rows are
                    # read again, one at a time, instead of the whole tile (a real tensor's
                    # flagged tile usually has one or two; a dense one takes the tile path).
                    tl.static_assert(ROWS <= 64, "ROW_BY_ROW needs tiles of at most 64 rows (bits of an int64)")
                    row_flag = (row_top != 0) | tail
                    row_bits = tl.sum(tl.where(row_flag, tl.full([ROWS], 1, tl.int64) << tl.arange(0, ROWS).to(tl.int64), 0),
                                      axis=0)
                    by_row = tl.sum(row_flag.to(tl.int32), axis=0) <= ROW_BY_ROW
                else:  # (a constant: the compiler drops the row path)
                    row_bits = tl.zeros([], dtype=tl.int64)
                    by_row = tl.zeros([], dtype=tl.int32) != 0
                if by_row:
                    for r in range(ROWS):
                        if ((row_bits >> r) & 1) != 0:
                            roffs = start + r * COLS + tl.arange(0, COLS)
                            rin = roffs < n
                            rmag = tl.load(q_ptr + roffs, mask=rin, other=1) & 0x7F
                            rzero = rmag == 0
                            rtop = rmag >= MAX_CODE
                            rneed = rin & (rzero | rtop)
                            rbits = tl.load(x_ptr + roffs, mask=rneed, other=0)
                            rx = _values(rbits, HP_KIND)
                            over_r += ((tl.abs(rx) > thr) & rtop & rneed).to(tl.int32)
                            under_r += (((rbits & NZ_MASK) != 0) & rzero & rneed).to(tl.int32)
                else:
                    if WORDS:  # the flagged tile's bytes one by one (the bytewise test has them)
                        # (the tile's element offsets only here: a clean tile computes none)
                        offs = start + tile
                        inside = offs < n
                        mag = tl.load(q_ptr + offs, mask=inside, other=1) & 0x7F
                    zero = mag == 0
                    top = mag >= MAX_CODE
                    row_needs = tl.max((zero | top).to(tl.int32), axis=1) > 0
                    need = inside & row_needs[:, None]
                    bits = tl.load(x_ptr + offs, mask=need, other=0)
                    nonzero = (bits & NZ_MASK) != 0
                    x = _values(bits, HP_KIND)
                    big = tl.abs(x) > thr  # NaN compares false, as in TE
                    over += tl.sum((big & top & need).to(tl.int32), axis=1)
                    under += tl.sum((nonzero & zero & need).to(tl.int32), axis=1)
        else:
            offs = start + tile
            inside = offs < n
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
    if WORDS and ROW_BY_ROW > 0:
        tl.atomic_add(out_ptr, (tl.sum(over, axis=0) + tl.sum(over_r, axis=0)).to(tl.int64))
        tl.atomic_add(out_ptr + 1, (tl.sum(under, axis=0) + tl.sum(under_r, axis=0)).to(tl.int64))
    else:
        tl.atomic_add(out_ptr, tl.sum(over, axis=0).to(tl.int64))
        tl.atomic_add(out_ptr + 1, tl.sum(under, axis=0).to(tl.int64))


@triton.jit
def count_kernel(x_ptr, q_ptr, scale_ptr, sinv_ptr, out_ptr, n,
                 FP8_MAX: tl.constexpr, HALF_SUB: tl.constexpr, MAX_CODE: tl.constexpr,
                 NZ_MASK: tl.constexpr, HP_KIND: tl.constexpr, FROM_BYTES: tl.constexpr,
                 ROWS: tl.constexpr, COLS: tl.constexpr, ITERS: tl.constexpr, WORDS: tl.constexpr,
                 ROW_BY_ROW: tl.constexpr, AHEAD: tl.constexpr):
    """One operand: ``x_ptr`` its high-precision bits, ``q_ptr`` its FP8 bytes (or the bits again),
    ``out_ptr`` its ``[overflows, underflows]``."""
    _count_program(x_ptr, q_ptr, scale_ptr, sinv_ptr, out_ptr, n, tl.program_id(0),
                   FP8_MAX, HALF_SUB, MAX_CODE, NZ_MASK, HP_KIND, FROM_BYTES, ROWS, COLS, ITERS, WORDS, ROW_BY_ROW, AHEAD)


@triton.jit
def _pick(take, x, q, i, o, n, f, x0, q0, i0, o0, n0, f0):
    """(x, q, i, o, n, f) where ``take``, else (x0, ..., f0)."""
    return (tl.where(take, x, x0), tl.where(take, q, q0), tl.where(take, i, i0), tl.where(take, o, o0),
            tl.where(take, n, n0), tl.where(take, f, f0))


@triton.jit(do_not_specialize=['i0', 'i1', 'i2', 'i3', 'i4', 'i5', 'i6', 'i7',
                               'o0', 'o1', 'o2', 'o3', 'o4', 'o5', 'o6', 'o7',
                               'f1', 'f2', 'f3', 'f4', 'f5', 'f6', 'f7'])
def count_batch_kernel(x0, q0, i0, o0, n0, x1, q1, i1, o1, n1, x2, q2, i2, o2, n2, x3, q3, i3, o3, n3,
                       x4, q4, i4, o4, n4, x5, q5, i5, o5, n5, x6, q6, i6, o6, n6, x7, q7, i7, o7, n7,
                       f1, f2, f3, f4, f5, f6, f7,
                       FP8_MAX: tl.constexpr, HALF_SUB: tl.constexpr, MAX_CODE: tl.constexpr,
                       NZ_MASK: tl.constexpr, HP_KIND: tl.constexpr, FROM_BYTES: tl.constexpr,
                       ROWS: tl.constexpr, COLS: tl.constexpr, ITERS: tl.constexpr, WORDS: tl.constexpr,
                       ROW_BY_ROW: tl.constexpr, AHEAD: tl.constexpr):
    """Up to eight operands of one format and dtype (FP8 bytes tested in words) in one launch.

    Slot j: ``xj`` the high-precision tensor's address, ``qj`` its FP8 bytes', ``ij`` its
    scale_inv's, ``oj`` its count row's (int64 ``[overflows, underflows]``), ``nj`` its element
    count; ``fj`` the slot's first program (slot 0's is 0; an unused slot's is past the grid and
    repeats slot 0's addresses). A program finds its slot and runs as program ``pid - fj`` of that
    operand's own launch: the same counts. Every address and count is a kernel argument, so what a
    program derives from them stays uniform across its threads (addresses read from a device table
    would not: compiled so, the program needs 128 registers against 62, ``python3
    bench/count_kernel_resources.py``); the batch takes only 16-byte-aligned tensors with counts
    divisible by 16, which the JIT's specialisation of ``xj``, ``qj`` and ``nj`` tells the compiler,
    as it does for a launch of one: the same vectorised loads.
    """
    pid = tl.program_id(0)
    x, q, i, o, n, f = x0, q0, i0, o0, n0, 0
    x, q, i, o, n, f = _pick(pid >= f1, x1, q1, i1, o1, n1, f1, x, q, i, o, n, f)
    x, q, i, o, n, f = _pick(pid >= f2, x2, q2, i2, o2, n2, f2, x, q, i, o, n, f)
    x, q, i, o, n, f = _pick(pid >= f3, x3, q3, i3, o3, n3, f3, x, q, i, o, n, f)
    x, q, i, o, n, f = _pick(pid >= f4, x4, q4, i4, o4, n4, f4, x, q, i, o, n, f)
    x, q, i, o, n, f = _pick(pid >= f5, x5, q5, i5, o5, n5, f5, x, q, i, o, n, f)
    x, q, i, o, n, f = _pick(pid >= f6, x6, q6, i6, o6, n6, f6, x, q, i, o, n, f)
    x, q, i, o, n, f = _pick(pid >= f7, x7, q7, i7, o7, n7, f7, x, q, i, o, n, f)
    # An address under 2**31 arrives as a 32-bit integer (Triton types an int argument by its value):
    # never a CUDA address, but a CPU one under the interpreter, from a Python whose heap sits low.
    # Widened first, every address makes a 64-bit pointer (a no-op for 64-bit arguments).
    if HP_KIND == 2:
        x_ptr = tl.multiple_of(x.to(tl.int64).to(tl.pointer_type(tl.int32)), 16)
    else:
        x_ptr = tl.multiple_of(x.to(tl.int64).to(tl.pointer_type(tl.int16)), 16)
    q_ptr = tl.multiple_of(q.to(tl.int64).to(tl.pointer_type(tl.uint8)), 16)
    sinv_ptr = i.to(tl.int64).to(tl.pointer_type(tl.float32))
    out_ptr = o.to(tl.int64).to(tl.pointer_type(tl.int64))
    _count_program(x_ptr, q_ptr, sinv_ptr, sinv_ptr, out_ptr, tl.multiple_of(n, 16),
                   pid - f, FP8_MAX, HALF_SUB, MAX_CODE, NZ_MASK, HP_KIND, FROM_BYTES, ROWS, COLS, ITERS, WORDS,
                   ROW_BY_ROW, AHEAD)
