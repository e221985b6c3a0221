"""A CPU stand-in for the parts of Transformer Engine 2.x that fp8guard's TE source reads.

Given to the source through its one seam, ``fp8guard.agent.sources.te_access.substitute(fake_te)``.
It exposes exactly the attributes the source reads: module classes (``Linear``,
``LayerNormLinear``, ``LayerNormMLP``, ``GroupedLinear``), ``quantization.FP8GlobalStateManager``,
``distributed.in_fp8_activation_recompute_phase``, ``autocast``; per module ``fp8_meta``
(``scaling_fwd``/``scaling_bwd`` recipe states with ``recipe``, and under delayed scaling
``amax_history`` ``[L, slots]`` and ``scale`` ``[slots]``), ``quantizers``, ``weight_names`` /
``fc1_weight`` / ``fc2_weight``, ``name``, ``reset_fp8_meta_tensors``; recipes with TE's check
methods and ``fp8_format.value.max_fwd/max_bwd``.

Its FP8 state follows TE's documented delayed-scaling rules (docs: ../shared/reference/
transformer-engine.md 1.3-1.4): casts max their amax into history row 0; at the outermost
autocast exit (forward) and after the first module's backward (backward) every registered
module's history is rolled by -1 (row -1 = the completed amax), row 0 zeroed, and the scale set to
``fp8_max / max(history) / 2**margin`` (kept for amax 0/inf/NaN). GEMMs compute in full
precision: this proves the source's logic (layout, reads, switching), never TE's numerics or
behaviour on a GPU (tests/agent/test_te_source_*.py check those on a real one).
"""

from __future__ import annotations

import enum
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DelayedScaling", "Float8BlockScaling", "Float8CurrentScaling", "Format", "GroupedLinear",
           "LayerNormLinear", "LayerNormMLP", "Linear", "TransformerLayer", "autocast", "distributed", "quantization"]

_FP32_MAX = float(torch.finfo(torch.float32).max)


@dataclass(frozen=True)
class _Maxima:
    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    E4M3 = _Maxima(448.0, 448.0)
    HYBRID = _Maxima(448.0, 57344.0)


class _Recipe:
    fp8_format: Format = Format.HYBRID

    def delayed(self) -> bool:
        return False

    def float8_current_scaling(self) -> bool:
        return False

    def float8_block_scaling(self) -> bool:
        return False


class DelayedScaling(_Recipe):
    def __init__(self, fp8_format: Format = Format.HYBRID, amax_history_len: int = 1024, margin: int = 0,
                 amax_compute_algo: str = "max") -> None:
        if amax_compute_algo != "max":
            raise NotImplementedError("the stand-in implements amax_compute_algo='max' only")
        self.fp8_format, self.amax_history_len, self.margin = fp8_format, amax_history_len, margin

    def delayed(self) -> bool:
        return True


class Float8CurrentScaling(_Recipe):
    def __init__(self, fp8_format: Format = Format.HYBRID) -> None:
        self.fp8_format = fp8_format

    def float8_current_scaling(self) -> bool:
        return True


class Float8BlockScaling(_Recipe):
    def __init__(self, fp8_format: Format = Format.E4M3) -> None:
        self.fp8_format = fp8_format

    def float8_block_scaling(self) -> bool:
        return True


class _State:
    """A RecipeState: tensors only under delayed scaling."""

    def __init__(self, recipe: _Recipe, slots: int, forward: bool, device: torch.device) -> None:
        self.recipe = recipe
        if isinstance(recipe, DelayedScaling):
            self.amax_history = torch.zeros(recipe.amax_history_len, slots, device=device)
            self.scale = torch.ones(slots, device=device)
            fmt = recipe.fp8_format.value
            self.fp8_max = fmt.max_fwd if forward else fmt.max_bwd

    def record(self, slot: int, x: torch.Tensor) -> None:
        if hasattr(self, "amax_history"):
            row = self.amax_history[0, slot:slot + 1]
            torch.maximum(row, x.detach().abs().amax().float().reshape(1), out=row)

    def update(self) -> None:
        """TE's delayed-scaling update: roll, scale from the window's max, zero the staging row."""
        if not hasattr(self, "amax_history"):
            return
        with torch.no_grad():
            h = self.amax_history
            rolled = torch.roll(h, -1, dims=0)
            amax = rolled.amax(dim=0)
            scale = torch.full_like(amax, self.fp8_max) / amax / 2.0 ** self.recipe.margin  # type: ignore[attr-defined]
            scale = torch.where(torch.isinf(scale), _FP32_MAX, scale)
            keep = ~(torch.isfinite(amax) & (amax > 0))
            self.scale.copy_(torch.where(keep, self.scale, scale))
            h.copy_(rolled)
            h[0].zero_()


class _Global:
    enabled = False
    recipe: _Recipe | None = None
    depth = 0
    registered: ClassVar[list[_Module]] = []
    forward_order: ClassVar[list[_Module]] = []


class _FP8GlobalStateManager:
    @staticmethod
    def is_fp8_enabled() -> bool:
        return _Global.enabled


quantization = types.SimpleNamespace(FP8GlobalStateManager=_FP8GlobalStateManager)
distributed = types.SimpleNamespace(in_fp8_activation_recompute_phase=lambda: False)


@contextmanager
def autocast(enabled: bool = True, recipe: _Recipe | None = None) -> Iterator[None]:
    """Nested autocasts save and restore the outer state; the outermost FP8 exit updates forward scales."""
    saved = (_Global.enabled, _Global.recipe)
    outer = _Global.depth == 0
    if outer:
        _Global.forward_order = []
    _Global.enabled, _Global.depth = enabled, _Global.depth + 1
    _Global.recipe = recipe or _Global.recipe or DelayedScaling()
    try:
        yield
    finally:
        _Global.depth -= 1
        _Global.enabled, _Global.recipe = saved
        if outer and enabled and torch.is_grad_enabled():
            for m in _Global.registered:
                m.fp8_meta["scaling_fwd"].update()


class _Module(nn.Module):
    """What every fake TE module shares: lazily created FP8 state, as TE's prepare_forward."""

    fwd_slots = 3
    bwd_slots = 2

    def __init__(self, name: str | None = None) -> None:
        super().__init__()
        self.fp8_meta: dict[str, Any] = {}
        self.quantizers: dict[str, list[Any]] = {"scaling_fwd": [], "scaling_bwd": []}
        self.name = name

    def _fp8(self) -> bool:
        """Prepare for a forward; True when it runs in FP8."""
        if not _Global.enabled:
            return False
        if "scaling_fwd" not in self.fp8_meta:
            recipe, device = _Global.recipe, next(self.parameters()).device
            assert recipe is not None
            self.fp8_meta["recipe"] = recipe
            self.fp8_meta["scaling_fwd"] = _State(recipe, self.fwd_slots, True, device)
            self.fp8_meta["scaling_bwd"] = _State(recipe, self.bwd_slots, False, device)
            q = types.SimpleNamespace(force_pow_2_scales=False, amax_epsilon=0.0)
            self.quantizers = {"scaling_fwd": [q] * self.fwd_slots, "scaling_bwd": [q] * self.bwd_slots}
            if isinstance(recipe, DelayedScaling):
                _Global.registered.append(self)
        if torch.is_grad_enabled():
            _Global.forward_order.append(self)
        return True

    def _record(self, side: str, slot: int, x: torch.Tensor) -> None:
        self.fp8_meta[f"scaling_{side}"].record(slot, x)

    def _grad_slot(self, y: torch.Tensor, slot: int, last: bool) -> torch.Tensor:
        """Record the gradient of ``y`` into a backward slot; after the autocast's first module's
        last cast, update every backward state (TE: the last backward to run)."""
        if not y.requires_grad:
            return y
        first = bool(_Global.forward_order) and _Global.forward_order[0] is self

        def hook(g: torch.Tensor) -> None:
            self._record("bwd", slot, g)
            if first and last:
                for m in _Global.registered:
                    m.fp8_meta["scaling_bwd"].update()
        y.register_hook(hook)
        return y

    def reset_fp8_meta_tensors(self) -> None:
        for key in ("scaling_fwd", "scaling_bwd"):
            st = self.fp8_meta.get(key)
            if st is not None and hasattr(st, "amax_history"):
                st.amax_history.zero_()
                st.scale.fill_(1.0)


class Linear(_Module):
    weight_names = ("weight",)

    def __init__(self, in_features: int, out_features: int, name: str | None = None) -> None:
        super().__init__(name)
        self.weight = nn.Parameter(torch.randn(out_features, in_features) / in_features ** 0.5)

    def _gemm(self, x: torch.Tensor, fp8: bool, grad_slot: int = 0, input_slot: int = 0) -> torch.Tensor:
        if fp8:
            self._record("fwd", input_slot, x)
            self._record("fwd", input_slot + 1, self.weight)
        y = F.linear(x, self.weight)
        return self._grad_slot(y, grad_slot, last=True) if fp8 else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemm(x, self._fp8())


class LayerNormLinear(Linear):
    def __init__(self, in_features: int, out_features: int, name: str | None = None) -> None:
        super().__init__(in_features, out_features, name)
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fp8 = self._fp8()
        return self._gemm(F.layer_norm(x, x.shape[-1:], self.layer_norm_weight), fp8)


class LayerNormMLP(_Module):
    fwd_slots = 6
    bwd_slots = 4

    def __init__(self, hidden: int, ffn: int, name: str | None = None) -> None:
        super().__init__(name)
        self.layer_norm_weight = nn.Parameter(torch.ones(hidden))
        self.fc1_weight = nn.Parameter(torch.randn(ffn, hidden) / hidden ** 0.5)
        self.fc2_weight = nn.Parameter(torch.randn(hidden, ffn) / ffn ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fp8 = self._fp8()
        ln = F.layer_norm(x, x.shape[-1:], self.layer_norm_weight)
        if fp8:
            self._record("fwd", 0, ln)
            self._record("fwd", 1, self.fc1_weight)
        h = F.linear(ln, self.fc1_weight)
        if fp8:
            h = self._grad_slot(h, 0, last=True)  # fc1's grad_output: the last backward cast
        a = F.gelu(h)
        if fp8:
            self._record("fwd", 3, a)
            self._record("fwd", 4, self.fc2_weight)
        y = F.linear(a, self.fc2_weight)
        return self._grad_slot(y, 2, last=False) if fp8 else y


class GroupedLinear(_Module):
    """Listed so the source can look for it; the tests' models do not use it."""


class TransformerLayer(nn.Module):
    """TE's submodule layout (``self_attention.layernorm_qkv``, ``self_attention.proj``,
    ``layernorm_mlp``) with a token-wise mix instead of attention."""

    def __init__(self, hidden: int, ffn: int, heads: int = 1, *, name: str = "layer",
                 params_dtype: torch.dtype | None = None, **te_options: Any) -> None:
        """TE's signature; ``te_options`` (dropout, fusing, layer number) change nothing here."""
        super().__init__()
        self.self_attention = nn.Module()
        self.self_attention.layernorm_qkv = LayerNormLinear(hidden, 3 * hidden, name=f"{name}.qkv")
        self.self_attention.proj = Linear(hidden, hidden, name=f"{name}.proj")
        self.layernorm_mlp = LayerNormMLP(hidden, ffn, name=f"{name}.mlp")
        if params_dtype is not None:
            self.to(params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn: Any = self.self_attention
        q, k, v = attn.layernorm_qkv(x).chunk(3, dim=-1)
        x = x + attn.proj(torch.tanh(q) * k + v)
        out: torch.Tensor = x + self.layernorm_mlp(x)
        return out


def reset() -> None:
    """Forget every registered module (a fresh process, as far as this stand-in is concerned)."""
    _Global.enabled, _Global.recipe, _Global.depth = False, None, 0
    _Global.registered, _Global.forward_order = [], []
