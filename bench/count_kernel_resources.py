"""What the count kernel asks of a multiprocessor, compiled for a GPU on any machine: registers
per thread, shared and local memory (spills) of each variant at its launch shape, for a few of
the loop lengths (``ITERS``) real launches get, and the programs that fit on one H100/H200
multiprocessor by registers (and the hardware's limits); with the plain streaming read
(``bench/_stream_read.py``) beside them, and static counts of each one's machine code (``--sass``
writes the SASS itself).

    python3 bench/count_kernel_resources.py [--arch 90] [--out DIR] [--sass DIR]

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
MAX_WARPS_PER_SM = 64
"""Hopper's resident warps per multiprocessor at most (2,048 threads)."""
RUNTIME_ARGS = 6
"""x, q, scale, scale_inv, out, n: the JIT marks each divisible by 16 for aligned tensors and
such an element count."""


def _skip(reason: str) -> None:
    print(json.dumps({"bench": "count_kernel_resources", "skipped": reason}), flush=True)
    sys.exit(0)


def _resources(cubin_bytes: bytes, cuobjdump: Path, tmp: Path, name: str, warps: int, iters: int,
               sass_dir: Path | None) -> dict[str, Any]:
    """A compiled kernel's resource usage and what fits on a multiprocessor by registers, and
    static counts of its machine code (every instruction once, wherever it sits: the clean-tile
    loop, the flagged path, the prologue): global loads (and those of 16 bytes), barriers,
    shuffles. With ``sass_dir`` its SASS is written there as ``<name>.sass`` to be read."""
    cubin = tmp / f"{name}.cubin"
    cubin.write_bytes(cubin_bytes)
    usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True,
                           text=True, check=True).stdout
    found = {k: int(v) for k, v in re.findall(r"(REG|SHARED|LOCAL|STACK):(\d+)", usage)}
    per_warp = -(-found["REG"] * 32 // 256) * 256  # allocated per warp in units of 256
    fit = min(REGISTERS_PER_SM // (per_warp * warps), MAX_PROGRAMS_PER_SM, MAX_WARPS_PER_SM // warps)
    sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4})\*/\s+([^;]*);", sass)]
    ops = [_opcode(text) for _, text in code]
    if sass_dir is not None:
        (sass_dir / f"{name}.sass").write_text(sass)
    return {**_clean_tile(code, iters), "registers": found["REG"], "shared_bytes": found.get("SHARED", 0),
            "local_bytes": found.get("LOCAL", 0), "stack_bytes": found.get("STACK", 0),
            "programs_per_sm_by_registers": fit, "warps_per_sm_by_registers": fit * warps,
            "sass_instructions": len(ops), "sass_global_loads": sum(op.startswith("LDG") for op in ops),
            "sass_global_loads_16_bytes": sum(op.startswith("LDG") and ".128" in op for op in ops),
            "sass_barriers": sum(op.startswith("BAR") for op in ops),
            "sass_shuffles": sum(op.startswith("SHFL") for op in ops)}


def _opcode(instruction: str) -> str:
    """``LDG.E.128`` of ``@!P0 LDG.E.128 R12, desc[UR12][R2.64]`` (the predicate dropped)."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction.strip()).split(" ")[0]


def _clean_tile(code: list[tuple[int, str]], iters: int) -> dict[str, Any]:
    """What one pass of the tile loop costs a thread when the tile is clean, read off the SASS:
    the loop is the longest backward branch's span; a clean tile runs from its head to the first
    forward branch inside it (the flag test skipping the flagged path) and from that branch's
    target to the backward branch. None with one tile a program (no tile loop), for a kernel without
    the skip (the high-precision variant) and where the compiler unrolled the loop (the plain read)."""
    branches = [(at, int(m.group(1), 16)) for at, text in code if (m := re.search(r"\bBRA\b.*0x([0-9a-f]+)", text))]
    loops = [(at, to) for at, to in branches if to < at]
    if not loops or iters < 2:
        return {"clean_tile_instructions": None}
    end, head = max(loops, key=lambda b: b[0] - b[1])
    skip = next(((at, to) for at, to in branches if head <= at < to <= end), None)
    if skip is None:
        return {"clean_tile_instructions": None}
    ops = [_opcode(text) for at, text in code if head <= at <= skip[0] or skip[1] <= at <= end]
    return {"clean_tile_instructions": len(ops), "clean_tile_global_loads": sum(o.startswith("LDG") for o in ops),
            "clean_tile_barriers": sum(o.startswith("BAR") for o in ops),
            "clean_tile_shuffles": sum(o.startswith("SHFL") for o in ops)}


def measure(arch: int = 90, iters_list: tuple[int, ...] = (1, 4, 16), sass_dir: Path | None = None) -> dict[str, Any]:
    try:
        import torch
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except Exception as exc:  # no torch or no Triton: nothing to compile
        _skip(f"needs torch and Triton: {type(exc).__name__}: {exc}")
    from bench._count_probe import SETTINGS
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
        # the variants bench/gpu_counts.py times: (name, the count module's settings; None: high precision)
        for variant, settings in [("bytes", {}), *SETTINGS.items(), ("hp", None)]:
            from_bytes = settings is not None
            words = from_bytes and settings.get("BYTES_IN_WORDS", True)
            row_by_row = settings.get("ROW_BY_ROW", 0) if words else 0
            ahead = settings.get("TILES_AHEAD", 1) if words else 1
            rows, cols, per_sm, warps = counts.COUNT_SHAPES["bytes" if from_bytes else "hp"]
            for iters in iters_list:
                consts = dict(zip(counts.CONST_NAMES, counts.kernel_consts(fmt, dtype, from_bytes, rows, cols, iters,
                                                                           words, row_by_row, ahead), strict=True))
                signature = {"x_ptr": "*i16", "q_ptr": "*u8" if from_bytes else "*i16", "scale_ptr": "*fp32",
                             "sinv_ptr": "*fp32", "out_ptr": "*i64", "n": "i32",
                             **{name: "constexpr" for name in counts.CONST_NAMES}}
                compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=aligned),
                                          target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
                rows_out.append({"variant": variant, "shape": [rows, cols, per_sm, warps], "iters": iters,
                                 **_resources(compiled.asm["cubin"], cuobjdump, Path(tmp), f"{variant}_{iters}", warps,
                                              iters, sass_dir),
                                 "programs_per_sm_launched": per_sm})
        # the default setting's batched launch (count_batch.CountBatch: up to eight operands, their
        # addresses and counts as arguments; the addresses 16-byte aligned, the counts divisible by
        # 16, as the JIT specialises them; scale_inv's, count rows' and first programs unspecialised)
        from fp8guard.agent.kernels.count_batch import BATCH_SLOTS

        rows, cols, per_sm, warps = counts.COUNT_SHAPES["bytes"]
        batch_sig: dict[str, str] = {}
        batch_attrs: dict[tuple[int, ...], list[list[Any]]] = {}
        for j in range(BATCH_SLOTS):
            for name, kind in ((f"x{j}", "i64"), (f"q{j}", "i64"), (f"i{j}", "i64"), (f"o{j}", "i64"), (f"n{j}", "i32")):
                if name[0] in "xqn":
                    batch_attrs[(len(batch_sig),)] = [["tt.divisibility", 16]]
                batch_sig[name] = kind
        batch_sig.update({f"f{j}": "i32" for j in range(1, BATCH_SLOTS)})
        batch_sig.update({name: "constexpr" for name in counts.CONST_NAMES})
        for iters in iters_list:
            consts = dict(zip(counts.CONST_NAMES, counts.kernel_consts(fmt, dtype, True, rows, cols, iters, True,
                                                                       counts.ROW_BY_ROW, counts.TILES_AHEAD), strict=True))
            compiled = triton.compile(ASTSource(fn=counts._batch_kernel(), signature=batch_sig, constexprs=consts,
                                                attrs=batch_attrs),
                                      target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
            rows_out.append({"variant": "bytes_batched", "shape": [rows, cols, per_sm, warps], "iters": iters,
                             **_resources(compiled.asm["cubin"], cuobjdump, Path(tmp), f"bytes_batched_{iters}", warps,
                                          iters, sass_dir),
                             "programs_per_sm_launched": per_sm})
        # the plain streaming read (bench/_stream_read.py) at its fastest shape (1,024 words a
        # block, 16 programs per SM, 4 warps; its loop over ITERS blocks unrolled by the compiler)
        from bench import _stream_read

        block, per_sm, warps = _stream_read.SHAPES[0]
        for iters in iters_list:
            compiled = triton.compile(ASTSource(fn=_stream_read._read_kernel,
                                                signature={"w_ptr": "*i32", "sink_ptr": "*i32", "nw": "i32",
                                                           "BLOCK": "constexpr", "ITERS": "constexpr"},
                                                constexprs={"BLOCK": block, "ITERS": iters},
                                                attrs={(i,): [["tt.divisibility", 16]] for i in range(3)}),
                                      target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
            rows_out.append({"variant": "stream_read", "shape": [block, per_sm, warps], "iters": iters,
                             **_resources(compiled.asm["cubin"], cuobjdump, Path(tmp), f"stream_read_{iters}", warps,
                                          iters, sass_dir),
                             "programs_per_sm_launched": per_sm})
    return {"bench": "count_kernel_resources", "arch": f"sm_{arch}", "triton": triton.__version__,
            "hints": "16-byte-aligned tensors, element count divisible by 16", "variants": rows_out}


def main() -> None:
    from bench._te_model import write_result

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    parser.add_argument("--out", default=None, help="folder for count_kernel_resources.json")
    parser.add_argument("--sass", default=None, help="folder to write each compiled kernel's SASS to")
    args = parser.parse_args()
    sass_dir = None
    if args.sass:
        sass_dir = Path(args.sass)
        sass_dir.mkdir(parents=True, exist_ok=True)
    result = measure(args.arch, sass_dir=sass_dir)
    write_result(result, args.out, "count_kernel_resources.json")


if __name__ == "__main__":
    main()
