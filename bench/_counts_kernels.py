"""``bench/gpu_counts.py kernels``: the counting kernels alone on synthetic operands of the model's
144 shapes (no TE needed), through bench/_count_probe.py."""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench._te_model import skip

KERNEL_PARTS = ("timing", "launch_floor", "launch_path_ab", "sweep", "ceiling")
"""The parts of ``kernels``, in the order they run (``--parts`` picks some; the sweep is the long one)."""


def kernel_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Both variants on synthetic operands of the model's 144 shapes (no TE needed): agreement
    with TE's formulas, GPU time and host enqueue cost at the default launch shape, then a sweep
    of launch shapes (bench/_count_probe.py's SWEEP) replayed from CUDA graphs, the bounds of one
    read (``ceiling``), and where a launch's host time goes (bench/_launch_floor.py)."""
    try:
        import torch
    except ImportError as exc:
        skip("gpu_counts_kernels", f"torch not importable: {exc}")
    if not torch.cuda.is_available():
        skip("gpu_counts_kernels", "needs a CUDA GPU (torch.cuda.is_available() is False)")
    from bench import _launch_floor
    from bench._count_probe import ceiling, compare, launch_path_ab, sweep, synthetic_operands, timing
    from fp8guard.agent.kernels import triton_available

    if not triton_available(torch.device("cuda")):
        skip("gpu_counts_kernels", "needs Triton on the GPU")
    t0 = time.perf_counter()
    wanted = set(getattr(args, "parts", None) or KERNEL_PARTS)
    ops = synthetic_operands(layers=args.layers)
    cmp = compare(ops)
    result = {"bench": "gpu_counts_kernels", "device": torch.cuda.get_device_name(), "ok": cmp["agree"],
              "compare": cmp, "parts": sorted(wanted)}
    if "timing" in wanted:
        result.update(timing(ops))
    if "launch_floor" in wanted:
        try:  # its ways change between sessions: a failure must not lose the rest
            result["launch_floor"] = _launch_floor.measure(ops)
        except Exception as exc:
            result["launch_floor"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    for name, part in (("launch_path_ab", launch_path_ab), ("sweep", sweep), ("ceiling", ceiling)):
        if name in wanted:
            result[name] = part(ops)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result
