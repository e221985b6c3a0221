"""A plain streaming read: the bound the count kernel's FP8-bytes pass is held against.

Each launch reads one operand's bytes as 32-bit words and folds them with ``max`` into one word
(so no load can be dropped), with nothing else: no test, no branch, no second read. Timed over
the same operands as the count kernel, one launch per operand and graph-replayed, at a few launch
shapes, and once over all the bytes in one buffer with one launch (what fewer, larger launches
could reach). Needs Triton and a CUDA GPU; imported only by ``bench/_count_probe.py``'s
``ceiling`` on the GPU host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from fp8guard.agent.kernels._launch import max_programs

SHAPES = [(1024, 16, 4), (2048, 16, 4), (2048, 32, 4), (4096, 8, 8), (4096, 16, 8), (8192, 8, 8), (1024, 32, 2)]
"""(words per block, programs per SM, warps) tried."""


@triton.jit  # type: ignore[untyped-decorator, unused-ignore]
def _read_kernel(w_ptr, sink_ptr, nw, BLOCK: tl.constexpr, ITERS: tl.constexpr):  # type: ignore[no-untyped-def]
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.full([BLOCK], -2147483648, dtype=tl.int32)
    base = pid * ITERS * BLOCK
    for i in range(ITERS):
        o = base + i * BLOCK + offs
        acc = tl.maximum(acc, tl.load(w_ptr + o, mask=o < nw, other=-2147483648))
    tl.atomic_max(sink_ptr, tl.max(acc, axis=0))


def _shape(nw: int, block: int, per_sm: int) -> tuple[int, int]:
    blocks = -(-nw // block)
    iters = 1
    while blocks > iters * max_programs(torch.cuda.current_device(), per_sm):
        iters *= 2
    return -(-blocks // iters), iters


def _launcher(words: list[torch.Tensor], sink: torch.Tensor, block: int, per_sm: int,
              warps: int) -> Callable[[], None]:
    plan = [(w, sink[i:i + 1], w.numel(), *_shape(w.numel(), block, per_sm)) for i, w in enumerate(words)]

    def run() -> None:
        for w, s, nw, grid, iters in plan:
            _read_kernel[(grid,)](w, s, nw, BLOCK=block, ITERS=iters, num_warps=warps)

    return run


def measure(words: list[torch.Tensor], replay_ms: Callable[[Callable[[], None]], float]) -> dict[str, Any]:
    """Graph-replayed time of reading ``words`` (int32 tensors, one launch each) at each of
    :data:`SHAPES`, then of the same bytes as one buffer in one launch at the fastest shape.
    ``replay_ms(body)`` captures a body in a CUDA graph and times its replays (the count probe's
    timer)."""
    if not words:
        return {"skipped": "no operand's bytes are a whole number of 32-bit words"}
    nbytes = sum(w.numel() * 4 for w in words)
    sink = torch.empty(len(words), dtype=torch.int32, device="cuda")
    expect = torch.stack([w.max() for w in words])
    rows: list[dict[str, Any]] = []
    for block, per_sm, warps in SHAPES:
        run = _launcher(words, sink, block, per_sm, warps)
        try:
            sink.fill_(torch.iinfo(torch.int32).min)
            run()  # compile outside the graph; the fold must equal torch's max
            same = bool(torch.equal(sink, expect))
            ms = replay_ms(run)
            rows.append({"shape": [block, per_sm, warps], "graph_ms": round(ms, 3),
                         "GBps": round(nbytes / 1e6 / ms), "same_as_torch_max": same})
        except Exception as exc:
            rows.append({"shape": [block, per_sm, warps], "error": f"{type(exc).__name__}: {exc}"[:200]})
    good = [r for r in rows if "graph_ms" in r and r["same_as_torch_max"]]
    best = min(good, key=lambda r: r["graph_ms"], default=None)
    out: dict[str, Any] = {"GB": round(nbytes / 1e9, 3), "launches": len(words), "per_operand": rows,
                           "best_per_operand": best}
    total = sum(w.numel() for w in words)
    if best is None:
        out["one_launch"] = {"skipped": "no launch shape ran and matched torch's max"}
    elif total >= 2**31 - 2**24:  # the kernel's offsets are 32-bit
        out["one_launch"] = {"skipped": f"{total} words: past the kernel's 32-bit offsets"}
    else:
        block, per_sm, warps = best["shape"]
        flat = torch.cat([w.reshape(-1) for w in words])
        one = torch.full((1,), torch.iinfo(torch.int32).min, dtype=torch.int32, device="cuda")
        run = _launcher([flat], one, block, per_sm, warps)
        run()
        same = bool(one[0] == expect.max())
        ms = replay_ms(run)
        del flat
        out["one_launch"] = {"shape": best["shape"], "graph_ms": round(ms, 3), "GBps": round(nbytes / 1e6 / ms),
                             "same_as_torch_max": same}
    return out
