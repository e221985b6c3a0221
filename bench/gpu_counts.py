"""Exact overflow/underflow counts of every FP8 GEMM operand on a real Transformer Engine model:
checked against TE's own statistics, then timed side by side in one run.

    python bench/gpu_counts.py verify --out DIR     # counts == TE's LogFp8TensorStats
    python bench/gpu_counts.py time --out DIR       # overhead every step / every 10th step

Model: ``bench/_te_model.py`` (the 604M-parameter TE model of ``../shared/gpu/te_baseline.py``).
Counting goes through ``TESource(exact_counts="inspect")``: TE's tensor-inspection API hands
every quantized operand (LayerNorm outputs, MLP activations and gradients included) to
fp8guard's ``Fp8GuardCounts`` feature, whose fused Triton kernel adds the counts into a device
buffer.

``verify`` opens TE's debug session the way a user running TE's own features would, with three
features on the same tensors of every step: TE's ``LogFp8TensorStats`` (``underflows%``,
``overflows%``), fp8guard's ``Fp8GuardCounts`` and a reference feature that applies TE's own
statistic functions (``compute_fp8_delayed_scaling_overflows_num``, ``count_nonzero`` minus
``count_nonzero_fp8``) as exact integers. Step 2 multiplies one weight by 64 in place (forward
overflows on that weight) and step 3 multiplies the loss by 4096 (gradient overflows), so both
counts are exercised. Every operand of every step must match: exactly against the reference,
and to float32 rounding against LogFp8TensorStats' percentages.

``time`` lets fp8guard open the session (the normal use) and runs, in rotating order, blocks of
``--block`` steps of: plain FP8 (TE's debug mode off), the Monitor with counting off, counting
every 10th step, counting every step, and TE's debug path alone (counting armed, fp8guard's
kernel skipped): the difference between the last two is the kernel's share. Each block is
preceded by ``--settle`` untimed steps (a cadence change makes TE's layers re-ask the debug API
once). The host time of each step is recorded too: a step whose host time exceeds its GPU time
is host-bound. Then the 144 counting-kernel calls of one counted step are captured and replayed
back to back (GPU-bound, CUDA events around the whole replay), in the FP8-bytes variant and the
high-precision variant (which must give the same counts), with the bytes each one reads.

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

from bench._te_model import Records, Shape, TEModel, require_te

_TENSORS = ["activation", "weight", "gradient"]


def _write(out: str | None, name: str, result: dict[str, Any]) -> None:
    line = json.dumps(result)
    print(line, flush=True)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / name).write_text(line + "\n")


# -- verify -----------------------------------------------------------------------------------


def verify(args: argparse.Namespace) -> dict[str, Any]:
    torch, _ = require_te("gpu_counts_verify")
    import nvdlfw_inspect.api as debug_api
    from nvdlfw_inspect.logging import BaseLogger
    from nvdlfw_inspect.registry import Registry, api_method
    from transformer_engine.debug.features.utils.stats_computation import (
        compute_fp8_delayed_scaling_overflows_num,
        count_nonzero_fp8,
    )

    from fp8guard.agent.sources import te as te_source
    from fp8guard.agent.sources import te_inspect

    reference: dict[tuple[str, str], Any] = {}
    numel: dict[tuple[str, str], int] = {}
    reference_on = [True]

    class TeExactReference:
        """TE's own statistic functions on the same tensors, kept as exact int64 on the device."""

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
            if not reference_on[0]:
                return
            q = rowwise_quantized_tensor
            over = compute_fp8_delayed_scaling_overflows_num(tensor, q)
            under = tensor.count_nonzero() - count_nonzero_fp8(
                q.get_data_tensors(rowwise_data=True, columnwise_data=False))
            key = (layer_name, tensor_name)
            pair = torch.stack((over.to(torch.int64), under.to(torch.int64)))
            reference[key] = pair if key not in reference else reference[key] + pair
            numel[key] = tensor.numel()

    class Capture(BaseLogger):  # type: ignore[misc]
        def __init__(self) -> None:
            self.values: dict[tuple[str, int], float] = {}

        def log_scalar(self, name: str, value: float | int, iteration: int, **kwargs: Any) -> None:
            self.values[(name, int(iteration))] = float(value)

    te_inspect.register_feature()
    Registry.register_feature(namespace="transformer_engine")(TeExactReference)
    capture = Capture()
    import transformer_engine.debug.features as features_pkg

    config = {"verify": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": {
        "LogFp8TensorStats": {"enabled": True, "tensors": _TENSORS, "stats": ["underflows%", "overflows%"], "freq": 1},
        te_inspect.FEATURE_NAME: {"enabled": True, "tensors": _TENSORS},
        "TeExactReference": {"enabled": True, "tensors": _TENSORS}}}}
    debug_api.initialize(config_file=config, feature_dirs=[str(Path(features_pkg.__file__).parent)],
                         statistics_logger=capture, log_dir=tempfile.mkdtemp())
    m = TEModel(Shape(layers=args.layers))
    m.step()  # warm-up: TE creates its FP8 state (all features see iteration 0)
    debug_api.step()
    src = te_source.discover(m.model, required=True)
    assert isinstance(src, te_source.TESource)
    src.prepare_step(1, 1)
    names = {(layer, tensor): target.index for (layer, tensor), target in src._inspect.targets.items()}
    n = len(src.tensors())
    steps = []
    mismatches: list[dict[str, Any]] = []
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
            if key not in reference:
                mismatches.append({"step": it, "operand": key, "problem": "not inspected by TE this step"})
                continue
            ref = [int(v) for v in reference[key].cpu()]
            mine = [int(ours_h[0, col]), int(ours_h[1, col])]
            compared += 1
            totals[0] += mine[0]
            totals[1] += mine[1]
            nonzero_over += mine[0] > 0
            if mine == ref:
                exact += 1
            elif len(mismatches) < 20:
                mismatches.append({"step": it, "operand": key, "fp8guard": mine, "te_functions": ref})
            ok = True
            for k, stat in ((0, "overflows%"), (1, "underflows%")):
                logged = capture.values.get((f"{key[0]}_{key[1]}_{stat}", it))
                if logged is None:
                    ok = False
                    continue
                mine_pct = 100.0 * mine[k] / numel[key]
                diff = abs(mine_pct - logged)
                worst_pct = max(worst_pct, diff / max(abs(logged), 1e-30) if logged else diff)
                ok &= diff <= 2e-6 * max(abs(logged), 1e-12) + 1e-12
            pct_ok += ok
            if not ok and len(mismatches) < 20:
                mismatches.append({"step": it, "operand": key, "fp8guard": mine, "numel": numel[key],
                                   "te_logged_pct": [capture.values.get((f"{key[0]}_{key[1]}_{s}", it))
                                                     for s in ("overflows%", "underflows%")]})
        steps.append({"step": it, "operands_compared": compared, "exact_vs_te_functions": exact,
                      "equal_to_logfp8tensorstats": pct_ok, "worst_rel_pct_diff": worst_pct,
                      "overflows": totals[0], "underflows": totals[1], "operands_with_overflows": nonzero_over,
                      "step_ms_three_features": round(step_ms, 1)})
    counted = sum(src.counted)
    # TE's LogFp8TensorStats alone (fp8guard's and the reference feature idle): its cost per step.
    te_only_ms = []
    reference_on[0] = False
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m.forward_backward()
        debug_api.step()
        torch.cuda.synchronize()
        te_only_ms.append((time.perf_counter() - t0) * 1e3)
        m.opt.zero_grad(set_to_none=True)
    all_ok = all(s["exact_vs_te_functions"] == s["operands_compared"] == s["equal_to_logfp8tensorstats"] == len(names)
                 for s in steps)
    return {"bench": "gpu_counts_verify", "device": torch.cuda.get_device_name(), "params_M": m.params_m,
            "columns": n, "counted_columns": counted, "targets": len(names), "steps": steps,
            "mismatches": mismatches, "all_equal": all_ok,
            "te_logfp8tensorstats_step_ms": [round(v, 1) for v in te_only_ms],
            "injections": {"step 2": "layer5.self_attention.proj.weight *= 64", "step 3": "loss * 4096"}}


# -- time -------------------------------------------------------------------------------------


def time_modes(args: argparse.Namespace) -> dict[str, Any]:
    torch, _ = require_te("gpu_counts_time")
    import logging

    from transformer_engine.debug.pytorch.debug_state import TEDebugState

    from fp8guard.agent import Monitor, MonitorConfig, NullTransport
    from fp8guard.agent.fp8 import Fp8Format
    from fp8guard.agent.sources import te_inspect

    records = Records()
    logging.getLogger("fp8guard").addHandler(records)
    m = TEModel(Shape(layers=args.layers))
    m.step()
    torch.cuda.synchronize()
    monitor = Monitor(MonitorConfig(url=None, sources=["te"], flush_interval_steps=50, count_interval_steps=0),
                      transport=NullTransport()).attach(m.model, m.opt)
    src = monitor.sources[0]
    monitor.set_count_interval(1)  # opens TE's debug session (fp8guard owns it)

    real = te_inspect.count_cast_into

    def skip_kernel(out: Any, x: Any, **kw: Any) -> None:
        return None

    def use(mode: str) -> None:
        te_inspect.count_cast_into = skip_kernel if mode == "debug_path_only" else real
        if mode == "plain":
            TEDebugState.debug_enabled = False
            return
        TEDebugState.debug_enabled = True
        monitor.set_count_interval({"agent_no_counts": 0, "counts_every_10": 10, "counts_every_step": 1,
                                    "debug_path_only": 1}[mode])

    modes = ["plain", "agent_no_counts", "counts_every_10", "counts_every_step", "debug_path_only"]
    for mode in modes:  # warm-up: Triton compiles its kernel variants, TE builds its debug path
        use(mode)
        for _ in range(args.warmup):
            m.step(None if mode == "plain" else monitor)
    torch.cuda.synchronize()
    per_step: dict[str, list[float]] = {k: [] for k in modes}
    host: dict[str, list[float]] = {k: [] for k in modes}
    t_start = time.perf_counter()
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        if r % 2:
            order = order[::-1]
        for mode in order:
            use(mode)
            # A cadence change makes every TE layer re-ask the debug API once (host work that a
            # run with a fixed cadence never repeats): settle untimed first.
            for _ in range(args.settle):
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
    te_inspect.count_cast_into = real
    med = {k: statistics.median(v) for k, v in per_step.items()}

    # -- kernels alone: one counted step's 144 calls captured, then replayed back to back -------
    use("counts_every_step")
    captured: list[dict[str, Any]] = []

    def capture(out: Any, x: Any, *, scale: Any, scale_inv: Any, fmt: Any, fp8_bytes: Any = None, **kw: Any) -> None:
        real(out, x, scale=scale, scale_inv=scale_inv, fmt=fmt, fp8_bytes=fp8_bytes)
        # copies of the scales: TE updates them in place after the step, the replay needs the cast's
        captured.append({"x": x, "scale": scale.clone(), "scale_inv": scale_inv.clone(), "fmt": fmt, "q": fp8_bytes})

    te_inspect.count_cast_into = capture
    try:
        m.step(monitor)
    finally:
        te_inspect.count_cast_into = real
    torch.cuda.synchronize()
    scratch = torch.zeros(len(captured), 2, dtype=torch.int64, device="cuda")
    scratch_hp = torch.zeros_like(scratch)

    def launch_all(hp: bool, dst: Any) -> None:
        for i, c in enumerate(captured):
            real(dst[i], c["x"], scale=c["scale"], scale_inv=c["scale_inv"], fmt=c["fmt"],
                 fp8_bytes=None if hp else c["q"])

    def best_ms(body: Any, dst: Any, repeats: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            dst.zero_()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            body()
            e1.record()
            torch.cuda.synchronize()
            best = min(best, e0.elapsed_time(e1))
        return best

    t_bytes = best_ms(lambda: launch_all(False, scratch), scratch, 3)
    t_hp = best_ms(lambda: launch_all(True, scratch_hp), scratch_hp, 3)

    def graphed(hp: bool, dst: Any) -> float:
        """The same 144 launches captured in a CUDA graph: GPU time alone, no launch overhead."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch_all(hp, dst)
        return best_ms(graph.replay, dst, 5)

    try:
        g_bytes, g_hp = graphed(False, scratch), graphed(True, scratch_hp)
        graph_error = None
    except Exception as exc:  # capture can fail on some stacks; the eager figures remain
        g_bytes = g_hp = float("nan")
        graph_error = f"{type(exc).__name__}: {exc}"[:300]
    # the host's share: how long enqueuing the 144 launches takes (the GPU may be waiting on it)
    h0 = time.perf_counter()
    for i, c in enumerate(captured):
        real(scratch[i], c["x"], scale=c["scale"], scale_inv=c["scale_inv"], fmt=c["fmt"], fp8_bytes=c["q"])
    launch_ms = (time.perf_counter() - h0) * 1e3
    torch.cuda.synchronize()
    max_code = {Fp8Format.E4M3: 0x7E, Fp8Format.E5M2: 0x7B}
    need = sum(int(((c["q"].view(torch.uint8) & 0x7F == 0) | (c["q"].view(torch.uint8) & 0x7F >= max_code[c["fmt"]]))
                   .sum()) for c in captured if c["q"] is not None)
    n_elems = sum(c["x"].numel() for c in captured)
    bytes_fp8 = sum(c["x"].numel() * (1 if c["q"] is not None else c["x"].element_size()) for c in captured) + 2 * need
    bytes_hp = sum(c["x"].numel() * c["x"].element_size() for c in captured)
    probe = {"kernel_calls": len(captured), "elements": n_elems,
             "bytes_path_calls": sum(c["q"] is not None for c in captured),
             "fp8_bytes_path_ms": round(t_bytes, 3), "fp8_bytes_path_bytes_GB": round(bytes_fp8 / 1e9, 3),
             "fp8_bytes_path_GBps": round(bytes_fp8 / 1e6 / t_bytes),
             "hp_elements_fetched_fraction": round(need / n_elems, 6),
             "hp_path_ms": round(t_hp, 3), "hp_path_bytes_GB": round(bytes_hp / 1e9, 3),
             "hp_path_GBps": round(bytes_hp / 1e6 / t_hp), "host_ms_to_enqueue_144_launches": round(launch_ms, 2),
             "graph_fp8_bytes_path_ms": round(g_bytes, 3), "graph_fp8_bytes_path_GBps": round(bytes_fp8 / 1e6 / g_bytes)
             if g_bytes == g_bytes else None,
             "graph_hp_path_ms": round(g_hp, 3), "graph_hp_path_GBps": round(bytes_hp / 1e6 / g_hp)
             if g_hp == g_hp else None, "graph_error": graph_error,
             "both_variants_agree": bool(torch.equal(scratch, scratch_hp)),
             "total_overflows": int(scratch[:, 0].sum()), "total_underflows": int(scratch[:, 1].sum())}
    captured.clear()
    monitor.close()
    plain = med["plain"]
    return {
        "bench": "gpu_counts_time", "device": torch.cuda.get_device_name(), "params_M": m.params_m,
        "columns": len(src.tensors()), "counted_columns": sum(src.counted), "rounds": args.rounds,
        "block": args.block, "settle": args.settle, "ms_per_step": {k: round(v, 3) for k, v in med.items()},
        "ratio_vs_plain": {k: round(v / plain, 5) for k, v in med.items()},
        "ratio_vs_agent_no_counts": {k: round(v / med["agent_no_counts"], 5) for k, v in med.items()},
        "host_ms_per_step_median": {k: round(statistics.median(v), 2) for k, v in host.items()},
        "block_ms_min_max": {k: [round(min(v), 3), round(max(v), 3)] for k, v in per_step.items()},
        "targets": {"counts_every_step": 1.045, "counts_every_10": 1.005},
        "probe": probe, "timed_s": round(timed_s, 1), "agent_log": records.messages[:10],
        "monitor_broken": bool(monitor._broken),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["verify", "time"])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=4, help="verify: counted steps compared")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--settle", type=int, default=2, help="time: untimed steps after each mode switch")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.what == "verify":
        _write(args.out, "gpu_counts_verify.json", verify(args))
    else:
        _write(args.out, "gpu_counts_time.json", time_modes(args))


if __name__ == "__main__":
    main()
