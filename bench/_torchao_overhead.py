"""``bench/gpu_torchao.py``'s ``overhead`` part: the monitor's cost per step, side by side with
torchao alone in one process; with ``--diagnose-steps``, where ``monitor.step``'s host time goes.

``overhead``: modes ``plain``, ``monitor`` (``monitor.step(loss)``, own grad norm),
``plain_clip`` and ``monitor_clip`` (the loop clips and passes the norm) in blocks of
``--block`` steps, rotating the order every round, in one process. A block is timed as
synchronize, the steps, synchronize (throughput of a loop that never syncs); the figure is the
median per-step time of each mode and the ratio monitored / plain. During plain blocks the
source is off (module hooks detached, torchao's functions unwrapped), so ``plain`` is torchao
alone. Then the device activities (kernels, copies) of one profiled plain and one monitored
step (GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench._torchao_model import Loop, source_off

MODES = ("plain", "monitor", "plain_clip", "monitor_clip")


def part_overhead(torch: Any, loop: Loop, a: argparse.Namespace, deadline: float) -> dict[str, Any]:
    cuda = loop.x.is_cuda
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    for mode in MODES:
        with source_off(loop.model) if mode.startswith("plain") else contextlib.nullcontext():
            for _ in range(a.warmup):
                loop.step(mode)
    per_step: dict[str, list[float]] = {m: [] for m in MODES}
    gc_ms: dict[str, dict[int, list[float]]] = {m: {0: [], 1: [], 2: []} for m in MODES}
    current = [MODES[0]]
    gc_t0 = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:  # Python's collections, timed per mode
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            gc_ms[current[0]][info["generation"]].append((time.perf_counter() - gc_t0[0]) * 1e3)

    gc.callbacks.append(on_gc)
    host_us: list[float] = []
    slow: list[tuple[float, int, float]] = []  # (whole step's host us, monitor step, monitor.step's host us)
    rounds = 0
    for r in range(a.rounds):
        if r >= 2 and time.perf_counter() > deadline:
            break
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        for mode in order:
            current[0] = mode
            with source_off(loop.model) if mode.startswith("plain") else contextlib.nullcontext():
                sync()
                t0 = time.perf_counter()
                for _ in range(a.block):
                    if mode == "monitor":  # the host time of monitor.step itself, in the timed loop
                        s0 = time.perf_counter()
                        at = loop.monitor.next_step
                        loss = loop.forward_backward()
                        loop.opt.step()
                        c0 = time.perf_counter()
                        loop.monitor.step(loss)
                        c1 = time.perf_counter()
                        host_us.append((c1 - c0) * 1e6)
                        loop.opt.zero_grad(set_to_none=True)
                        slow.append(((time.perf_counter() - s0) * 1e6, at, (c1 - c0) * 1e6))
                    else:
                        loop.step(mode)
                sync()
            per_step[mode].append((time.perf_counter() - t0) / a.block * 1e3)
        rounds += 1
    gc.callbacks.remove(on_gc)
    ms = {m: statistics.median(v) for m, v in per_step.items()}
    launches = {m: _launches(torch, loop, m) for m in ("plain", "monitor")} if cuda else None
    res: dict[str, Any] = {
        "ok": True, "rounds": rounds, "block": a.block, "ms_per_step": ms, "device_launches_per_step": launches,
        "ratio_monitor": ms["monitor"] / ms["plain"], "ratio_monitor_clip": ms["monitor_clip"] / ms["plain_clip"],
        "paired_ratio_monitor_median": statistics.median(
            m / p for m, p in zip(per_step["monitor"], per_step["plain"], strict=True)),
        "monitor_step_host_us_median": statistics.median(host_us) if host_us else None,
        "flush_interval_steps": a.flush_steps,
        # the monitored steps whose host time (the whole step, not synchronised) was longest: where a
        # stall sits, and whether it falls on the flush cadence (step % flush_interval_steps)
        "slowest_monitored_steps": [{"step": at, "step_host_ms": round(us / 1e3, 2), "monitor_step_host_ms": round(m / 1e3, 2),
                                     "step_mod_flush": at % a.flush_steps if a.flush_steps else None}
                                    for us, at, m in sorted(slow, reverse=True)[:8]],
        "monitored_step_host_ms_median": round(statistics.median(u for u, _, _ in slow) / 1e3, 2) if slow else None,
        "blocks_ms_per_step": per_step,
        # Python's garbage collections during each mode's timed blocks: count and longest, per generation
        "gc_per_mode": {m: {f"gen{g}": {"count": len(v), "max_ms": round(max(v), 1) if v else 0.0,
                                        "total_ms": round(sum(v), 1)} for g, v in gens.items()}
                        for m, gens in gc_ms.items()}}
    return res


def _launches(torch: Any, loop: Loop, mode: str) -> int:
    """Device activities (kernels, copies, memsets) of one whole step under the profiler: the
    monitor's share is the difference, and with torchao's amaxes read back it does not grow with
    the number of casts."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    with source_off(loop.model) if mode.startswith("plain") else contextlib.nullcontext():
        loop.step(mode)  # outside the profiler: a flush or lazy work of the first step after a switch
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            loop.step(mode)
            torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


def part_diagnose(torch: Any, loop: Loop, steps: int) -> dict[str, Any]:
    """Where ``monitor.step``'s host time goes (cProfile, allocator counters), after a warm-up."""
    from bench._host_profile import profile_host

    for _ in range(3):
        loop.step("monitor")
    held: dict[str, Any] = {}

    def body() -> None:
        held["loss"] = loop.forward_backward()
        loop.opt.step()

    def call() -> None:
        loop.monitor.step(held["loss"])
        loop.opt.zero_grad(set_to_none=True)

    return {"ok": True, **profile_host(torch, call, steps=steps, before=body)}
