"""torchao float8 source (``convert_to_float8_training``). With :mod:`torchao_capture`, the
only modules that import torchao.

torchao scales dynamically: every cast computes its scale from the tensor's own amax, so no
scale or amax lives in module state. This source reads back the amaxes torchao computed for
its own casts (``measure == "torchao"``, :mod:`~fp8guard.agent.sources.torchao_capture`): each
column is the max over the casts of its role in the step (max-accumulated across
micro-batches until read), folded on the device once per step in a fixed handful of launches.
Measuring them again in hooks (the fallback, ``measure == "hooks"``, for a torchao laid out
otherwise) read every input, weight and output gradient once more: 6-9% of an 8-layer step on
the H200 (docs/gpu.md). The scale is recomputed with torchao's own ops (:func:`torchao_scale`),
so it equals the scale torchao cast with, to the bit; that makes the saturation ratio exactly
1 unless the tensor holds inf: what matters for dynamic scaling is amax over time and the exact
underflow counts. Rowwise (axiswise) recipes report the tensor-wide amax, i.e. the largest of
torchao's per-row amaxes, and the scale of that row (the smallest of torchao's per-row scales).

Under CUDA autocast ``Float8Linear`` casts its input to the autocast dtype before measuring
it; torchao's amax is that of the cast input, and the hooks round theirs the same way
(rounding is monotonic: the amax of the rounded tensor is the rounded amax).

The BF16 fallback of a ``Float8Linear`` also lives here (:func:`set_fp8`): the remediator
switches modules through :class:`TorchaoSwitch` without knowing torchao.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from fp8guard.agent.errors import SourceUnavailable
from fp8guard.agent.fp8 import Fp8Format, count_overflow_underflow
from fp8guard.agent.sources import torchao_capture as _capture
from fp8guard.agent.sources.base import AMAX, HISTORY_MAX, SCALE, Source, TensorSpec
from fp8guard.agent.sources.torchao_capture import to_device

__all__ = ["TorchaoSource", "TorchaoSwitch", "discover", "in_fp8", "set_fp8", "switch", "torchao_scale"]

try:
    from torchao.float8.float8_linear import Float8Linear
except ImportError:  # torchao is an optional extra: fp8guard[torchao]
    Float8Linear = None

_EPS = 1e-12  # torchao.float8.float8_utils.EPS
_ROLES = ("fwd_input", "fwd_weight", "bwd_grad_output")
_BF16 = "_fp8guard_bf16"
"""Instance attribute of a ``Float8Linear`` in BF16 fallback (its hooks then measure nothing)."""
_switches = 0
"""Bumped at every switch, so a source recomputes its FP8 mask only after one (not per read)."""


def discover(model: nn.Module, *, required: bool) -> Source | None:
    found = _find(model, required=required)
    return TorchaoSource(found) if found else None


def switch(model: nn.Module) -> TorchaoSwitch | None:
    """The model's ``Float8Linear`` modules as a hook-free switch (no telemetry), or None."""
    found = _find(model, required=False)
    return TorchaoSwitch(found) if found else None


def _find(model: nn.Module, *, required: bool) -> list[tuple[str, nn.Module]]:
    if Float8Linear is None:
        if required:
            raise SourceUnavailable("source 'torchao' needs torchao: pip install 'fp8guard[torchao]'")
        return []
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Float8Linear)]


def torchao_scale(amax: torch.Tensor, fp8_max: torch.Tensor | float, pow2: torch.Tensor | bool) -> torch.Tensor:
    """torchao's ``amax_to_scale`` op for op: ``fp8_max / clamp(amax, EPS)`` in float64 (which
    torch evaluates as ``reciprocal(...) * fp8_max``), rounded to float32, then down to a power
    of two where ``pow2``. ``fp8_max`` as a float64 tensor or a Python float; no host copy."""
    scale = (torch.reciprocal(torch.clamp(amax.to(torch.float64), min=_EPS)) * fp8_max).to(torch.float32)
    if isinstance(pow2, bool):
        return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale
    return torch.where(pow2, torch.exp2(torch.floor(torch.log2(scale))), scale)


def in_fp8(module: nn.Module) -> bool:
    """Whether a ``Float8Linear`` computes in FP8 (False while in BF16 fallback)."""
    return not module.__dict__.get(_BF16, False)


def set_fp8(modules: Sequence[tuple[str, nn.Module]], names: Sequence[str] | None, enabled: bool) -> None:
    """BF16 fallback (``enabled=False``) or re-promotion of the named ``Float8Linear`` modules.

    Fallback gives the module an instance ``forward`` that is plain ``nn.Linear.forward``
    (``Float8Linear`` subclasses ``nn.Linear`` and keeps the same weight and bias), so it runs
    the high-precision GEMM and autograd sees no FP8 cast; deleting it re-promotes. torchao
    scales dynamically, from each tensor's own amax, so there is no stale state to reset.
    Hooks keep running: the source's skip the module while it is in BF16 (amax 0, "not
    measured"), other hooks see every step."""
    global _switches
    wanted = None if names is None else set(names)
    for name, module in modules:
        if wanted is not None and name not in wanted:
            continue
        if enabled and not in_fp8(module):
            module.__dict__.pop("forward", None)
            del module.__dict__[_BF16]
        elif not enabled and in_fp8(module):
            module.__dict__["forward"] = functools.partial(nn.Linear.forward, cast(nn.Linear, module))
            module.__dict__[_BF16] = True
    _switches += 1


def _format(dtype: torch.dtype) -> Fp8Format:
    return Fp8Format.E5M2 if dtype == torch.float8_e5m2 else Fp8Format.E4M3


def _axis(config: Any) -> int | None:
    """The reduction axis of a cast config: None for tensorwise, -1 for rowwise (axiswise)."""
    return -1 if "AXISWISE" in str(getattr(config, "scaling_granularity", "")).upper() else None


class TorchaoSwitch:
    """The ``Float8Linear`` modules of a model, switchable between FP8 and BF16; no hooks."""

    kind = "torchao"

    def __init__(self, modules: Sequence[tuple[str, nn.Module]]) -> None:
        self._modules = list(modules)
        cfgs: list[Any] = [m.config for _, m in self._modules]
        casts = [(c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output) for c in cfgs]
        self._formats = [_format(c.target_dtype) for trio in casts for c in trio]
        self._axes = [_axis(c) for trio in casts for c in trio]
        self._pow2 = [bool(getattr(c, "round_scales_to_power_of_2", False)) for c in cfgs for _ in _ROLES]
        self._specs = [
            TensorSpec(module=name, role=role, fp8_format=str(fmt), fp8_max=fmt.fp8_max)
            for (name, _), fmts in zip(self._modules, _chunks(self._formats), strict=True)
            for role, fmt in zip(_ROLES, fmts, strict=True)
        ]

    def tensors(self) -> Sequence[TensorSpec]:
        return self._specs

    def set_fp8(self, modules: Sequence[str] | None, enabled: bool) -> None:
        set_fp8(self._modules, modules, enabled)

    def precision(self) -> dict[str, bool]:
        return {name: in_fp8(m) for name, m in self._modules}

    def settle(self, modules: Collection[str]) -> None:
        """torchao scales each tensor from its own amax: nothing to settle."""

    @contextmanager
    def probe(self, fp8: Mapping[str, bool]) -> Iterator[None]:
        """torchao scales dynamically: switching the GEMM is all there is (no state to keep)."""
        before = self.precision()
        try:
            for name, m in self._modules:
                if name in fp8:
                    set_fp8([(name, m)], None, fp8[name])
            yield
        finally:
            for name, m in self._modules:
                set_fp8([(name, m)], None, before[name])


class TorchaoSource(TorchaoSwitch):
    """Telemetry of a model's ``Float8Linear`` modules.

    ``measure`` says how amaxes are obtained: ``"torchao"`` (the default where this torchao
    allows it) reads back the amaxes torchao computed for its own casts
    (:mod:`~fp8guard.agent.sources.torchao_capture`); no hooks, a fixed handful of launches per
    step. ``"hooks"`` (``capture=False``, or a torchao whose functions are laid out otherwise,
    see ``capture_unavailable``) measures them again in a forward pre-hook (input, weight) and a
    backward pre-hook (grad_output) per module, one single-pass reduction each. Exact counts
    (``arm_counts``) always use those hooks, registered only while counting."""

    def __init__(self, modules: Sequence[tuple[str, nn.Module]], *, capture: bool = True) -> None:
        super().__init__(modules)
        device = next(self._modules[0][1].parameters()).device
        n = len(self._specs)
        self._amax = torch.zeros(n, device=device)
        self._counts = torch.zeros(n, 2, dtype=torch.int64, device=device)
        self._fp8_max = torch.tensor([s.fp8_max for s in self._specs], dtype=torch.float64, device=device)
        self._pow2_mask = torch.tensor(self._pow2, device=device)
        self._ones = torch.ones(n, device=device)
        self._fp8_mask: torch.Tensor | None = None
        """True per column in FP8, False where the module is in BF16 (None: all in FP8)."""
        self._mask_at = _switches
        self._counting = False
        self._sink = _capture.AmaxSink(self._amax)
        """torchao's own amaxes (``measure == "torchao"``); its ``paused`` flag is set during a harm
        probe's forwards (they are not this step's telemetry) and read by the hooks too."""
        self._forwards = 0
        """Training forwards the hooks measured since construction (a host counter, for stale_reason)."""
        self._handles: list[Any] = []
        self._count_handles: list[Any] = []
        self.capture_unavailable = _capture.unavailable(self._modules) if capture else "capture=False"
        """Why torchao's amaxes are not read back (None: they are)."""
        self.measure = "hooks" if self.capture_unavailable else "torchao"
        if self.measure == "torchao":
            _capture.attach(self._sink, [(m, 3 * k) for k, (_, m) in enumerate(self._modules)])
        else:
            self._register(self._handles)

    def _register(self, handles: list[Any]) -> None:
        for k, (_, module) in enumerate(self._modules):
            handles.append(module.register_forward_pre_hook(self._forward_hook(3 * k)))
            handles.append(module.register_full_backward_pre_hook(self._backward_hook(3 * k + 2)))

    def _observe(self, slot: int, x: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        x = x.detach()
        amax = None
        if self.measure == "hooks":
            # one pass, no temporary (abs().amax() wrote |x| out first); NaN propagates, as in
            # torchao's own torch.max(torch.abs(x)), into the scale: keep it visible
            amax = torch.linalg.vector_norm(x, ord=math.inf)
            if dtype is not None:  # the cast torchao applies first (autocast): round the amax the same way
                amax = amax.to(dtype)
            torch.maximum(self._amax[slot], amax, out=self._amax[slot])
        if self._counting:
            fmt, axis = self._formats[slot], self._axes[slot]
            src = (x if dtype is None else x.to(dtype)).float()
            # rowwise: each row is cast with its own scale
            if axis is None:
                a = amax.float() if amax is not None else torch.linalg.vector_norm(src, ord=math.inf)
            else:
                a = src.abs().nan_to_num(nan=0.0).amax(dim=axis, keepdim=True)
            scale = torchao_scale(a, fmt.fp8_max, self._pow2[slot])
            self._counts[slot].add_(count_overflow_underflow(src, scale, fmt))

    def _forward_hook(self, base: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if self._sink.paused or module.__dict__.get(_BF16, False):
                return
            self._forwards += 1
            x = args[0]
            # Float8Linear.forward: `if torch.is_autocast_enabled(): input = input.to(<cuda dtype>)`
            dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
            self._observe(base, x, dtype if dtype != x.dtype else None)
            self._observe(base + 1, cast(torch.Tensor, module.weight))
        return hook

    def _backward_hook(self, slot: int) -> Any:
        def hook(module: nn.Module, grad_output: tuple[torch.Tensor | None, ...]) -> None:
            if grad_output and grad_output[0] is not None and not module.__dict__.get(_BF16, False):
                self._observe(slot, grad_output[0])
        return hook

    @contextmanager
    def probe(self, fp8: Mapping[str, bool]) -> Iterator[None]:
        self._sink.paused = True
        try:
            with super().probe(fp8):
                yield
        finally:
            self._sink.paused = False

    def read(self, out: torch.Tensor) -> None:
        self._sink.fold()
        amax = self._amax
        scale = torchao_scale(amax, self._fp8_max, self._pow2_mask)
        if self._mask_at != _switches:  # after a switch only, never per step
            self._mask_at = _switches
            on = [in_fp8(m) for _, m in self._modules for _ in _ROLES]
            self._fp8_mask = None if all(on) else to_device(torch.tensor(on), amax.device)
        if self._fp8_mask is not None:  # a module in BF16 measured nothing: amax 0, scale 1
            scale = torch.where(self._fp8_mask, scale, self._ones)
        out[AMAX].copy_(amax)
        out[SCALE].copy_(scale)
        out[HISTORY_MAX].copy_(amax)  # dynamic scaling keeps no history: the window is this step
        amax.zero_()

    def stale_reason(self) -> str | None:
        """Why nothing was measured since attach (checked once by the monitor after a few steps),
        naming the fix; None when something was."""
        seen = self._sink.captures if self.measure == "torchao" else self._forwards
        if seen or not any(in_fp8(m) for _, m in self._modules):
            return None
        why = ("fp8guard: no torchao Float8Linear has cast in FP8 since attach, so every amax is 0: pass attach() "
               "the model your loop trains, the one convert_to_float8_training converted (before torch.compile)")
        if self._sink.skipped:
            why += (f"; {self._sink.skipped} casts were not plain tensors on the model's device (a cast traced by "
                    "torch.compile, or DTensor): this source reads torchao's amaxes in eager mode only")
        return why

    @property
    def supports_counts(self) -> bool:
        return True

    def arm_counts(self, enabled: bool) -> None:
        self._counting = enabled
        if self.measure != "torchao":
            return
        if enabled and not self._count_handles:  # counting steps only: the hooks cost a pass per tensor
            self._register(self._count_handles)
        elif not enabled:
            _remove(self._count_handles)

    def read_counts(self, out: torch.Tensor) -> None:
        out.copy_(self._counts.t())
        self._counts.zero_()

    def close(self) -> None:
        _capture.detach(self._sink)
        self._sink.clear()
        _remove(self._handles)
        _remove(self._count_handles)


def _remove(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()


def _chunks(items: list[Fp8Format]) -> list[list[Fp8Format]]:
    return [items[i:i + 3] for i in range(0, len(items), 3)]
