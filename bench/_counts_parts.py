"""``bench/gpu_counts.py parts``: a counted step's parts in real time (no profiler).

``parts`` times, without a profiler, TE's debug quantizers (construction and ``quantize``),
nvdlfw-inspect's dispatch and message logging, and fp8guard's feature and launches, in rounds that
interleave plain FP8, the debug path alone (fp8guard answering TE's debug questions itself, and
routed through nvdlfw-inspect as before the sixteenth session), counting, and counting through the
launch path before the seventh session (bench/_count_probe.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench._counts_modes import _Modes, _round_order
from bench._te_model import Shape


class _Timers:
    """Inclusive wall-clock time per wrapped function (perf_counter around each call)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._restore: list[tuple[Any, str, Any]] = []

    def timed(self, label: str, fn: Any) -> Any:
        total, calls = self.total, self.calls

        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                total[label] = total.get(label, 0.0) + time.perf_counter() - t0
                calls[label] = calls.get(label, 0) + 1

        return wrapper

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        real = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        self._restore.append((owner, attr, real))
        setattr(owner, attr, self.timed(label, real))

    def snapshot(self) -> dict[str, float]:
        return dict(self.total)

    def restore(self) -> None:
        for owner, attr, real in reversed(self._restore):
            setattr(owner, attr, real)
        self._restore.clear()


def parts(args: argparse.Namespace) -> dict[str, Any]:
    """Real (wall-clock) host time per step of each part of a counted step, with no profiler:
    TE's debug quantizers (construction: the plan queries; quantize: the cast and the inspection
    calls), nvdlfw-inspect's dispatch (``route_api``, features included), its message logging,
    and fp8guard's feature and launches; rounds interleave plain FP8, TE's debug path alone,
    counting with this session's launch path and with the one before it (same kernel, same key)."""
    modes_ = _Modes(args, "gpu_counts_parts")  # skips without CUDA, TE or FP8
    from nvdlfw_inspect.base import BaseNamespaceAPI
    from transformer_engine.debug.pytorch.debug_quantization import DebugQuantizer

    from fp8guard.agent.kernels import counts as kcounts

    torch, te_counts = modes_.torch, modes_.te_counts
    counter = modes_.src._inspect
    timers = _Timers()
    from bench._count_probe import legacy_count_cast_into

    new_count, legacy_count = modes_.real, legacy_count_cast_into
    timed_new = timers.timed("fp8guard count_cast_into (launch)", new_count)
    timed_legacy = timers.timed("fp8guard count_cast_into (launch)", legacy_count)

    def use(mode: str) -> None:
        if mode.startswith("counts_every_step"):
            modes_.use("counts_every_step")
            legacy = mode.endswith("legacy")
            te_counts.count_cast_into = timed_legacy if legacy else timed_new
            if legacy:
                counter._row = lambda i: counter.counts[i]  # HEAD's inspect indexed the buffer per call
            else:
                counter.__dict__.pop("_row", None)
        else:
            modes_.use(mode)
            counter.__dict__.pop("_row", None)

    modes = ["plain", "debug_path_only", "debug_path_only_routed", "counts_every_step", "counts_every_step_legacy"]
    for mode in modes:
        use(mode)
        for _ in range(args.warmup):
            modes_.step()
    torch.cuda.synchronize()
    cached_before = kcounts._LAUNCH.cached
    timers.wrap(DebugQuantizer, "__init__", "TE DebugQuantizer.__init__ (plan queries)")
    timers.wrap(DebugQuantizer, "quantize", "TE DebugQuantizer.quantize (cast + inspection calls)")
    timers.wrap(DebugQuantizer, "_call_inspect_tensor_api", "TE DebugQuantizer._call_inspect_tensor_api")
    timers.wrap(BaseNamespaceAPI, "route_api", "nvdlfw route_api (dispatch, features included)")
    # (below nvdlfw-inspect's module log_message, which fp8guard's session replaces: te_inspect.bind_namespace)
    from nvdlfw_inspect.utils import SingleMessageLogger

    timers._restore.append((SingleMessageLogger, "log_message_once", SingleMessageLogger.__dict__["log_message_once"]))
    SingleMessageLogger.log_message_once = timers.timed("nvdlfw log_message_once", SingleMessageLogger.log_message_once)
    timers.wrap(modes_.te_inspect, "_enabled", "fp8guard inspect_tensor_enabled (its answer, routed or direct)")
    timers.wrap(counter, "inspect", "fp8guard InspectCounts.inspect (feature, launch included)")
    per: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
    t_start = time.perf_counter()
    for r in range(args.rounds):
        for mode in _round_order(modes, r):
            use(mode)
            for _ in range(args.settle):
                modes_.step()
            for _ in range(args.block):
                torch.cuda.synchronize()
                before = timers.snapshot()
                t0 = time.perf_counter()
                modes_.step()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                after = timers.snapshot()
                row = per[mode]
                row.setdefault("wall_ms_synced", []).append((t2 - t0) * 1e3)
                row.setdefault("enqueue_ms", []).append((t1 - t0) * 1e3)
                for k in after:
                    row.setdefault(k, []).append((after[k] - before.get(k, 0.0)) * 1e3)
        if time.perf_counter() - t_start > args.budget_s:
            break
    timers.restore()
    use("plain")
    modes_.restore()
    counter.__dict__.pop("_row", None)
    calls_per_step = {k: v / max(1, sum(len(x.get("wall_ms_synced", [])) for x in per.values()))
                      for k, v in timers.calls.items()}
    summary = {m: {k: round(statistics.median(v), 3) for k, v in row.items()} for m, row in per.items()}
    spread = {m: {k: [round(min(v), 2), round(max(v), 2)] for k, v in row.items() if k in ("wall_ms_synced", "enqueue_ms")}
              for m, row in per.items()}
    modes_.monitor.close()
    shape = Shape(layers=args.layers)
    return {"bench": "gpu_counts_parts", "device": torch.cuda.get_device_name(), "params_M": modes_.m.params_m,
            "shape": {"layers": shape.layers, "hidden": shape.hidden, "seq": shape.seq, "batch": shape.batch},
            "rounds_done": r + 1, "block": args.block, "steps_per_mode": {m: len(row.get("wall_ms_synced", []))
                                                                         for m, row in per.items()},
            "median_ms_per_step": summary, "min_max_ms": spread,
            "calls_per_step_all_modes_mean": {k: round(v, 1) for k, v in calls_per_step.items()},
            "compiled_handles_before_after": [cached_before, kcounts._LAUNCH.cached],
            "seconds": round(time.perf_counter() - t_start, 1), "agent_log": modes_.records.messages[:10],
            "monitor_broken": bool(modes_.monitor._broken)}
