"""``bench/gpu_counts.py verify``: exact counts of every operand held to TE's own statistics.

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
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._te_model import Shape, TEModel, require_te

_TENSORS = ["activation", "weight", "gradient"]


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
    from fp8guard.agent.sources import te_counts, te_inspect

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
            fmt = te_counts._format_of(q, formats.get(key, Fp8Format.E4M3), quantizer)
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
    from fp8guard.agent.kernels import count_batch

    # fp8guard's feature counts eight operands a launch with --batched (the default), else one a launch
    count_batch.OPERANDS_PER_LAUNCH = count_batch.BATCH_SLOTS if getattr(args, "batched", False) else 0
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
            "compared_per_operand": variants_seen, "default_variant": src._inspect.variant,
            "batched": src._inspect.batch is not None, "steps": steps,
            "mismatches": mismatches[:60], "mismatch_count": len(mismatches), "te_cast_edge_cases": edges,
            "te_logfp8tensorstats_step_ms": [round(v, 1) for v in te_only_ms],
            "injections": {"step 2": "layer5.self_attention.proj.weight *= 64", "step 3": "loss * 4096"}}
