"""``bench/gpu_counts.py time``: the overhead of counting, every step and every 10th step, side by
side with plain FP8 in one process.

``time`` lets fp8guard open the session (the normal use) and runs, in rotating order, blocks of
``--block`` steps of: plain FP8 (TE's debug mode off), the Monitor with counting off, counting
every 10th step (all modules at once, or staggered: ``MonitorConfig.count_stagger``), counting
every step, and TE's debug path alone (counting armed, fp8guard's
kernel skipped): the difference between the last two is the kernel's share. Each block is
preceded by ``--settle`` untimed steps (a cadence change makes TE's layers re-ask the debug API
once). The host time of each step is recorded too. Then the operands of one counted step are
copied as TE hands them over and both variants are compared on them (named disagreements),
timed eagerly and from a CUDA graph, with the bytes each reads and the host time per launch
through Triton's JIT dispatch and through the cached compiled-kernel handle
(bench/_count_probe.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench._counts_modes import _TIME_MODES, _Modes, _round_order
from bench._paired import COUNTS_EVERY_10, COUNTS_EVERY_STEP, MONITOR, paired_ratios


def target_ratio(mode: str) -> float | None:
    """The issue's target for a mode's step time over plain FP8 (None: a mode for diagnosis)."""
    if mode.startswith("counts_every_step"):
        return COUNTS_EVERY_STEP
    if mode.startswith("counts_every_10"):
        return COUNTS_EVERY_10
    return MONITOR if mode == "agent_no_counts" else None


def settle_steps(mode: str, settle: int) -> int:
    """Untimed steps after switching to ``mode``. A cadence change makes every TE layer re-ask the
    debug API once (host work that a run with a fixed cadence never repeats). Staggered counting,
    batched or not, restarts its schedule at the switch and counts nothing until its first whole
    window: it settles through one, so the timed block is the steady state. (Until the fifteenth
    session the batched staggered mode settled only ``settle`` steps: whenever the mode before it
    in the round had another schedule, up to 7 of its 10 timed steps (2.8 on average) counted
    nothing, so its every-10th figures of the fourteenth and fifteenth sessions are low.)"""
    return max(settle, 10) if mode.startswith("counts_every_10_staggered") else settle


def time_modes(args: argparse.Namespace) -> dict[str, Any]:
    modes_ = _Modes(args, "gpu_counts_time")
    torch, m, monitor, src, records = modes_.torch, modes_.m, modes_.monitor, modes_.src, modes_.records
    from fp8guard.agent.sources import te_counts

    def use(mode: str) -> None:
        modes_.use(mode)

    modes = [m for m in _TIME_MODES if m in args.modes.split(",")]
    if "plain" not in modes:
        modes.insert(0, "plain")  # the ratios' denominator
    for mode in modes:  # warm-up: Triton compiles its kernel variants, TE builds its debug path
        use(mode)
        for _ in range(args.warmup):
            m.step(None if mode == "plain" else monitor)
    torch.cuda.synchronize()
    per_step: dict[str, list[float]] = {k: [] for k in modes}
    host: dict[str, list[float]] = {k: [] for k in modes}
    # operands each timed block counted (the feature's host tally): a steady block of a staggered
    # mode counts every operand once, of every step's mode ten times that
    counter = getattr(src, "_inspect", None)
    counted: dict[str, list[int]] = {k: [] for k in modes}
    t_start = time.perf_counter()
    for r in range(args.rounds):
        for mode in _round_order(modes, r):
            use(mode)
            for _ in range(settle_steps(mode, args.settle)):
                m.step(None if mode == "plain" else monitor)
            torch.cuda.synchronize()
            calls = counter.calls if counter is not None else 0
            t0 = time.perf_counter()
            for _ in range(args.block):
                h0 = time.perf_counter()
                m.step(None if mode == "plain" else monitor)
                host[mode].append((time.perf_counter() - h0) * 1e3)
            torch.cuda.synchronize()
            per_step[mode].append((time.perf_counter() - t0) / args.block * 1e3)
            counted[mode].append((counter.calls - calls) if counter is not None else 0)
    timed_s = time.perf_counter() - t_start
    modes_.restore()
    med = {k: statistics.median(v) for k, v in per_step.items()}

    # -- kernels alone: one counted step's operands, copied as TE handed them over -------------
    # Copies of the values, bytes and scales at inspect time: after the step the optimizer
    # updates the weights in place and TE the scales (a replay on the live tensors would count
    # different casts; the first probe of this bench compared such a replay, plus a buffer the
    # host-timing loop had counted into twice, and reported a disagreement that was neither
    # variant's).
    from bench._count_probe import Operand, compare, timing

    use("counts_every_step")
    ops: list[Operand] = []
    counter = src._inspect
    real_inspect = counter.inspect

    def copying(layer_name: str, tensor_name: str, tensor: Any, quantized: Any, quantizer: Any,
                iteration: int | None = None) -> None:
        real_inspect(layer_name, tensor_name, tensor, quantized, quantizer, iteration)
        scale_inv = getattr(quantized, "_scale_inv", None)
        if tensor is None or not isinstance(scale_inv, torch.Tensor) or (layer_name, tensor_name) not in counter.targets:
            return
        data = getattr(quantized, "_data", None)
        scale = getattr(quantizer, "scale", None)
        ops.append(Operand(layer_name, tensor_name, type(m.recipe).__name__, tensor.detach().clone(),
                           data.view(torch.uint8).clone() if isinstance(data, torch.Tensor)
                           and data.numel() == tensor.numel() else None,
                           scale.clone() if isinstance(scale, torch.Tensor) else None, scale_inv.clone(),
                           te_counts._format_of(quantized, counter.targets[(layer_name, tensor_name)].fmt, quantizer)))

    counter.inspect = copying  # type: ignore[method-assign]
    try:
        m.step(monitor)
    finally:
        counter.inspect = real_inspect  # type: ignore[method-assign]
    torch.cuda.synchronize()
    probe = {"compare": compare(ops), **timing(ops)}
    ops.clear()
    monitor.close()
    plain = med["plain"]
    return {
        "bench": "gpu_counts_time", "device": torch.cuda.get_device_name(), "params_M": m.params_m,
        "columns": len(src.tensors()), "counted_columns": sum(src.counted), "rounds": args.rounds,
        "block": args.block, "settle": args.settle, "ms_per_step": {k: round(v, 3) for k, v in med.items()},
        "ratio_vs_plain": {k: round(v / plain, 5) for k, v in med.items()},
        "ratio_vs_agent_no_counts": {k: round(v / med["agent_no_counts"], 5) for k, v in med.items()}
        if "agent_no_counts" in med else None,
        "host_ms_per_step_median": {k: round(statistics.median(v), 2) for k, v in host.items()},
        "block_ms_min_max": {k: [round(min(v), 3), round(max(v), 3)] for k, v in per_step.items()},
        "operands_counted_per_block": counted,
        "targets": {k: target_ratio(k) for k in per_step if target_ratio(k) is not None},
        # each round's block over the same round's plain block: median, its interval, the verdict
        "paired_vs_plain": {k: paired_ratios(v, per_step["plain"], target_ratio(k))
                            for k, v in per_step.items() if k != "plain"},
        "ok": probe["compare"]["agree"] and probe["compare"]["operands"] > 0 and not any(
            m.startswith("ERROR") for m in records.messages),  # an error switched counting off
        "default_variant": src._inspect.variant, "probe": probe, "timed_s": round(timed_s, 1), "agent_log": records.messages[:10],
        "monitor_broken": bool(monitor._broken),
    }
