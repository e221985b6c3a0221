"""torchao float8 source (``convert_to_float8_training``). The only module that imports torchao.

torchao scales dynamically: every cast computes its scale from the tensor's own amax, so no
scale or amax lives in module state. This source measures them with hooks: a forward pre-hook
(input, weight) and a backward pre-hook (grad_output) per ``Float8Linear``, each an amax
reduction into a preallocated device buffer (max-accumulated across micro-batches until read).
The scale is recomputed with torchao's own rule (``fp8_max / clamp(amax, 1e-12)``, rounded
down to a power of two when the recipe says so), which makes the saturation ratio exactly 1
unless the tensor holds inf; what matters for dynamic scaling is amax over time and the
exact underflow counts. Rowwise (axiswise) recipes report the tensor-wide amax, i.e. the
scale of the row with the largest amax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from fp8guard.agent.errors import SourceUnavailable
from fp8guard.agent.fp8 import Fp8Format, count_overflow_underflow
from fp8guard.agent.sources.base import AMAX, HISTORY_MAX, SCALE, Source, TensorSpec

__all__ = ["TorchaoSource", "discover"]

try:
    from torchao.float8.float8_linear import Float8Linear
except ImportError:  # torchao is an optional extra: fp8guard[torchao]
    Float8Linear = None

_EPS = 1e-12  # torchao.float8.float8_utils.EPS
_ROLES = ("fwd_input", "fwd_weight", "bwd_grad_output")


def discover(model: nn.Module, *, required: bool) -> Source | None:
    if Float8Linear is None:
        if required:
            raise SourceUnavailable("source 'torchao' needs torchao: pip install 'fp8guard[torchao]'")
        return None
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    return TorchaoSource(found) if found else None


def _format(dtype: torch.dtype) -> Fp8Format:
    return Fp8Format.E5M2 if dtype == torch.float8_e5m2 else Fp8Format.E4M3


def _axis(config: Any) -> int | None:
    """The reduction axis of a cast config: None for tensorwise, -1 for rowwise (axiswise)."""
    return -1 if "AXISWISE" in str(getattr(config, "scaling_granularity", "")).upper() else None


class TorchaoSource:
    kind = "torchao"

    def __init__(self, modules: Sequence[tuple[str, nn.Module]]) -> None:
        self._modules = list(modules)
        cfgs: list[Any] = [m.config for _, m in self._modules]
        casts = [(c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output) for c in cfgs]
        self._formats = [_format(cast.target_dtype) for trio in casts for cast in trio]
        self._axes = [_axis(cast) for trio in casts for cast in trio]
        self._pow2 = [bool(getattr(c, "round_scales_to_power_of_2", False)) for c in cfgs for _ in _ROLES]
        self._specs = [
            TensorSpec(module=name, role=role, fp8_format=str(fmt), fp8_max=fmt.fp8_max)
            for (name, _), fmts in zip(self._modules, _chunks(self._formats), strict=True)
            for role, fmt in zip(_ROLES, fmts, strict=True)
        ]
        device = next(self._modules[0][1].parameters()).device
        n = len(self._specs)
        self._amax = torch.zeros(n, device=device)
        self._counts = torch.zeros(n, 2, dtype=torch.int64, device=device)
        self._fp8_max = torch.tensor([s.fp8_max for s in self._specs], device=device)
        self._pow2_mask = torch.tensor(self._pow2, device=device)
        self._counting = False
        self._handles: list[Any] = []
        for k, (_, module) in enumerate(self._modules):
            self._handles.append(module.register_forward_pre_hook(self._forward_hook(3 * k)))
            self._handles.append(module.register_full_backward_pre_hook(self._backward_hook(3 * k + 2)))

    def _observe(self, slot: int, x: torch.Tensor) -> None:
        # torchao's own amax (torch.max(torch.abs(x))) propagates NaN into the scale: keep it visible.
        amax = x.detach().abs().amax().float()
        torch.maximum(self._amax[slot], amax, out=self._amax[slot])
        if self._counting:
            fmt, axis = self._formats[slot], self._axes[slot]
            src = x.detach().float()
            # rowwise: each row is cast with its own scale
            a = amax if axis is None else src.abs().nan_to_num(nan=0.0).amax(dim=axis, keepdim=True)
            scale = torch.reciprocal(torch.clamp(a, min=_EPS)) * fmt.fp8_max
            if self._pow2[slot]:
                scale = torch.exp2(torch.floor(torch.log2(scale)))
            self._counts[slot].add_(count_overflow_underflow(src, scale, fmt))

    def _forward_hook(self, base: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            self._observe(base, args[0])
            self._observe(base + 1, cast(torch.Tensor, module.weight))
        return hook

    def _backward_hook(self, slot: int) -> Any:
        def hook(module: nn.Module, grad_output: tuple[torch.Tensor | None, ...]) -> None:
            if grad_output and grad_output[0] is not None:
                self._observe(slot, grad_output[0])
        return hook

    def tensors(self) -> Sequence[TensorSpec]:
        return self._specs

    def read(self, out: torch.Tensor) -> None:
        amax = self._amax
        # torchao writes `fp8_max / clamp(amax)` with a Python float, which torch evaluates as
        # reciprocal(...) * fp8_max; do the same so the scale matches to the last bit.
        scale = torch.reciprocal(torch.clamp(amax, min=_EPS)) * self._fp8_max
        scale = torch.where(self._pow2_mask, torch.exp2(torch.floor(torch.log2(scale))), scale)
        out[AMAX].copy_(amax)
        out[SCALE].copy_(scale)
        out[HISTORY_MAX].copy_(amax)  # dynamic scaling keeps no history: the window is this step
        amax.zero_()

    @property
    def supports_counts(self) -> bool:
        return True

    def arm_counts(self, enabled: bool) -> None:
        self._counting = enabled

    def read_counts(self, out: torch.Tensor) -> None:
        out.copy_(self._counts.t())
        self._counts.zero_()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _chunks(items: list[Fp8Format]) -> list[list[Fp8Format]]:
    return [items[i:i + 3] for i in range(0, len(items), 3)]
