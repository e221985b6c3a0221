"""Inputs on which the two counting-kernel variants could part, with TE's cast emulated on the CPU.

Shared by the CPU tests (tests/agent/test_kernels.py, torch and Triton-interpreter paths) and
``bench/gpu_counts.py verify``, which casts the same inputs with Transformer Engine's own
quantizer on the GPU and holds both compiled variants to TE's formulas on TE's bytes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fp8guard.agent.fp8 import Fp8Format, quantize

FORMATS = [Fp8Format.E4M3, Fp8Format.E5M2]


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def _tie_inputs(fmt: Fp8Format, dtype: torch.dtype, count: int = 3) -> list[tuple[torch.Tensor, float]]:
    """(x, scale) pairs where the exact product x * scale is a hair above half the smallest
    subnormal but its float32 rounding is exactly half: a tie the cast rounds to even, i.e. to a
    zero byte. x also holds its dtype neighbours (products just above and below)."""
    half = fmt.smallest_subnormal / 2
    found: list[tuple[torch.Tensor, float]] = []
    for k in range(1, 4000):
        xv = float(torch.tensor(half * (1 + k / 4096), dtype=torch.float64).to(dtype))
        s = _f32(half / xv)
        for _ in range(4):
            exact = xv * s  # float64: exact (at most 24 + 24 significant bits)
            if _f32(exact) == half and exact > half:
                t = torch.tensor([xv], dtype=dtype)
                up = torch.nextafter(t.float(), torch.tensor(math.inf)).to(dtype)
                if up.item() == xv:  # bf16/fp16: the next representable value
                    up = (t.view(torch.int16) + 1).view(dtype) if dtype != torch.float32 else up
                down = (t.view(torch.int16) - 1).view(dtype) if dtype != torch.float32 else \
                    torch.nextafter(t, torch.tensor(0.0))
                x = torch.cat([t, -t, up, -up, down, -down])
                found.append((x, s))
                break
            s = _f32(math.nextafter(s, math.inf))
        if len(found) == count:
            break
    return found


def edge_cases() -> list[dict[str, Any]]:
    """Named (x, scale, format, cast) cases: each a way the FP8-bytes and high-precision variants
    could part. ``cast``: ``satfinite`` (TE's: CUDA's __NV_SATFINITE, inf and overflow to +/-max)
    or ``nonsat`` (a cast without saturation: E5M2 overflow to an inf byte, E4M3 to NaN)."""
    cases = []
    for fmt in FORMATS:
        half = fmt.smallest_subnormal / 2
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for x, s in _tie_inputs(fmt, dtype):
                cases.append({"name": f"float32 product ties at half the smallest subnormal ({fmt.value}, {dtype})",
                              "x": x, "scale": s, "fmt": fmt, "cast": "satfinite"})
        # exact ties in the product: x * scale == half (zero byte) and == the smallest subnormal
        p2 = torch.tensor([half, -half, 2 * half, -2 * half, 3 * half, 1.5 * half, 0.5 * half], dtype=torch.float32)
        cases.append({"name": f"power-of-two scale, exact ties ({fmt.value})", "x": (p2 / 4.0).to(torch.bfloat16),
                      "scale": 4.0, "fmt": fmt, "cast": "satfinite"})
        # signed zeros: -0.0 casts to the 0x80 byte, which TE counts as zero (no underflow)
        zeros = torch.tensor([0.0, -0.0, 0.0, -0.0, -1e-30, 1e-30, -half / 10], dtype=torch.float32)
        cases.append({"name": f"+0, -0 and negative underflows to the -0 byte ({fmt.value})",
                      "x": zeros.to(torch.bfloat16), "scale": 1.0, "fmt": fmt, "cast": "satfinite"})
        # NaN and inf: NaN is neither; inf always overflows, whatever byte the cast made of it
        special = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, 1.0, fmt.fp8_max * 3, -fmt.fp8_max * 3])
        for cast in ("satfinite", "nonsat"):
            for dtype in (torch.bfloat16, torch.float32):
                cases.append({"name": f"NaN, inf, overflow, {cast} cast ({fmt.value}, {dtype})",
                              "x": special.to(dtype), "scale": 1.0, "fmt": fmt, "cast": cast})
        # subnormal high-precision inputs: nonzero by their bits; with a huge scale (delayed
        # scaling keeps float32 max when the amax is tiny) their product is a normal number
        sub_bf16 = torch.tensor([2.0**-130, -2.0**-130, 2.0**-133, 2.0**-127, 3 * 2.0**-131], dtype=torch.float32)
        for s in (1.0, 2.0**120, 2.0**121, 2.0**126, 3.4e38):
            cases.append({"name": f"subnormal inputs, scale {s:g} ({fmt.value})", "x": sub_bf16.to(torch.bfloat16),
                          "scale": s, "fmt": fmt, "cast": "satfinite"})
            cases.append({"name": f"float32 subnormal inputs, scale {s:g} ({fmt.value})",
                          "x": torch.tensor([1e-40, -1e-42, 1e-45, 1.1e-38]), "scale": s, "fmt": fmt,
                          "cast": "satfinite"})
        # the overflow threshold fp8_max * scale_inv (non power-of-two scale: scale_inv is rounded)
        s = fmt.fp8_max / 700.0
        thr = float(torch.tensor([fmt.fp8_max]) * torch.reciprocal(torch.tensor([s], dtype=torch.float32)))
        near = [thr, math.nextafter(thr, math.inf), math.nextafter(thr, 0.0), fmt.fp8_max / s,
                math.nextafter(fmt.fp8_max / s, math.inf)]
        near = near + [-v for v in near]
        for cast in ("satfinite", "nonsat"):
            cases.append({"name": f"overflow threshold neighbours, {cast} cast ({fmt.value})",
                          "x": torch.tensor(near, dtype=torch.float32), "scale": s, "fmt": fmt, "cast": cast})
        # the largest finite byte that is not an overflow: values rounding up to fp8_max from below
        below = torch.tensor([fmt.fp8_max * 0.97, fmt.fp8_max * 0.999, fmt.fp8_max, -fmt.fp8_max * 0.98])
        cases.append({"name": f"values rounding to the maximum byte without overflowing ({fmt.value})",
                      "x": below.to(torch.bfloat16), "scale": 1.0, "fmt": fmt, "cast": "satfinite"})
    return cases


def cast_bytes(x: torch.Tensor, scale: float, fmt: Fp8Format, cast: str) -> torch.Tensor:
    if cast == "satfinite":
        return quantize(x, scale, fmt).view(torch.uint8)
    return (x.to(torch.float32) * scale).to(fmt.dtype).view(torch.uint8)
