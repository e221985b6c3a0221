"""What the count kernel asks of a multiprocessor, compiled for a GPU on any machine: registers
per thread, shared memory and local memory (spills) of each variant at its launch shape, and the
programs that fit on one H100/H200 multiprocessor by registers.

    python3 bench/count_kernel_resources.py [--arch 90] [--out DIR]

Needs Triton with its NVIDIA backend (its own ptxas and cuobjdump), no GPU: the kernel is compiled
from its source (``triton.compile`` for ``GPUTarget("cuda", arch, 32)``) and the cubin's resource
usage read back. Prints one JSON line (``{"skipped": ...}`` without Triton's NVIDIA tools).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REGISTERS_PER_SM = 65536
"""Hopper's register file per multiprocessor (32-bit registers)."""
NAMES = ["FP8_MAX", "HALF_SUB", "MAX_CODE", "NZ_MASK", "HP_KIND", "FROM_BYTES", "ROWS", "COLS", "ITERS", "WORDS",
         "SLICE"]
"""The count kernel's constexpr parameters, in signature order (``counts._consts``)."""
VARIANTS = [("bytes", True, True, None), ("bytes_row_by_row", True, True, 1), ("bytes_bytewise", True, False, None),
            ("hp", False, False, None)]
"""(name, from FP8 bytes, bytes tested in words, rows of a flagged tile at a time: None for
``counts.FLAGGED_SLICE_ROWS``)."""


def _skip(reason: str) -> None:
    print(json.dumps({"bench": "count_kernel_resources", "skipped": reason}), flush=True)
    sys.exit(0)


def measure(arch: int = 90, iters: int = 16) -> dict[str, Any]:
    try:
        import torch
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except Exception as exc:  # no torch or no Triton: nothing to compile
        _skip(f"needs torch and Triton: {type(exc).__name__}: {exc}")
    from fp8guard.agent.fp8 import Fp8Format
    from fp8guard.agent.kernels import counts

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        _skip(f"Triton's NVIDIA tools not found ({cuobjdump})")
    kernel = counts._kernel()
    fmt = Fp8Format.E4M3
    rows_out = []
    slice_default = counts.FLAGGED_SLICE_ROWS
    for variant, from_bytes, words, slice_rows in VARIANTS:
        rows, cols, per_sm, warps = counts.COUNT_SHAPES["bytes" if from_bytes else "hp"]
        counts.FLAGGED_SLICE_ROWS = slice_default if slice_rows is None else slice_rows
        try:
            consts = dict(zip(NAMES, counts._consts(fmt, torch.bfloat16, from_bytes, rows, cols, iters, words),
                              strict=True))
        finally:
            counts.FLAGGED_SLICE_ROWS = slice_default
        signature = {"x_ptr": "*i16", "q_ptr": "*u8" if from_bytes else "*i16", "scale_ptr": "*fp32",
                     "sinv_ptr": "*fp32", "out_ptr": "*i64", "n": "i32", **{name: "constexpr" for name in NAMES}}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts),
                                  target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
        cubin = Path("/tmp") / f"fp8guard_count_{variant}.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
        found = {k: int(v) for k, v in re.findall(r"(REG|SHARED|LOCAL|STACK):(\d+)", usage)}
        threads = 32 * warps
        # registers are allocated per warp in units of 256
        per_warp = -(-found["REG"] * 32 // 256) * 256
        fit = REGISTERS_PER_SM // (per_warp * warps)
        rows_out.append({"variant": variant, "shape": [rows, cols, per_sm, warps], "slice_rows": consts["SLICE"],
                         "registers": found["REG"],
                         "shared_bytes": found.get("SHARED", 0), "local_bytes": found.get("LOCAL", 0),
                         "stack_bytes": found.get("STACK", 0), "threads": threads,
                         "programs_per_sm_by_registers": fit, "warps_per_sm_by_registers": fit * warps,
                         "programs_per_sm_launched": per_sm})
    return {"bench": "count_kernel_resources", "arch": f"sm_{arch}", "triton": triton.__version__, "iters": iters,
            "variants": rows_out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    parser.add_argument("--out", default=None, help="folder for count_kernel_resources.json")
    args = parser.parse_args()
    result = measure(args.arch)
    print(json.dumps(result))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "count_kernel_resources.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
