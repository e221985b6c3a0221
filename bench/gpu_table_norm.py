"""Bandwidth of the gradients' sum of squares (``TableSumOfSquares``) by launch configuration (issue 14.1).

    python bench/gpu_table_norm.py --out OUT/gpu_table_norm.json      # the H200: about 1-2 minutes
    TRITON_INTERPRET=1 python bench/gpu_table_norm.py --smoke --out /tmp/table_norm.json  # CPU: runs, no figure

The gradients of two ~605M-parameter ``te.TransformerLayer`` stacks, as bf16 tensors of their
shapes (12 parameters per layer: QKV, projection, FC1, FC2 weights and biases, two LayerNorms):
12 layers x hidden 2048 and 48 layers x hidden 1024, 1.2 GB each. For every configuration
(elements per load ``block``, loads per block-table entry ``sub``, ``warps`` per program,
programs per multiprocessor ``per_sm``): one table built and pointed, ``--launches`` calls between
two CUDA events, median of ``--repeats``; GB/s over the gradients' bytes; the result's relative
difference from a float64 norm. Beside them, two references on the same bytes: torch's
``vector_norm`` over one contiguous tensor (what one launch over one buffer reaches: the
ceiling) and ``torch._foreach_norm`` over the list. Prints the best configuration per model and
writes everything to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from fp8guard.agent.kernels import table_norm
from fp8guard.agent.kernels.table_norm import TableSumOfSquares

MODELS = {"12x2048": (12, 2048), "48x1024": (48, 1024)}
GRID = {
    "block": (2048, 4096, 8192),
    "sub": (1, 2, 4),
    "warps": (4, 8, 16),
    "per_sm": (2, 4, 8),
}


def layer_shapes(hidden: int) -> list[tuple[int, ...]]:
    h = hidden
    return [(3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (h,), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,)]


def grads_for(layers: int, hidden: int, device: torch.device, scale: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = layer_shapes(hidden // scale) * layers
    return [torch.randn(s, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16) for s in shapes]


def _time(fn: Any, launches: int, repeats: int, cuda: bool) -> float:
    """Median milliseconds per call."""
    fn()
    samples = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(launches):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / launches)
        else:
            t0 = time.perf_counter()
            for _ in range(launches):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / launches)
    return statistics.median(samples)


def _one_buffer(grads: list[torch.Tensor], args: argparse.Namespace, cuda: bool) -> tuple[float, float]:
    """torch's vector_norm over the same bytes in one contiguous buffer: (ms per call, value)."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    ms = _time(lambda: torch.linalg.vector_norm(flat, dtype=torch.float32), args.launches, args.repeats, cuda)
    return ms, torch.linalg.vector_norm(flat, dtype=torch.float32).item()


def measure(grads: list[torch.Tensor], args: argparse.Namespace, grid: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    cuda = grads[0].device.type == "cuda"
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    exact = torch.sqrt(sum(g.double().square().sum() for g in grads)).item()
    rows: list[dict[str, Any]] = []

    def row(name: str, ms: float, value: float, **cfg: Any) -> None:
        rows.append({"name": name, **cfg, "ms": round(ms, 4), "GBps": round(nbytes / ms / 1e6),
                     "rel_diff_vs_float64": abs(value - exact) / exact})

    row("vector_norm over one buffer (ceiling)", *_one_buffer(grads, args, cuda))
    row("torch._foreach_norm", _time(lambda: torch._foreach_norm(grads, 2, dtype=torch.float32), args.launches,
                                     args.repeats, cuda),
        torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))).item())
    numels = [g.numel() for g in grads]
    ptrs = [g.data_ptr() for g in grads]
    for block, sub, warps, per_sm in itertools.product(*grid.values()):
        table = TableSumOfSquares(numels, torch.bfloat16, grads[0].device, block=block, sub=sub, warps=warps,
                                  per_sm=per_sm)
        table.point(ptrs)
        try:
            ms = _time(table, args.launches, args.repeats, cuda)
            value = torch.sqrt(table()).item()  # type: ignore[arg-type]
        except Exception as exc:  # a configuration the compiler refuses (registers): recorded, not fatal
            rows.append({"name": "table", "block": block, "sub": sub, "warps": warps, "per_sm": per_sm,
                         "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            continue
        row("table", ms, value, block=block, sub=sub, warps=warps, per_sm=per_sm)
    tables = [r for r in rows if r["name"] == "table" and "ms" in r]
    best = min(tables, key=lambda r: r["ms"]) if tables else None
    default = next((r for r in tables if (r["block"], r["sub"], r["warps"], r["per_sm"]) ==
                    (table_norm.BLOCK, table_norm.SUB_BLOCKS, table_norm.WARPS, table_norm.PROGRAMS_PER_SM)), None)
    return {"grad_bytes_GB": round(nbytes / 1e9, 3), "tensors": len(grads), "best": best, "default": default,
            "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and a small grid on the CPU (interpreter)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print(json.dumps({"bench": "gpu_table_norm", "skipped": "no CUDA"}))
        return 0
    device = torch.device("cuda" if cuda and not args.smoke else "cpu")
    grid = GRID if not args.smoke else {"block": (64,), "sub": (1, 2), "warps": (4,), "per_sm": (1,)}
    if args.smoke:
        args.launches, args.repeats = 1, 1
    t0 = time.perf_counter()
    result: dict[str, Any] = {"bench": "gpu_table_norm", "smoke": args.smoke, "torch": torch.__version__,
                              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                              "defaults": {"block": table_norm.BLOCK, "sub": table_norm.SUB_BLOCKS,
                                           "warps": table_norm.WARPS, "per_sm": table_norm.PROGRAMS_PER_SM},
                              "models": {}}
    out = Path(args.out)
    out = out / "gpu_table_norm.json" if out.is_dir() else out
    for name, (layers, hidden) in MODELS.items():
        grads = grads_for(layers if not args.smoke else 2, hidden, device, scale=1 if not args.smoke else 64)
        result["models"][name] = measure(grads, args, grid)
        del grads
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out.write_text(json.dumps(result, indent=1))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({"bench": "gpu_table_norm", "seconds": result["seconds"],
                      **{k: {"best": v["best"], "default": v["default"], "ceiling_GBps": v["rows"][0]["GBps"],
                             "foreach_GBps": v["rows"][1]["GBps"]} for k, v in result["models"].items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
