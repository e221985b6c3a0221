"""Transformer Engine's ``Float8CurrentScaling`` and ``Float8BlockScaling``: measured by hooks.

Nothing persists in TE under these recipes, so :class:`~fp8guard.agent.sources.te_hooks.HookObserver`
measures the hook-reachable operands (see there). SCALE is TE's current-scaling formula of that
amax (``fp8_max / max(amax, eps)``, 1 for amax 0/inf/NaN, float32 max on overflow, optionally
rounded down to a power of two); for block scaling that is the scale of the block holding the
tensor's amax (the smallest block scale). HISTORY_MAX = AMAX (no history). LayerNorm outputs,
activations and internal gradients of LayerNormLinear/LayerNormMLP are not reachable and not
reported; ``te.ops`` fused pipelines bypass module hooks.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from fp8guard.agent.sources.base import AMAX, HISTORY_MAX, SCALE, TensorSpec
from fp8guard.agent.sources.te_access import TEApi
from fp8guard.agent.sources.te_hooks import HookObserver
from fp8guard.agent.sources.te_layout import (
    Column,
    format_of,
    gemm_suffix,
    hook_operands,
    num_gemms,
    quantizer,
    slot_of,
    state_of,
    weights_of,
)

__all__ = ["HOOK_RECIPES", "CurrentReader", "current_columns", "te_current_scale"]

log = logging.getLogger("fp8guard.agent")

HOOK_RECIPES = ("float8_current_scaling", "float8_block_scaling")
"""The recipe families measured by hooks (TE's recipe check names)."""
_FP32_MAX = float(torch.finfo(torch.float32).max)
_POW2_MASK = -8388608
"""0xFF800000 as int32: keeps sign and exponent, i.e. TE's round-down to a power of two."""


def te_current_scale(amax: torch.Tensor, fp8_max: torch.Tensor | float,
                     pow2: torch.Tensor | bool = False, eps: torch.Tensor | float = 0.0) -> torch.Tensor:
    """TE's ``compute_scale_from_amax`` (current and block scaling), elementwise, on the device.

    ``amax < eps`` is raised to eps; amax 0, inf or NaN gives 1; a scale that overflows float32
    gives float32 max; ``pow2`` rounds down to a power of two by dropping the mantissa bits.
    """
    amax = amax.to(torch.float32)
    a = torch.where(amax < eps, eps, amax)
    # tensor / tensor: one correctly rounded float32 division like TE's __fdiv_rn (a Python float
    # over a tensor would be computed as reciprocal-then-multiply, off by an ulp at times)
    scale = (torch.full_like(a, fp8_max) if isinstance(fp8_max, float) else fp8_max) / a
    scale = torch.where(torch.isinf(scale), _FP32_MAX, scale)
    scale = torch.where(torch.isfinite(a) & (a != 0), scale, 1.0)
    if isinstance(pow2, bool) and not pow2:
        return scale
    rounded = (scale.contiguous().view(torch.int32) & _POW2_MASK).view(torch.float32)
    return rounded if isinstance(pow2, bool) else torch.where(pow2, rounded, scale)


def current_columns(ready: list[tuple[str, nn.Module, str]], te: TEApi, recipe_name: str) -> list[Column]:
    """The hook-reachable operands of the modules (weights only where TE re-quantizes them)."""
    columns: list[Column] = []
    for name, m, kind in ready:
        recipe = state_of(m, kind, "fwd").recipe
        ops = hook_operands(kind, num_gemms(m, kind))
        if not ops:
            log.info("fp8guard: te source cannot observe %s (%s) under %s", name, kind, recipe_name)
        for g, side, pos in ops:
            slot = slot_of(kind, side, g, pos)
            if slot is None:
                continue
            if pos == "weight" and not any(isinstance(w, torch.Tensor) and not isinstance(w, te.quantized)
                                           for w in weights_of(m, kind, g)):
                continue  # FP8 primary weights: never re-quantized from high precision
            fmt, fp8_max = format_of(recipe, side)
            q = quantizer(m, side, slot)
            spec = TensorSpec(module=name + gemm_suffix(kind, g), role=f"{side}_{pos}",
                              fp8_format=str(fmt), fp8_max=fp8_max)
            columns.append(Column(
                spec=spec, module=m, kind=kind, side=side, slot=slot, entry=-1, fmt=fmt,
                pow2=bool(getattr(q, "force_pow_2_scales", False)),
                eps=float(getattr(q, "amax_epsilon", 0.0) or 0.0), hooked=True))
    return columns


class CurrentReader:
    """Reads the hooks' amaxes and TE's current-scaling scale of them: a fixed handful of device ops."""

    def __init__(self, columns: list[Column], observer: HookObserver, device: torch.device) -> None:
        self._observer = observer
        self._fp8_max = torch.tensor([c.spec.fp8_max for c in columns], dtype=torch.float32, device=device)
        self._pow2 = torch.tensor([c.pow2 for c in columns], dtype=torch.bool, device=device)
        self._eps = torch.tensor([c.eps for c in columns], dtype=torch.float32, device=device)
        self._ones = torch.ones(len(columns), dtype=torch.float32, device=device)
        self._any_pow2 = any(c.pow2 for c in columns)
        self._any_eps = any(c.eps > 0 for c in columns)

    def read(self, out: torch.Tensor) -> None:
        amax = self._observer.amax
        out[AMAX].copy_(amax)
        out[HISTORY_MAX].copy_(amax)  # no history under current/block scaling: the window is this step
        self._write_scale(amax, out[SCALE])
        self._observer.consumed()

    def _write_scale(self, amax: torch.Tensor, dst: torch.Tensor) -> None:
        """``te_current_scale`` of every column into ``dst``, in as few launches as possible."""
        a = torch.maximum(amax, self._eps) if self._any_eps else amax
        scale = torch.div(self._fp8_max, a).clamp_(max=_FP32_MAX)  # a tiny amax: float32 max
        ok = (a > 0) & (a < float("inf"))  # amax >= 0; 0, inf and NaN give scale 1
        if not self._any_pow2:
            torch.where(ok, scale, self._ones, out=dst)
            return
        scale = torch.where(ok, scale, self._ones)
        rounded = (scale.view(torch.int32) & _POW2_MASK).view(torch.float32)
        torch.where(self._pow2, rounded, scale, out=dst)
