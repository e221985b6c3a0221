"""``bench/gpu_torchao.py``'s ``values`` part (and ``autocast``): the torchao source's values
against torchao's own.

``values``: for ``--value-steps`` steps, every column of the source (input, weight and
grad_output amax and scale of each ``Float8Linear``) against what torchao itself computed:
its ``tensor_to_amax`` result and the ``_scale`` of the ``Float8TrainingTensor`` it cast with,
captured by wrapping those two functions (the first cast of each role; rowwise: the largest
per-row amax and the smallest per-row scale, which is the one of that row). Compared
**exactly** (bitwise float32 equality); the largest relative difference is reported too. Both
ways of the source: torchao's amaxes read back (``measure: torchao``, the default) and the
hooks fallback (``hooks``); then one forward and backward with a NaN in the input, which
the first column must show. On the GPU also under CUDA autocast with float32 parameters
(tensorwise; part ``autocast``, once).
"""

from __future__ import annotations

import argparse
from typing import Any

from bench._torchao_casts import TorchaoCasts
from bench._torchao_model import Loop, _build


def part_values(torch: Any, loop: Loop, steps: int) -> dict[str, Any]:
    """Both ways of the source: torchao's amaxes read back (the default) and the hooks fallback."""
    res = _values(torch, loop, steps, "torchao")
    res["hooks"] = _values(torch, loop, steps, "hooks")
    res["ok"] = res["ok"] and res["hooks"]["ok"]
    return res


def _values(torch: Any, loop: Loop, steps: int, measure: str) -> dict[str, Any]:
    from fp8guard.agent.sources import torchao as tsrc
    from fp8guard.agent.sources.base import AMAX, SCALE, STATS

    found = [(n, m) for n, m in loop.model.named_modules() if isinstance(m, tsrc.Float8Linear)]
    source = tsrc.TorchaoSource(found, capture=measure == "torchao")
    specs = source.tensors()
    first_role = {"fwd_input": "INPUT", "fwd_weight": "WEIGHT", "bwd_grad_output": "GRAD_OUTPUT"}
    compared = amax_equal = scale_equal = consistent = 0
    rel_amax = rel_scale = 0.0
    mismatches: list[dict[str, Any]] = []
    try:
        with TorchaoCasts(loop.model) as casts:
            for _ in range(steps):
                loop.step()
                out = torch.zeros(len(STATS), len(specs), device=loop.x.device)
                source.read(out)
                records = casts.take()
                for col, spec in enumerate(specs):
                    mine = [r for r in records if r["module"] == spec.module and r["role"] == first_role[spec.role]]
                    if not mine:
                        mismatches.append({"column": spec.name, "error": "torchao made no such cast"})
                        continue
                    # every cast of a role in one step sees the same tensor: the same tensor-wide amax
                    consistent += len({float(r["amax"].float().max()) for r in mine}) == 1
                    want_amax = mine[0]["amax"].float().max()
                    want_scale = mine[0]["scale"].min()
                    got_amax, got_scale = out[AMAX, col], out[SCALE, col]
                    compared += 1
                    a_ok, s_ok = bool(got_amax == want_amax), bool(got_scale == want_scale)
                    amax_equal += a_ok
                    scale_equal += s_ok
                    rel_amax = max(rel_amax, float((got_amax - want_amax).abs() / want_amax.abs().clamp(min=1e-30)))
                    rel_scale = max(rel_scale, float((got_scale - want_scale).abs() / want_scale.abs()))
                    if not (a_ok and s_ok) and len(mismatches) < 8:
                        mismatches.append({"column": spec.name, "amax": [float(got_amax), float(want_amax)],
                                           "scale": [float(got_scale), float(want_scale)]})
        nan_visible = _nan_visible(torch, loop, source)
    finally:
        source.close()
    return {"measure": source.measure, "capture_unavailable": source.capture_unavailable,
            "comparison": "exact (bitwise float32 equality)", "steps": steps, "columns": len(specs),
            "compared": compared, "amax_equal": amax_equal, "scale_equal": scale_equal,
            "same_amax_in_every_cast_of_a_role": consistent, "max_rel_diff_amax": rel_amax,
            "max_rel_diff_scale": rel_scale, "mismatches": mismatches, "nan_visible": nan_visible,
            "ok": (source.measure == measure and compared == len(specs) * steps and amax_equal == compared
                   and scale_equal == compared and nan_visible)}


def _nan_visible(torch: Any, loop: Loop, source: Any) -> bool:
    """One forward and backward (no optimizer step) with a NaN in the input: the first column's
    amax is NaN, as torchao's own (device reductions: vector_norm, _foreach_max, the gather)."""
    from fp8guard.agent.sources.base import AMAX, STATS

    x = loop.x.clone()
    x.view(-1)[0] = float("nan")
    loop.model(x).float().sum().backward()
    loop.opt.zero_grad(set_to_none=True)
    out = torch.zeros(len(STATS), len(source.tensors()), device=loop.x.device)
    source.read(out)
    return bool(torch.isnan(out[AMAX, 0]))


def run_autocast_values(torch: Any, float8: Any, a: argparse.Namespace) -> dict[str, Any]:
    """tensorwise, float32 parameters under CUDA autocast (bf16): Float8Linear casts its input to
    bf16 before measuring it; the source rounds the amax of the float32 input the same way."""
    model, opt, x, y = _build(torch, float8, a, "tensorwise", "cuda", torch.float32)
    loop = Loop(torch, model, opt, x, y, autocast=True)
    loop.step()
    return part_values(torch, loop, a.value_steps)
