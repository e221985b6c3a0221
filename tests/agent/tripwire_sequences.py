"""Randomised tripwire runs, checked two ways at once: the one-launch kernel against the torch ops.

Shared by tests/agent/test_tripwire_kernel.py under Triton's CPU interpreter and, on a GPU, the
same module's CUDA test (the compiled kernel, where fused multiply-adds or a flushing
conversion would show). Each run is a random configuration and a random sequence of steps: a
warm-up, losses and gradient norms that drift, jump, fall (the early reference follows a lower
norm), rise over the early bounds for a few steps in a row, are NaN, +/-inf, negative or zero, or
missing, or float32 subnormals; saturation ratios absent, empty, or up to 2,500 of them (several kernel blocks) with
values at, just over and just under the threshold's float32 value, NaN and inf; losses in
float32, BF16, FP16 and float64 (which the kernel leaves to the torch ops).
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from fp8guard.agent.tripwire import LOCAL, SHARED, Tripwire


def _config(rng: random.Random) -> dict[str, Any]:
    return {"loss_factor": rng.choice([1.3, 1.05, 2.0]), "grad_factor": rng.choice([5.0, 2.5, 1.1]),
            "saturation": rng.choice([8.0, 8.1, 1.7]), "warmup_steps": rng.choice([0, 1, 3, 8, 20]),
            "early_loss_rise": rng.choice([0.05, 0.3, 1e-3]), "early_grad_factor": rng.choice([20.0, 3.0, 1.5]),
            "early_steps": rng.choice([1, 2, 3]), "use_loss": rng.random() > 0.15}


def _value(rng: random.Random, level: float, step: int, blowup: range) -> float | None:
    if step in blowup:  # a run over the early bounds, several steps in a row
        return level * rng.uniform(1.5, 40.0) if level > 0 else -level * rng.uniform(1.5, 40.0)
    r = rng.random()
    if r < 0.12:
        return None
    if r < 0.17:
        return rng.choice([math.nan, math.inf, -math.inf])
    if r < 0.20:
        return rng.choice([0.0, -0.0, -level, 1e-40, level * 1e-38])  # subnormal: no flush to zero
    if r < 0.30:
        return level * rng.uniform(1.0, 40.0)  # a jump, or over the early bound
    if r < 0.36:
        return level * rng.uniform(0.01, 0.5)  # a fall (a new smallest gradient norm)
    return level * (1.0 + 0.1 * rng.uniform(-1.0, 1.0)) * (1.0 - 0.01 * step)


def _saturation(rng: random.Random, threshold: float, size: int) -> list[float] | None:
    r = rng.random()
    if r < 0.3:
        return None
    if r < 0.35:
        return []
    at = float(torch.tensor(threshold, dtype=torch.float32))
    above = math.nextafter(at, math.inf)
    below = math.nextafter(at, -math.inf)
    values = [rng.uniform(0.0, threshold) for _ in range(size)]
    for _ in range(rng.choice([0, 0, 1, 3])):
        values[rng.randrange(size)] = rng.choice([at, above, below, math.nan, math.inf, -math.inf, threshold * 3])
    return values


def run(seed: int, device: torch.device, steps: int = 40) -> dict[str, Any]:
    """One random run through both paths; the first step whose state, verdict word or host
    verdict differs (None: none did), and what tripped along the way."""
    rng = random.Random(seed)
    cfg = _config(rng)
    kernel = Tripwire(device, backend="triton", **cfg)
    torch_ops = Tripwire(device, backend="torch", **cfg)
    size = rng.choice([1, 7, 1024, 1025, 2500])
    dtype = rng.choice([torch.float32] * 4 + [torch.bfloat16, torch.float16, torch.float64])
    loss_level, norm_level = rng.uniform(-2.0, 10.0), rng.uniform(0.1, 50.0)
    start = rng.randrange(1, 12)
    blowup = range(start, start + rng.choice([0, 2, 4]))
    tally = {"shared": 0, "local": 0, "saturation": 0, "early": 0, "missing": 0, "fallback": 0, "steps": steps}
    mismatch = None
    for step in range(steps):
        loss = _value(rng, loss_level, step, blowup)
        norm = _value(rng, norm_level, step, blowup)
        sat = _saturation(rng, cfg["saturation"], size)
        args = {"loss": None if loss is None else torch.tensor(loss, dtype=dtype, device=device),
                "grad_norm": None if norm is None else torch.tensor(norm, dtype=torch.float32, device=device),
                "saturation": None if sat is None else torch.tensor(sat, dtype=torch.float32, device=device)}
        before = kernel._kernel.launches if kernel._kernel is not None else 0
        kernel.check(step, **args)
        torch_ops.check(step, **args)
        launched = (kernel._kernel.launches if kernel._kernel is not None else 0) - before
        if device.type == "cuda":
            torch.cuda.synchronize()
        tally["fallback"] += launched == 0
        tally["missing"] += loss is None or norm is None
        got = [kernel.fired(), torch_ops.fired()]
        same_state = torch.equal(kernel._state.view(torch.int32), torch_ops._state.view(torch.int32))
        same_bits = int(kernel._bits) == int(torch_ops._bits)
        if mismatch is None and not (same_state and same_bits and got[0] == got[1]):
            mismatch = {"step": step, "config": cfg, "dtype": str(dtype), "loss": loss, "norm": norm,
                        "kernel_state": kernel._state.tolist(), "torch_state": torch_ops._state.tolist(),
                        "bits": [int(kernel._bits), int(torch_ops._bits)], "fired": got}
        bits = int(torch_ops._bits)
        tally["shared"] += bool(bits & SHARED)
        tally["local"] += bool(bits & LOCAL)
        if sat and any(v > float(torch.tensor(cfg["saturation"], dtype=torch.float32)) for v in sat):
            tally["saturation"] += 1
        tally["early"] += bool((torch_ops._early_run >= cfg["early_steps"]).any())
    return {"seed": seed, "mismatch": mismatch, "tally": tally}
