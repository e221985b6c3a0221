"""``bench/gpu_counts.py profile``: where a counted step's time goes, under profilers.

``profile`` runs plain FP8, the Monitor with counting off, TE's debug path alone and counting
every step, a few steps each under torch.profiler (GPU busy time, kernels by name, what the debug
path adds) and cProfile (host time per function and per package).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench._counts_modes import _Modes
from bench._te_model import Shape

_CATEGORIES = (
    ("nvdlfw_inspect (debug API dispatch)", ("nvdlfw_inspect",)),
    ("TE debug quantizer", ("transformer_engine/debug/",)),
    ("fp8guard agent", ("fp8guard/", "/agent/")),
    ("triton launcher", ("triton/",)),
    ("TE modules and ops", ("transformer_engine/",)),
    ("torch", ("torch/",)),
)
_KEY_FUNCTIONS = ("DebugQuantizer.__init__", "DebugQuantizer.quantize", "route_api", "_get_debug_quantizers",
                  "no_debug_features_active", "log_message", "inspect_tensor", "InspectCounts.inspect",
                  "count_cast_into", "_launch_count", "CompiledLaunch.__call__", "Monitor.step", "is_debug_iter",
                  "_call_inspect_tensor_api", "get_enabled_look_at_tensors", "get_tensors_plan",
                  "log_messages_about_plans", "save_call_details", "get_config_for_layer", "forward_backward",
                  "backward", "_forward", "forward")


def _category(filename: str) -> str:
    f = filename.replace("\\", "/")
    if f.startswith("~") or f.startswith("<"):
        return "C builtins"
    for name, keys in _CATEGORIES:
        if any(k in f for k in keys):
            return name
    return "other"


def _pstats_summary(prof: Any, steps: int) -> dict[str, Any]:
    """Own time per category (per step, ms), the top functions by own and cumulative time, and
    the cumulative time of the functions that name the debug path's parts."""
    import pstats

    st = pstats.Stats(prof)
    raw = st.stats  # type: ignore[attr-defined]
    cats: dict[str, float] = {}
    rows = []
    key_cum: dict[str, float] = {}
    key_calls: dict[str, int] = {}
    builtins_by: dict[str, float] = {}
    total = 0.0
    for (filename, line, func), (_cc, nc, tt, ct, callers) in raw.items():
        cat = _category(filename)
        if cat == "C builtins" and callers:
            # a C function's own time goes to its callers' packages (pstats keeps it per caller)
            for (cfile, _cl, _cf), caller_stats in callers.items():
                ccat = _category(cfile)
                share = caller_stats[2] if isinstance(caller_stats, tuple) else 0.0
                cats[ccat] = cats.get(ccat, 0.0) + share
                builtins_by[ccat] = builtins_by.get(ccat, 0.0) + share
        else:
            cats[cat] = cats.get(cat, 0.0) + tt
        total += tt
        short = "/".join(filename.replace("\\", "/").split("/")[-3:])
        qual = func
        rows.append({"fn": f"{short}:{line}({func})", "calls": nc, "own_ms": tt, "cum_ms": ct, "cat": cat})
        for k in _KEY_FUNCTIONS:
            name = k.split(".")[-1]
            cls = k.split(".")[0] if "." in k else None
            if qual == name and (cls is None or cls.lower() in short.lower() or _defines(filename, line, cls)):
                # recursive entries: the outermost cumulative time (pstats already folds recursion)
                key_cum[k] = key_cum.get(k, 0.0) + ct
                key_calls[k] = key_calls.get(k, 0) + nc
    per = 1e3 / steps
    top_own = sorted(rows, key=lambda r: -r["own_ms"])[:45]
    top_cum = sorted(rows, key=lambda r: -r["cum_ms"])[:45]
    fmt = lambda r: {**r, "own_ms": round(r["own_ms"] * per, 3), "cum_ms": round(r["cum_ms"] * per, 3),  # noqa: E731
                     "calls": round(r["calls"] / steps, 1)}
    return {"profiled_steps": steps, "own_ms_per_step_total": round(total * per, 2),
            "own_ms_per_step_by_category": {k: round(v * per, 2) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "of_which_c_functions_by_caller_category": {k: round(v * per, 2) for k, v in
                                                        sorted(builtins_by.items(), key=lambda kv: -kv[1])},
            "key_functions_cum_ms_per_step": {k: round(v * per, 3) for k, v in sorted(key_cum.items(), key=lambda kv: -kv[1])},
            "key_functions_calls_per_step": {k: round(v / steps, 1) for k, v in key_calls.items()},
            "top_own": [fmt(r) for r in top_own], "top_cum": [fmt(r) for r in top_cum]}


_SOURCE_CACHE: dict[str, list[str]] = {}


def _defines(filename: str, line: int, cls: str) -> bool:
    """Whether the function at filename:line sits in class ``cls`` (the nearest class line above)."""
    try:
        lines = _SOURCE_CACHE.setdefault(filename, Path(filename).read_text().splitlines())
    except OSError:
        return False
    for i in range(min(line, len(lines)) - 1, -1, -1):
        text = lines[i]
        if text.startswith("class "):
            return text[6:].split("(")[0].split(":")[0].strip() == cls
    return False


def _kernel_summary(prof: Any, steps: int) -> dict[str, Any]:
    """GPU kernels of the profiled steps: busy time (the union of kernel intervals) and the
    kernels' total by name, per step."""
    events = [e for e in prof.events() if getattr(e, "device_type", None) is not None
              and str(e.device_type).endswith("CUDA") and e.device_resource_id is not None]
    kern = []
    by_name: dict[str, list[float]] = {}
    for e in events:
        start = e.time_range.start
        end = e.time_range.end
        kern.append((start, end))
        d = by_name.setdefault(e.name[:90], [0.0, 0])
        d[0] += (end - start)
        d[1] += 1
    kern.sort()
    busy = 0.0
    cur_s = cur_e = None
    for s_, e_ in kern:
        if cur_e is None or s_ > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s_, e_
        else:
            cur_e = max(cur_e, e_)
    if cur_e is not None:
        busy += cur_e - cur_s
    span = (kern[-1][1] - kern[0][0]) if kern else 0.0
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:40]
    return {"gpu_busy_ms_per_step": round(busy / 1e3 / steps, 2), "gpu_span_ms_per_step": round(span / 1e3 / steps, 2),
            "kernels_per_step": round(len(kern) / steps, 1),
            "kernel_ms_per_step_total": round(sum(v[0] for v in by_name.values()) / 1e3 / steps, 2),
            "by_name": {k: {"ms_per_step": round(v[0] / 1e3 / steps, 3), "calls_per_step": round(v[1] / steps, 1)}
                        for k, v in top}}


def profile_modes(args: argparse.Namespace) -> dict[str, Any]:
    """Where a counted step's time goes. Per mode (plain, agent_no_counts, debug_path_only,
    counts_every_step): synchronised wall time and host enqueue time per step; torch.profiler over
    ``--profile-steps`` steps (GPU busy time, kernels by name: what the debug path adds on the
    GPU); cProfile over as many (host time per Python function and per package: TE's debug
    quantizer, nvdlfw-inspect's dispatch, fp8guard, Triton's launcher, TE's modules, torch)."""
    import cProfile

    modes_ = _Modes(args, "gpu_counts_profile")
    torch = modes_.torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    modes = ["plain", "agent_no_counts", "debug_path_only", "counts_every_step"]
    for mode in modes:
        modes_.use(mode)
        for _ in range(args.warmup):
            modes_.step()
    torch.cuda.synchronize()
    out: dict[str, Any] = {}
    trace_written = None
    for mode in modes:
        modes_.use(mode)
        for _ in range(args.settle):
            modes_.step()
        torch.cuda.synchronize()
        wall, enqueue = [], []
        for _ in range(args.profile_steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            modes_.step()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            enqueue.append((t1 - t0) * 1e3)
            wall.append((t2 - t0) * 1e3)
        # back-to-back (unsynchronised) steps, as the time bench runs them
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.profile_steps):
            modes_.step()
        torch.cuda.synchronize()
        b2b = (time.perf_counter() - t0) / args.profile_steps * 1e3
        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
            for _ in range(args.profile_steps):
                modes_.step()
            torch.cuda.synchronize()
        kernels = _kernel_summary(tp, args.profile_steps)
        if args.out and mode == "counts_every_step" and args.trace:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            trace_written = str(Path(args.out) / "gpu_counts_profile.trace.json")
            tp.export_chrome_trace(trace_written)
        del tp
        cp = cProfile.Profile()
        torch.cuda.synchronize()
        cp.enable()
        for _ in range(args.profile_steps):
            modes_.step()
        torch.cuda.synchronize()
        cp.disable()
        out[mode] = {"wall_ms_synced": [round(v, 2) for v in wall], "enqueue_ms": [round(v, 2) for v in enqueue],
                     "wall_ms_synced_median": round(statistics.median(wall), 2),
                     "enqueue_ms_median": round(statistics.median(enqueue), 2),
                     "back_to_back_ms_per_step": round(b2b, 2), "gpu": kernels,
                     "host": _pstats_summary(cp, args.profile_steps)}
        print(json.dumps({"mode": mode, "wall": out[mode]["wall_ms_synced_median"],
                          "enqueue": out[mode]["enqueue_ms_median"], "b2b": out[mode]["back_to_back_ms_per_step"],
                          "gpu_busy": kernels["gpu_busy_ms_per_step"],
                          "cats": out[mode]["host"]["own_ms_per_step_by_category"]}), flush=True)
    modes_.restore()
    # what the debug path adds on the GPU: kernels by name, counted step minus plain
    plain_k = out["plain"]["gpu"]["by_name"]
    added = {}
    for mode in ("debug_path_only", "counts_every_step"):
        diff = {}
        for k, v in out[mode]["gpu"]["by_name"].items():
            d = v["ms_per_step"] - plain_k.get(k, {}).get("ms_per_step", 0.0)
            if abs(d) >= 0.05:
                diff[k] = round(d, 3)
        added[mode] = dict(sorted(diff.items(), key=lambda kv: -abs(kv[1])))
    modes_.monitor.close()
    shape = Shape(layers=args.layers)
    return {"bench": "gpu_counts_profile", "device": modes_.torch.cuda.get_device_name(), "params_M": modes_.m.params_m,
            "shape": {"layers": shape.layers, "hidden": shape.hidden, "seq": shape.seq, "batch": shape.batch},
            "profile_steps": args.profile_steps, "modes": out, "gpu_kernels_added_vs_plain_ms_per_step": added,
            "trace": trace_written, "agent_log": modes_.records.messages[:10],
            "monitor_broken": bool(modes_.monitor._broken)}
