"""What the count kernel asks of a multiprocessor, compiled for a GPU on any machine: registers
per thread, shared and local memory (spills) of each variant at its launch shape, for a few of
the loop lengths (``ITERS``) real launches get, and the programs that fit on one H100/H200
multiprocessor by registers.

    python3 bench/count_kernel_resources.py [--arch 90] [--out DIR]

Needs Triton with its NVIDIA backend (its own ptxas and cuobjdump), no GPU: the kernel is compiled
from its source (``triton.compile`` for ``GPUTarget("cuda", arch, 32)``) with the hints Triton's
JIT adds for 16-byte-aligned tensors and an element count divisible by 16 (every operand of the
604M model), and the cubin's resource usage read back. Prints one JSON line (``{"skipped": ...}``
without Triton's NVIDIA tools).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REGISTERS_PER_SM = 65536
"""Hopper's register file per multiprocessor (32-bit registers)."""
MAX_PROGRAMS_PER_SM = 32
"""Hopper's resident thread blocks per multiprocessor at most."""
NAMES = ["FP8_MAX", "HALF_SUB", "MAX_CODE", "NZ_MASK", "HP_KIND", "FROM_BYTES", "ROWS", "COLS", "ITERS", "WORDS"]
"""The count kernel's constexpr parameters, in signature order (``counts._jit_launch``)."""
RUNTIME_ARGS = 6
"""x, q, scale, scale_inv, out, n: the JIT marks each divisible by 16 for aligned tensors and
such an element count."""
VARIANTS = [("bytes", True, True), ("bytes_bytewise", True, False), ("hp", False, False)]
"""(name, from FP8 bytes, bytes tested in words)."""


def _skip(reason: str) -> None:
    print(json.dumps({"bench": "count_kernel_resources", "skipped": reason}), flush=True)
    sys.exit(0)


def measure(arch: int = 90, iters_list: tuple[int, ...] = (1, 4, 16)) -> dict[str, Any]:
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
    fmt, dtype = Fp8Format.E4M3, torch.bfloat16
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(RUNTIME_ARGS)}
    rows_out = []
    with tempfile.TemporaryDirectory(prefix="fp8guard-count-cubin-") as tmp:
        for variant, from_bytes, words in VARIANTS:
            rows, cols, per_sm, warps = counts.COUNT_SHAPES["bytes" if from_bytes else "hp"]
            for iters in iters_list:
                consts = dict(zip(NAMES, (fmt.fp8_max, fmt.smallest_subnormal / 2, counts._MAX_CODE[fmt],
                                          counts._NONZERO_MASK[dtype], counts._HP_KIND[dtype], from_bytes, rows,
                                          cols, iters, words), strict=True))
                signature = {"x_ptr": "*i16", "q_ptr": "*u8" if from_bytes else "*i16", "scale_ptr": "*fp32",
                             "sinv_ptr": "*fp32", "out_ptr": "*i64", "n": "i32",
                             **{name: "constexpr" for name in NAMES}}
                compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=aligned),
                                          target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
                cubin = Path(tmp) / f"{variant}_{iters}.cubin"
                cubin.write_bytes(compiled.asm["cubin"])
                usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True,
                                       text=True, check=True).stdout
                found = {k: int(v) for k, v in re.findall(r"(REG|SHARED|LOCAL|STACK):(\d+)", usage)}
                per_warp = -(-found["REG"] * 32 // 256) * 256  # allocated per warp in units of 256
                fit = min(REGISTERS_PER_SM // (per_warp * warps), MAX_PROGRAMS_PER_SM)
                rows_out.append({"variant": variant, "shape": [rows, cols, per_sm, warps], "iters": iters,
                                 "registers": found["REG"], "shared_bytes": found.get("SHARED", 0),
                                 "local_bytes": found.get("LOCAL", 0), "stack_bytes": found.get("STACK", 0),
                                 "programs_per_sm_by_registers": fit, "warps_per_sm_by_registers": fit * warps,
                                 "programs_per_sm_launched": per_sm})
    return {"bench": "count_kernel_resources", "arch": f"sm_{arch}", "triton": triton.__version__,
            "hints": "16-byte-aligned tensors, element count divisible by 16", "variants": rows_out}


def main() -> None:
    from bench._te_model import write_result

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    parser.add_argument("--out", default=None, help="folder for count_kernel_resources.json")
    args = parser.parse_args()
    result = measure(args.arch)
    write_result(result, args.out, "count_kernel_resources.json")


if __name__ == "__main__":
    main()
