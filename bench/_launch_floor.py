"""Where the host time of one count launch goes: the same 144 operands enqueued six ways, passes
alternating in one process, host microseconds per launch (per operand where one launch counts several).

* ``count_cast_into``: fp8guard's whole path (the plan, the handle's key, the cached handle; since
  the twelfth session its C launcher called directly while no launch hook is set);
* ``count_cast_into_via_runner``: the same through Triton's runner (``CompiledLaunch.direct``
  off), the path before;
* ``triton_runner``: the compiled kernel's own runner (``handle[grid](*args)``: Triton looks up
  the device and stream, builds the launch metadata, calls its C launcher), arguments ready;
* ``c_launcher``: Triton's C launcher called directly (``handle.run``) with the stream looked up
  once, no hooks: what is left once no Python runs per launch but the call itself;
* ``count_batch``: the operands counted eight to a launch (``count_batch.CountBatch``): its host
  time per operand (18 launches for 144), against ``count_cast_into``'s one launch each;
* ``torch_zero``: one small torch kernel (``zero_`` on a two-element slice), for scale.

Each operand's count row is a view made once before the passes, as the agent's
``InspectCounts._row`` makes them (until the fifteenth session every way indexed ``dst[i]`` per
operand: a tensor view made per operand, which no agent path makes).

The differences name each layer's share: fp8guard's Python, Triton's runner, the launch itself.
``c_launcher`` calls a Triton-internal entry whose arguments have changed between Triton
releases: the bench checks that it counts what ``count_cast_into`` counts and reports
``c_launcher_error`` instead if it raises (each way likewise). Needs CUDA and Triton; imported by
``bench/_counts_kernels.py`` on the GPU host only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bench._count_probe import host_us_per_launch
from fp8guard.agent.kernels import counts as kernels
from fp8guard.agent.kernels.count_batch import BATCH_SLOTS, CountBatch


def _prepared(ops: list[Any], dst: torch.Tensor) -> list[tuple[Any, ...]]:
    """Per operand with FP8 bytes: (compiled handle, grid, runtime args, constants)."""
    kernel = kernels._kernel()
    out = []
    for i, op in enumerate(ops):
        if op.q is None:
            continue
        n = op.x.numel()
        words = kernels.BYTES_IN_WORDS and op.q.data_ptr() % 4 == 0
        plan = kernels._plan(n, op.x.dtype, op.fmt, True, op.x.get_device(), words,
                             kernels.ROW_BY_ROW if words else 0, kernels.TILES_AHEAD if words else 1)
        handle = kernels._jit_launch(kernel, plan.grid, plan.warps, op.x, op.q, op.scale_inv, op.scale_inv,
                                     dst[i], n, plan.consts, plan.bits_dtype)
        out.append((handle, plan.grid, (op.x, op.q, op.scale_inv, op.scale_inv, dst[i], n), plan.consts))
    return out


def measure(ops: list[Any], passes: int = 9) -> dict[str, Any]:
    """Median host microseconds per launch of each way (see the module docstring)."""
    dst = torch.zeros(len(ops), 2, dtype=torch.int64, device="cuda")
    rows = list(dst.unbind(0))  # each operand's row made once, as InspectCounts._row makes them
    prepared = _prepared(ops, dst)
    with_bytes = [(i, op) for i, op in enumerate(ops) if op.q is not None]
    stream = torch.cuda.current_stream().cuda_stream

    def whole() -> None:
        for i, op in with_bytes:
            kernels.count_cast_into(rows[i], op.x, scale=op.scale_inv, scale_inv=op.scale_inv, fmt=op.fmt,
                                    fp8_bytes=op.q)

    def whole_via_runner() -> None:
        before, kernels._LAUNCH.direct = kernels._LAUNCH.direct, False
        try:
            whole()
        finally:
            kernels._LAUNCH.direct = before

    def runner() -> None:
        for handle, grid, args, consts in prepared:
            handle[(grid, 1, 1)](*args, *consts)

    def c_launcher() -> None:
        for handle, grid, args, consts in prepared:
            handle.run(grid, 1, 1, stream, handle.function, handle.packed_metadata, None, None, None, *args,
                       *consts)

    def batched() -> None:  # eight operands a launch; per operand, as the others per launch
        batch = CountBatch(BATCH_SLOTS)
        for i, op in with_bytes:
            batch.add(rows[i], op.x, scale=op.scale_inv, scale_inv=op.scale_inv, fmt=op.fmt, fp8_bytes=op.q)
        batch.flush()

    def torch_zero() -> None:
        for i, _ in with_bytes:
            rows[i].zero_()

    ways: dict[str, Callable[[], None]] = {"count_cast_into": whole, "count_cast_into_via_runner": whole_via_runner,
                                           "triton_runner": runner, "c_launcher": c_launcher,
                                           "count_batch": batched, "torch_zero": torch_zero}
    result: dict[str, Any] = {"launches": len(with_bytes), "passes": passes}
    # the same counts through the C launcher and the runner as through fp8guard's path
    counts: dict[str, torch.Tensor] = {}
    for name in ("count_cast_into", "count_cast_into_via_runner", "c_launcher", "count_batch"):
        dst.zero_()
        try:
            ways[name]()
        except Exception as exc:
            result[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            del ways[name]
            continue
        torch.cuda.synchronize()
        counts[name] = dst.clone()
        if name == "count_cast_into":  # (False: the C launcher refused its arguments, the runner ran)
            result["direct_c_launcher_in_use"] = kernels._LAUNCH.direct
    for name, label in (("c_launcher", "c_launcher_same_counts"), ("count_cast_into_via_runner",
                                                                  "via_runner_same_counts"),
                        ("count_batch", "count_batch_same_counts")):
        if name in counts and "count_cast_into" in counts:
            result[label] = bool(torch.equal(counts[name], counts["count_cast_into"]))
    for name, us in host_us_per_launch(ways, len(with_bytes), passes).items():
        result[f"host_us_per_launch_{name}"] = us
    return result
