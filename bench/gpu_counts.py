"""Exact overflow/underflow counts of every FP8 GEMM operand on a real Transformer Engine model:
both kernel variants checked against TE's own statistics, operand by operand, then timed.

    python bench/gpu_counts.py verify --out DIR [--recipe current] [--batched]  # exits 1 on any disagreement
    python bench/gpu_counts.py time --out DIR       # overhead every step / every 10th step
    python bench/gpu_counts.py kernels --out DIR    # the kernels alone on the model's 144 shapes (no TE)
    python bench/gpu_counts.py profile --out DIR    # a counted step under torch.profiler and cProfile
    python bench/gpu_counts.py parts --out DIR      # a counted step's parts in real time (no profiler)

Model: ``bench/_te_model.py`` (the 604M-parameter TE model of ``../shared/gpu/te_baseline.py``).
Counting goes through ``TESource(exact_counts="inspect")``: TE's tensor-inspection API hands
every quantized operand (LayerNorm outputs, MLP activations and gradients included) to
fp8guard's ``Fp8GuardCounts`` feature, whose Triton kernel adds the counts into a device buffer.

Each mode's implementation and its description: ``verify`` bench/_counts_verify.py, ``time``
bench/_counts_time.py, ``kernels`` bench/_counts_kernels.py, ``profile`` bench/_counts_profile.py,
``parts`` bench/_counts_parts.py; the model with fp8guard attached and the switch between the
modes that ``time``, ``profile`` and ``parts`` compare: bench/_counts_modes.py. ``S=256 B=1``
(bench/_te_model.py's shape variables) gives a shape where the GPU idles, so that the host's share
shows alone (``profile``, ``parts``).

Prints one JSON line (``{"skipped": ...}`` without CUDA, TE or FP8).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._counts_kernels import KERNEL_PARTS, kernel_sweep
from bench._counts_modes import _TIME_MODES, DEFAULT_TIME_MODES
from bench._counts_parts import parts
from bench._counts_profile import profile_modes
from bench._counts_time import time_modes
from bench._counts_verify import verify
from bench._te_model import write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["verify", "time", "kernels", "profile", "parts"])
    parser.add_argument("--recipe", choices=["delayed", "current"], default="delayed",
                        help="verify: DelayedScaling or Float8CurrentScaling (HYBRID)")
    parser.add_argument("--batched", action="store_true",
                        help="verify: fp8guard's feature counts eight operands a launch (count_batch.CountBatch, the "
                             "library's default); without it, one launch per operand")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=4, help="verify: counted steps compared")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--settle", type=int, default=2, help="time: untimed steps after each mode switch")
    parser.add_argument("--profile-steps", type=int, default=3, help="profile: steps per mode per profiler")
    parser.add_argument("--trace", action="store_true", help="profile: write the counted steps' chrome trace")
    parser.add_argument("--tag", default="", help="time, profile, parts, kernels: suffix of the result file's name")
    parser.add_argument("--modes", default=",".join(DEFAULT_TIME_MODES),
                        help=f"time: the modes compared, comma-separated, of {', '.join(_TIME_MODES)} "
                             "(plain is always timed)")
    parser.add_argument("--parts", default=None, type=lambda v: v.split(","),
                        help=f"kernels: the parts run, comma-separated, of {', '.join(KERNEL_PARTS)} (default: all)")
    parser.add_argument("--budget-s", type=float, default=120.0, help="parts: stop starting rounds after this")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.what == "verify":
        result = verify(args)
        name = f"gpu_counts_verify{'' if args.recipe == 'delayed' else '_' + args.recipe}{'_batched' if args.batched else ''}"
        write_result(result, args.out, f"{name}.json")
    elif args.what == "kernels":
        result = kernel_sweep(args)
        write_result(result, args.out, f"gpu_counts_kernels{args.tag}.json")
    elif args.what == "parts":
        result = parts(args)
        write_result(result, args.out, f"gpu_counts_parts{args.tag}.json")
    elif args.what == "profile":
        result = profile_modes(args)
        write_result(result, args.out, f"gpu_counts_profile{args.tag}.json")
    else:
        result = time_modes(args)
        write_result(result, args.out, f"gpu_counts_time{args.tag}.json")
    if result.get("ok") is False:
        sys.exit(1)  # a disagreement between the variants or with TE: named in the JSON


if __name__ == "__main__":
    main()
