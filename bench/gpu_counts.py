"""Exact overflow/underflow counts of every FP8 GEMM operand on a real Transformer Engine model:
both kernel variants checked against TE's own statistics, operand by operand, then timed.

    python bench/gpu_counts.py verify --out DIR [--recipe current]   # exits 1 on any disagreement
    python bench/gpu_counts.py time --out DIR       # overhead every step / every 10th step
    python bench/gpu_counts.py kernels --out DIR    # the kernels alone on the model's 144 shapes (no TE)
    python bench/gpu_counts.py profile --out DIR    # a counted step under torch.profiler and cProfile
    python bench/gpu_counts.py parts --out DIR      # a counted step's parts in real time (no profiler)

Model: ``bench/_te_model.py`` (the 604M-parameter TE model of ``../shared/gpu/te_baseline.py``).
Counting goes through ``TESource(exact_counts="inspect")``: TE's tensor-inspection API hands
every quantized operand (LayerNorm outputs, MLP activations and gradients included) to
fp8guard's ``Fp8GuardCounts`` feature, whose Triton kernel adds the counts into a device buffer.

``verify`` first casts bench/_count_edges.py's inputs (float32-product ties at the underflow
boundary, -0, NaN, inf, subnormals under huge scales, the overflow threshold) with TE's own
``Float8Quantizer`` and holds both compiled variants to TE's formulas on TE's bytes. Then it
opens TE's debug session the way a user running TE's own features would, with three features on
the same tensors of every step: TE's ``LogFp8TensorStats``, fp8guard's ``Fp8GuardCounts`` (the
default variant), and a reference feature that computes, per operand, TE's own statistic
functions (``compute_fp8_delayed_scaling_overflows_num``, ``count_nonzero`` minus
``count_nonzero_fp8``) and each kernel variant (high-precision with the quantizer's scale,
FP8-bytes) as exact integers. Step 2 multiplies one weight by 64 in place, step 3 the loss by
4096. Every operand of every step must give the same four pairs and match LogFp8TensorStats'
percentages to float32 rounding; each disagreement is listed by module, tensor, GEMM role, pass,
dtype, FP8 format and recipe, and the run exits 1 with ``"ok": false``.

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

``profile`` runs plain FP8, the Monitor with counting off, TE's debug path alone and counting
every step, a few steps each under torch.profiler (GPU busy time, kernels by name, what the debug
path adds) and cProfile (host time per function and per package). ``parts`` times, without a
profiler, TE's debug quantizers (construction and ``quantize``), nvdlfw-inspect's dispatch and
message logging, and fp8guard's feature and launches, in rounds that interleave plain FP8, the
debug path alone, counting, and counting through the launch path before the seventh session
(bench/_count_probe.py). ``S=256 B=1`` (bench/_te_model.py's shape variables) gives a shape
where the GPU idles, so that the host's share shows alone.

Prints one JSON line (``{"skipped": ...}`` without CUDA, TE or FP8).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._te_model import Records, Shape, TEModel, require_te, skip

_TENSORS = ["activation", "weight", "gradient"]


def _write(out: str | None, name: str, result: dict[str, Any]) -> None:
    line = json.dumps(result)
    print(line, flush=True)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / name).write_text(line + "\n")


# -- verify -----------------------------------------------------------------------------------


def _recipe(name: str) -> Any:
    import transformer_engine.common.recipe as recipes

    if name == "current":
        return recipes.Float8CurrentScaling(fp8_format=recipes.Format.HYBRID)
    return recipes.DelayedScaling(fp8_format=recipes.Format.HYBRID, amax_history_len=1024, amax_compute_algo="max")


def te_cast_edges(torch: Any) -> dict[str, Any]:
    """bench/_count_edges.py's inputs cast by TE's own quantizer on the GPU; both compiled variants
    against TE's formulas on TE's bytes (ties, -0, NaN, inf, subnormals, thresholds)."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    from bench._count_edges import edge_cases
    from fp8guard.agent.fp8 import Fp8Format, count_from_cast
    from fp8guard.agent.kernels import count_cast_into

    rows, bad, errors = 0, [], []
    for case in edge_cases():
        if case["cast"] != "satfinite":
            continue  # TE's cast saturates: the non-saturating bytes exist only on the CPU side
        fmt = case["fmt"]
        x = case["x"].cuda()
        scale = torch.tensor([case["scale"]], dtype=torch.float32, device="cuda")
        try:
            quantizer = Float8Quantizer(scale=scale.clone(), amax=torch.zeros(1, device="cuda"),
                                        fp8_dtype=tex.DType.kFloat8E4M3 if fmt is Fp8Format.E4M3
                                        else tex.DType.kFloat8E5M2, rowwise=True, columnwise=False)
            q = quantizer(x)
        except Exception as exc:  # a shape or dtype TE's cast refuses: reported, not compared
            errors.append({"case": case["name"], "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        data = q._data.view(torch.uint8)
        te = count_from_cast(x, data, q._scale_inv, fmt).tolist()
        got = {"te": te}
        for variant, fp8_bytes in (("hp", None), ("bytes", data)):
            out = torch.zeros(2, dtype=torch.int64, device="cuda")
            count_cast_into(out, x, scale=scale, scale_inv=q._scale_inv, fmt=fmt, fp8_bytes=fp8_bytes)
            got[variant] = out.tolist()
        rows += 1
        if len({tuple(v) for v in got.values()}) > 1:
            bad.append({"case": case["name"], **got})
    return {"cases": rows, "disagreements": bad, "agree": not bad, "te_refused": errors[:10]}


def verify(args: argparse.Namespace) -> dict[str, Any]:
    torch, _ = require_te("gpu_counts_verify")
    import nvdlfw_inspect.api as debug_api
    from nvdlfw_inspect.logging import BaseLogger
    from nvdlfw_inspect.registry import Registry, api_method
    from transformer_engine.debug.features.utils.stats_computation import (
        compute_fp8_delayed_scaling_overflows_num,
        count_nonzero_fp8,
    )

    from bench._count_probe import ROLE
    from fp8guard.agent.fp8 import Fp8Format
    from fp8guard.agent.kernels import count_cast_into
    from fp8guard.agent.sources import te as te_source
    from fp8guard.agent.sources import te_inspect

    reference: dict[tuple[str, str], dict[str, Any]] = {}
    info: dict[tuple[str, str], dict[str, Any]] = {}
    formats: dict[tuple[str, str], Any] = {}
    """The source's layout format per operand (E5M2 for HYBRID's gradients): the default the
    feature itself uses when neither the quantizer nor the cast tensor names the format."""
    reference_on = [True]

    class TeExactReference:
        """On the same tensors: TE's own statistic functions, and each kernel variant, as exact
        int64 on the device."""

        def parse_config_and_api(self, config: dict[str, Any], **kwargs: Any) -> tuple[bool, None]:
            return bool(config.get("enabled")) and kwargs.get("tensor_name") in (None, *_TENSORS), None

        @api_method
        def inspect_tensor_enabled(self, config: dict[str, Any], layer_name: str, tensor_name: str,
                                   iteration: int) -> tuple[bool, int]:
            return True, iteration + 1

        @api_method
        def inspect_tensor(self, config: dict[str, Any], layer_name: str, tensor_name: str, iteration: int,
                           tp_group: Any, tensor: Any, rowwise_quantized_tensor: Any = None,
                           columnwise_quantized_tensor: Any = None, quantizer: Any = None, tp_size: int = 1) -> None:
            if not reference_on[0] or tensor is None:
                return
            q = rowwise_quantized_tensor
            key = (layer_name, tensor_name)
            data = q.get_data_tensors(rowwise_data=True, columnwise_data=False)
            over = compute_fp8_delayed_scaling_overflows_num(tensor, q)
            under = tensor.count_nonzero() - count_nonzero_fp8(data)
            pairs = {"te_functions": torch.stack((over.to(torch.int64), under.to(torch.int64)))}
            fmt = te_inspect._format_of(q, formats.get(key, Fp8Format.E4M3), quantizer)
            scale = getattr(quantizer, "scale", None)
            for variant, fp8_bytes, s in (("hp", None, scale), ("bytes", data, q._scale_inv)):
                if variant == "hp" and not isinstance(scale, torch.Tensor):
                    continue
                if variant == "bytes" and (data is None or data.numel() != tensor.numel()):
                    continue
                out = torch.zeros(2, dtype=torch.int64, device=tensor.device)
                count_cast_into(out, tensor.detach(), scale=s, scale_inv=q._scale_inv, fmt=fmt, fp8_bytes=fp8_bytes)
                pairs[variant] = out
            prev = reference.get(key)
            reference[key] = pairs if prev is None else {k: v + prev[k] for k, v in pairs.items() if k in prev}
            info[key] = {"numel": tensor.numel(), "dtype": str(tensor.dtype).replace("torch.", ""), "fp8": fmt.value,
                         "quantizer": type(quantizer).__name__}

    class Capture(BaseLogger):  # type: ignore[misc]
        def __init__(self) -> None:
            self.values: dict[tuple[str, int], float] = {}

        def log_scalar(self, name: str, value: float | int, iteration: int, **kwargs: Any) -> None:
            self.values[(name, int(iteration))] = float(value)

    edges = te_cast_edges(torch)
    te_inspect.register_feature()
    Registry.register_feature(namespace="transformer_engine")(TeExactReference)
    capture = Capture()
    import transformer_engine.debug.features as features_pkg

    # TE's LogFp8TensorStats: its overflow statistic is a delayed-scaling one; under current
    # scaling only the underflows are compared with it (the exact comparisons cover both).
    stats = ["underflows%", "overflows%"] if args.recipe == "delayed" else ["underflows%"]
    config = {"verify": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": {
        "LogFp8TensorStats": {"enabled": True, "tensors": _TENSORS, "stats": stats, "freq": 1},
        te_inspect.FEATURE_NAME: {"enabled": True, "tensors": _TENSORS},
        "TeExactReference": {"enabled": True, "tensors": _TENSORS}}}}
    debug_api.initialize(config_file=config, feature_dirs=[str(Path(features_pkg.__file__).parent)],
                         statistics_logger=capture, log_dir=tempfile.mkdtemp())
    m = TEModel(Shape(layers=args.layers))
    m.recipe = _recipe(args.recipe)
    m.step()  # warm-up: TE creates its FP8 state (all features see iteration 0)
    debug_api.step()
    src = te_source.discover(m.model, required=True)
    assert isinstance(src, te_source.TESource)
    src.prepare_step(1, 1)
    names = {(layer, tensor): target.index for (layer, tensor), target in src._inspect.targets.items()}
    formats.update({key: target.fmt for key, target in src._inspect.targets.items()})
    n = len(src.tensors())
    steps = []
    mismatches: list[dict[str, Any]] = []
    variants_seen: dict[str, int] = {}
    for it in range(1, args.steps + 1):
        reference.clear()
        src.arm_counts(True)
        if it == 2:
            with torch.no_grad():
                m.model[5].self_attention.proj.weight.mul_(64.0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m.forward_backward(loss_scale=4096.0 if it == 3 else 1.0)
        torch.cuda.synchronize()
        step_ms = (time.perf_counter() - t0) * 1e3
        m.opt.zero_grad(set_to_none=True)  # no update: the next step sees the same weights
        ours = torch.zeros(2, n, dtype=torch.int64, device="cuda")
        src.read_counts(ours)
        src.arm_counts(False)
        debug_api.step()  # LogFp8TensorStats logs iteration `it`
        ours_h = ours.cpu()
        exact = pct_ok = compared = 0
        worst_pct = 0.0
        totals = [0, 0]
        nonzero_over = 0
        for key, col in names.items():
            role, direction = ROLE.get(key[1], (key[1], "?"))
            label = {"module": key[0], "tensor": key[1], "gemm_role": role, "pass": direction,
                     "recipe": args.recipe, **info.get(key, {})}
            if key not in reference:
                mismatches.append({"step": it, **label, "problem": "not inspected by TE this step"})
                continue
            results = {"fp8guard_feature": [int(ours_h[0, col]), int(ours_h[1, col])],
                       **{k: [int(v) for v in t.cpu()] for k, t in reference[key].items()}}
            for k in results:
                variants_seen[k] = variants_seen.get(k, 0) + 1
            mine = results["fp8guard_feature"]
            compared += 1
            totals[0] += mine[0]
            totals[1] += mine[1]
            nonzero_over += mine[0] > 0
            if len({tuple(v) for v in results.values()}) == 1:
                exact += 1
            else:
                mismatches.append({"step": it, **label, **results})
            ok = True
            for k, stat in ((0, "overflows%"), (1, "underflows%")):
                if stat not in stats:
                    continue
                logged = capture.values.get((f"{key[0]}_{key[1]}_{stat}", it))
                if logged is None:
                    ok = False
                    continue
                mine_pct = 100.0 * mine[k] / info[key]["numel"]
                diff = abs(mine_pct - logged)
                worst_pct = max(worst_pct, diff / max(abs(logged), 1e-30) if logged else diff)
                ok &= diff <= 2e-6 * max(abs(logged), 1e-12) + 1e-12
            pct_ok += ok
            if not ok:
                mismatches.append({"step": it, **label, "fp8guard": mine, "problem": "LogFp8TensorStats differs",
                                   "te_logged_pct": [capture.values.get((f"{key[0]}_{key[1]}_{s}", it))
                                                     for s in stats]})
        steps.append({"step": it, "operands_compared": compared, "all_variants_equal_te_functions": exact,
                      "equal_to_logfp8tensorstats": pct_ok, "worst_rel_pct_diff": worst_pct,
                      "overflows": totals[0], "underflows": totals[1], "operands_with_overflows": nonzero_over,
                      "step_ms_three_features": round(step_ms, 1)})
    counted = sum(src.counted)
    # TE's LogFp8TensorStats alone (fp8guard's and the reference feature idle): its cost per step.
    te_only_ms = []
    reference_on[0] = False
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m.forward_backward()
        debug_api.step()
        torch.cuda.synchronize()
        te_only_ms.append((time.perf_counter() - t0) * 1e3)
        m.opt.zero_grad(set_to_none=True)
    all_ok = all(s["all_variants_equal_te_functions"] == s["operands_compared"] == s["equal_to_logfp8tensorstats"]
                 == len(names) for s in steps) and edges["agree"]
    return {"bench": "gpu_counts_verify", "ok": all_ok, "recipe": args.recipe, "device": torch.cuda.get_device_name(),
            "params_M": m.params_m, "columns": n, "counted_columns": counted, "targets": len(names),
            "compared_per_operand": variants_seen, "default_variant": src._inspect.variant, "steps": steps,
            "mismatches": mismatches[:60], "mismatch_count": len(mismatches), "te_cast_edge_cases": edges,
            "te_logfp8tensorstats_step_ms": [round(v, 1) for v in te_only_ms],
            "injections": {"step 2": "layer5.self_attention.proj.weight *= 64", "step 3": "loss * 4096"}}


# -- time -------------------------------------------------------------------------------------


class _Modes:
    """The TE model with fp8guard attached, and the switch between the modes ``time`` and
    ``profile`` compare: plain FP8 (TE's debug mode off), the Monitor with counting off, counting
    every 10th step (all modules at once, or staggered: ``MonitorConfig.count_stagger``), counting
every step, and TE's debug path alone (counting armed, fp8guard's
    kernel skipped)."""

    def __init__(self, args: argparse.Namespace, bench: str) -> None:
        torch, _ = require_te(bench)
        import logging

        from transformer_engine.debug.pytorch.debug_state import TEDebugState

        from fp8guard.agent import Monitor, MonitorConfig, NullTransport
        from fp8guard.agent.sources import te_inspect

        self.torch, self.state, self.te_inspect = torch, TEDebugState, te_inspect
        self.records = Records()
        logging.getLogger("fp8guard").addHandler(self.records)
        self.m = TEModel(Shape(layers=args.layers))
        self.m.step()
        torch.cuda.synchronize()
        self.monitor = Monitor(MonitorConfig(url=None, sources=["te"], flush_interval_steps=50, count_interval_steps=0),
                               transport=NullTransport()).attach(self.m.model, self.m.opt)
        self.src = self.monitor.sources[0]
        self.monitor.set_count_interval(1)  # opens TE's debug session (fp8guard owns it)
        self.real = te_inspect.count_cast_into
        self.mode = "plain"

    @staticmethod
    def _skip_kernel(out: Any, x: Any, **kw: Any) -> None:
        return None

    def use(self, mode: str) -> None:
        self.mode = mode
        self.te_inspect.count_cast_into = self._skip_kernel if mode == "debug_path_only" else self.real
        if mode == "plain":
            self.state.debug_enabled = False
            return
        self.state.debug_enabled = True
        self.monitor.config.count_stagger = mode == "counts_every_10_staggered"
        self.monitor.set_count_interval({"agent_no_counts": 0, "counts_every_10": 10, "counts_every_10_staggered": 10,
                                         "counts_every_step": 1, "debug_path_only": 1}[mode])

    def step(self) -> None:
        self.m.step(None if self.mode == "plain" else self.monitor)

    def restore(self) -> None:
        self.te_inspect.count_cast_into = self.real


_TIME_MODES = ("plain", "agent_no_counts", "counts_every_10", "counts_every_10_staggered", "counts_every_step",
               "debug_path_only")


def time_modes(args: argparse.Namespace) -> dict[str, Any]:
    modes_ = _Modes(args, "gpu_counts_time")
    torch, m, monitor, src, records = modes_.torch, modes_.m, modes_.monitor, modes_.src, modes_.records
    from fp8guard.agent.sources import te_inspect

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
    t_start = time.perf_counter()
    for r in range(args.rounds):
        for mode in _round_order(modes, r):
            use(mode)
            # A cadence change makes every TE layer re-ask the debug API once (host work that a
            # run with a fixed cadence never repeats): settle untimed first.
            # Staggered counting restarts its schedule at the switch and counts nothing until its
            # first whole window: settle through one, so the timed block is the steady state.
            for _ in range(max(args.settle, 10) if mode == "counts_every_10_staggered" else args.settle):
                m.step(None if mode == "plain" else monitor)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.block):
                h0 = time.perf_counter()
                m.step(None if mode == "plain" else monitor)
                host[mode].append((time.perf_counter() - h0) * 1e3)
            torch.cuda.synchronize()
            per_step[mode].append((time.perf_counter() - t0) / args.block * 1e3)
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
                           te_inspect._format_of(quantized, counter.targets[(layer_name, tensor_name)].fmt, quantizer)))

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
        "targets": {"counts_every_step": 1.15, "counts_every_10": 1.01, "counts_every_10_staggered": 1.01},
        "ok": probe["compare"]["agree"] and probe["compare"]["operands"] > 0 and not any(
            m.startswith("ERROR") for m in records.messages),  # an error switched counting off
        "default_variant": src._inspect.variant, "probe": probe, "timed_s": round(timed_s, 1), "agent_log": records.messages[:10],
        "monitor_broken": bool(monitor._broken),
    }


# -- profile ----------------------------------------------------------------------------------

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
    import nvdlfw_inspect.api as debug_api
    from nvdlfw_inspect.base import BaseNamespaceAPI
    from transformer_engine.debug.pytorch.debug_quantization import DebugQuantizer

    from fp8guard.agent.kernels import counts as kcounts

    torch, te_inspect = modes_.torch, modes_.te_inspect
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
            te_inspect.count_cast_into = timed_legacy if legacy else timed_new
            if legacy:
                counter._row = lambda i: counter.counts[i]  # HEAD's inspect indexed the buffer per call
            else:
                counter.__dict__.pop("_row", None)
        else:
            modes_.use(mode)
            counter.__dict__.pop("_row", None)

    modes = ["plain", "debug_path_only", "counts_every_step", "counts_every_step_legacy"]
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
    timers.wrap(debug_api, "log_message", "nvdlfw log_message")
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


# -- kernels ----------------------------------------------------------------------------------


def kernel_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Both variants on synthetic operands of the model's 144 shapes (no TE needed): agreement
    with TE's formulas, GPU time and host enqueue cost at the default launch shape, then a sweep
    of launch shapes (bench/_count_probe.py's SWEEP) replayed from CUDA graphs."""
    try:
        import torch
    except ImportError as exc:
        skip("gpu_counts_kernels", f"torch not importable: {exc}")
    if not torch.cuda.is_available():
        skip("gpu_counts_kernels", "needs a CUDA GPU (torch.cuda.is_available() is False)")
    from bench._count_probe import ceiling, compare, launch_path_ab, sweep, synthetic_operands, timing
    from fp8guard.agent.kernels import triton_available

    if not triton_available(torch.device("cuda")):
        skip("gpu_counts_kernels", "needs Triton on the GPU")
    t0 = time.perf_counter()
    ops = synthetic_operands(layers=args.layers)
    cmp = compare(ops)
    result = {"bench": "gpu_counts_kernels", "device": torch.cuda.get_device_name(), "ok": cmp["agree"],
              "compare": cmp, **timing(ops), "launch_path_ab": launch_path_ab(ops), "sweep": sweep(ops),
              "ceiling": ceiling(ops)}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def _round_order(modes: list[str], r: int) -> list[str]:
    """Round ``r``'s order of the modes: rotated by one each round, reversed every other round,
    so that no mode always follows the same one (its warm-up or cool-down would bias it)."""
    order = modes[r % len(modes):] + modes[:r % len(modes)]
    return order[::-1] if r % 2 else order


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["verify", "time", "kernels", "profile", "parts"])
    parser.add_argument("--recipe", choices=["delayed", "current"], default="delayed",
                        help="verify: DelayedScaling or Float8CurrentScaling (HYBRID)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=4, help="verify: counted steps compared")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--settle", type=int, default=2, help="time: untimed steps after each mode switch")
    parser.add_argument("--profile-steps", type=int, default=3, help="profile: steps per mode per profiler")
    parser.add_argument("--trace", action="store_true", help="profile: write the counted steps' chrome trace")
    parser.add_argument("--tag", default="", help="time, profile, parts: suffix of the result file's name")
    parser.add_argument("--modes", default=",".join(_TIME_MODES),
                        help="time: the modes compared, comma-separated (plain is always timed)")
    parser.add_argument("--budget-s", type=float, default=120.0, help="parts: stop starting rounds after this")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.what == "verify":
        result = verify(args)
        _write(args.out, f"gpu_counts_verify{'' if args.recipe == 'delayed' else '_' + args.recipe}.json", result)
    elif args.what == "kernels":
        result = kernel_sweep(args)
        _write(args.out, "gpu_counts_kernels.json", result)
    elif args.what == "parts":
        result = parts(args)
        _write(args.out, f"gpu_counts_parts{args.tag}.json", result)
    elif args.what == "profile":
        result = profile_modes(args)
        _write(args.out, f"gpu_counts_profile{args.tag}.json", result)
    else:
        result = time_modes(args)
        _write(args.out, f"gpu_counts_time{args.tag}.json", result)
    if result.get("ok") is False:
        sys.exit(1)  # a disagreement between the variants or with TE: named in the JSON


if __name__ == "__main__":
    main()
