"""Transformer Engine source. The only module of fp8guard that imports transformer_engine.

Usage (TE creates its FP8 state lazily, at a module's first FP8 forward, so run one training
step before attaching)::

    with te.autocast(enabled=True, recipe=recipe):
        loss = loss_fn(model(batch))
    loss.backward(); opt.step(); opt.zero_grad()          # warm-up step: FP8 state now exists
    monitor = Monitor(MonitorConfig(sources=["te"])).attach(model, opt)

Attaching before any FP8 forward raises :class:`ConfigError`. Modules found: ``te.Linear``,
``te.LayerNormLinear``, ``te.LayerNormMLP``, ``te.GroupedLinear`` (also inside
``te.TransformerLayer``) and ``te.ops.BasicLinear``. FP8 attention (``DotProductAttention``
with ``fp8_dpa``) is not monitored.

Columns (one :class:`TensorSpec` per FP8 GEMM operand):

* ``module`` is the qualified name in the model; for multi-GEMM modules a suffix names the
  GEMM: ``<name>.fc1`` / ``<name>.fc2`` for ``LayerNormMLP`` (TE's own ``QuantizerRole.name``
  convention), ``<name>.gemm<i>`` for ``GroupedLinear``.
* ``role`` is one of ``fwd_input``, ``fwd_weight``, ``fwd_output``, ``bwd_grad_output``,
  ``bwd_grad_input``: TE's slot layout (forward ``[input, weight, output]`` and backward
  ``[grad_output, grad_input]`` per GEMM), checked against ``get_quantizer_roles()``.
* formats and maxima come from the recipe (HYBRID: E4M3/448 forward, E5M2/57344 backward).

Recipes:

* ``DelayedScaling``: read from TE's own state (``fp8_meta["scaling_fwd"|"scaling_bwd"]``:
  ``amax_history`` ``[L, slots]`` and ``scale`` ``[slots]``, updated in place by TE after the
  forward (autocast exit) and after the backward). Per step, after backward:
  AMAX = row -1 of the history (the latest completed amax); with ``amax_history_len == 1`` TE
  zeroes that row at once, so AMAX = ``fp8_max / (scale * 2**margin)`` from the new scale
  (a zero, inf or NaN amax keeps the old scale, so such a step repeats the previous amax);
  SCALE = the scale seen at the previous read, i.e. the one in use when that amax was
  measured; HISTORY_MAX = max over the stored history (for L > 1 the L-1 newest completed
  amaxes; for L == 1 the derived amax). All modules are gathered with a handful of fused
  device ops per step. The output / grad_input slots are used only with ``fp8_output`` /
  ``fp8_grad``; with ``boundary_slots="auto"`` they are included when their history is
  nonzero at attach time.
* ``Float8CurrentScaling`` and ``Float8BlockScaling``: nothing persists in TE, so hooks
  measure the operands reachable from module hooks (forward pre-hook: the input of
  ``te.Linear`` and the weights of every module; a tensor hook on the module output: the
  grad_output of its last GEMM) with TE's own amax kernel into a device buffer
  (max-accumulated over micro-batches until read). SCALE is TE's current-scaling formula of
  that amax (``fp8_max / max(amax, eps)``, 1 for amax 0/inf/NaN, float32 max on overflow,
  optionally rounded down to a power of two); for block scaling that is the scale of the block
  holding the tensor's amax (the smallest block scale). HISTORY_MAX = AMAX (no history).
  LayerNorm outputs, activations and internal gradients of LayerNormLinear/LayerNormMLP are
  not reachable and not reported; ``te.ops`` fused pipelines bypass module hooks.
* MXFP8, NVFP4 and CustomRecipe raise :class:`ConfigError` (see docs/gpu-te-source.md).

Exact counts (``arm_counts``): for the hook-reachable operands, ``count_overflow_underflow``
with the scale the cast uses (delayed: TE's live ``scale`` slot; current: the formula above);
other columns stay 0 (see :attr:`TESource.counted`). Not for Float8BlockScaling.

Nothing on the per-step path syncs with the host; hooks observe only FP8 forwards with grad
enabled (not eval passes, not BF16-fallback regions, not TE activation-recompute passes).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from fp8guard.agent.errors import ConfigError, SourceUnavailable
from fp8guard.agent.fp8 import Fp8Format, count_overflow_underflow, nan_ignoring_amax
from fp8guard.agent.sources.base import AMAX, HISTORY_MAX, SCALE, Source, TensorSpec

__all__ = ["BoundarySlots", "ExactCounts", "TESource", "discover", "te_current_scale"]

log = logging.getLogger("fp8guard.agent")

BoundarySlots = Literal["auto", "all", "none"]
"""Output / grad_input slots: ``auto`` keeps those whose history is nonzero at attach."""
ExactCounts = Literal["auto", "inspect", "hooks"]
"""How exact counts are taken; ``auto``: ``inspect`` where TE's debug tools import, else ``hooks``."""

_Side = Literal["fwd", "bwd"]
_FP32_MAX = float(torch.finfo(torch.float32).max)
_POW2_MASK = -8388608
"""0xFF800000 as int32: keeps sign and exponent, i.e. TE's round-down to a power of two."""
_WARMUP_HINT = ("run one FP8 forward (inside te.autocast), ideally a whole training step, "
                "before Monitor.attach")
_HOOK_RECIPES = ("float8_current_scaling", "float8_block_scaling")
_AMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_RECIPE_CHECKS = ("delayed", "float8_current_scaling", "float8_block_scaling", "mxfp8", "nvfp4", "custom")
# (side, position) of one GEMM's operands, in column order.
_OPERANDS: tuple[tuple[_Side, str], ...] = (
    ("fwd", "input"), ("fwd", "weight"), ("fwd", "output"), ("bwd", "grad_output"), ("bwd", "grad_input"))
_SIDES: tuple[_Side, _Side] = ("fwd", "bwd")
_FWD_POS = ("input", "weight", "output")
_BWD_POS = ("grad_output", "grad_input")
_BOUNDARY = ("output", "grad_input")


# -- Transformer Engine access ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _TE:
    """The parts of Transformer Engine 2.x this source touches."""

    kinds: tuple[tuple[type, str], ...]
    """(class, kind) pairs, most specific first."""
    skipped: tuple[type, ...]
    """TE modules with FP8 state that are deliberately not monitored (attention)."""
    quantized: tuple[type, ...]
    fp8_enabled: Callable[[], bool]
    recompute_phase: Callable[[], bool]
    compute_amax: Callable[[torch.Tensor, torch.Tensor], None] | None
    autocast: Callable[..., Any]
    """``te.autocast`` (2.x; ``fp8_autocast`` before), used for the BF16 fallback."""


def _load_te(required: bool) -> _TE | None:
    """Import TE, or None when it is absent and not required.

    A model can hold TE modules only once TE was imported, so without ``required`` an
    un-imported TE means "no TE modules" and costs no import.
    """
    if not required and "transformer_engine.pytorch" not in sys.modules:
        return None
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.pytorch.distributed import in_fp8_activation_recompute_phase
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except Exception as exc:  # ImportError, or a TE whose extension does not load
        if required:
            raise SourceUnavailable(
                f"source 'te' needs Transformer Engine: pip install 'fp8guard[te]' ({exc})") from exc
        return None
    kinds: list[tuple[type, str]] = [
        (te.LayerNormMLP, "layernorm_mlp"), (te.LayerNormLinear, "layernorm_linear"),
        (te.GroupedLinear, "grouped_linear"), (te.Linear, "linear")]
    basic_linear = getattr(getattr(te, "ops", None), "BasicLinear", None)
    if isinstance(basic_linear, type):
        kinds.append((basic_linear, "ops_linear"))
    skipped = tuple(t for t in (getattr(te, "DotProductAttention", None),) if isinstance(t, type))
    quantized = tuple(t for t in (getattr(te, "QuantizedTensorStorage", None), getattr(te, "QuantizedTensor", None))
                      if isinstance(t, type))
    compute_amax: Callable[[torch.Tensor, torch.Tensor], None] | None = None
    try:
        import transformer_engine_torch as tex

        compute_amax = getattr(tex, "compute_amax", None)
    except Exception:  # the torch fallback below gives the same value, with one more pass
        compute_amax = None
    return _TE(kinds=tuple(kinds), skipped=skipped, quantized=quantized,
               fp8_enabled=FP8GlobalStateManager.is_fp8_enabled,
               recompute_phase=in_fp8_activation_recompute_phase, compute_amax=compute_amax,
               autocast=getattr(te, "autocast", None) or te.fp8_autocast)


def _kind_of(module: nn.Module, te: _TE) -> str | None:
    for cls, kind in te.kinds:
        if isinstance(module, cls):
            return kind
    return None


def _state(module: nn.Module, kind: str, side: _Side) -> Any:
    """TE's RecipeState of one direction, or None before the first FP8 forward."""
    key = f"scaling_{side}"
    if kind == "ops_linear":
        metas = getattr(module, "_fp8_metas", None)
        meta = metas.get("forward" if side == "fwd" else "backward") if metas else None
        return meta.get(key) if meta else None
    fp8_meta = getattr(module, "fp8_meta", None)
    return fp8_meta.get(key) if isinstance(fp8_meta, dict) else None


def _quantizer(module: nn.Module, side: _Side, slot: int) -> Any:
    try:
        quantizers: Any = getattr(module, "quantizers", None)
        return quantizers[f"scaling_{side}"][slot]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None


def _recipe_family(state: Any) -> str:
    recipe = getattr(state, "recipe", None)
    for name in _RECIPE_CHECKS:
        check = getattr(recipe, name, None)
        if callable(check) and check():
            return name
    return type(recipe).__name__ if recipe is not None else type(state).__name__


def _num_gemms(module: nn.Module, kind: str) -> int:
    if kind == "layernorm_mlp":
        return 2
    if kind == "grouped_linear":
        return int(getattr(module, "num_gemms", 1))
    return 1


def _gemm_suffix(kind: str, gemm: int) -> str:
    if kind == "layernorm_mlp":
        return (".fc1", ".fc2")[gemm]
    if kind == "grouped_linear":
        return f".gemm{gemm}"
    return ""


def _slot(kind: str, side: _Side, gemm: int, pos: str) -> int | None:
    """TE's quantizer slot of an operand (None: the module has no such slot)."""
    if kind == "ops_linear":  # BasicLinear: forward [input, weight], backward [grad_output]
        return {"input": 0, "weight": 1}.get(pos) if side == "fwd" else (0 if pos == "grad_output" else None)
    if side == "fwd":
        return 3 * gemm + _FWD_POS.index(pos)
    return 2 * gemm + _BWD_POS.index(pos)


def _te_roles(module: nn.Module, kind: str, side: _Side, n: int) -> list[Any] | None:
    """``get_quantizer_roles()`` of one direction; None where the module has none."""
    get_roles: Any = getattr(module, "get_quantizer_roles", None)
    try:
        if kind == "ops_linear":
            roles = get_roles("forward" if side == "fwd" else "backward")
        else:
            roles = get_roles(fwd=side == "fwd", num_quantizers=n)
    except Exception:  # older TE, or a module that does not describe its slots
        return None
    return list(roles) if roles is not None and len(roles) == n else None


def _weights(module: nn.Module, kind: str, gemm: int) -> list[Any]:
    """The weight tensors a GEMM quantizes (a split Linear weight is one quantized tensor)."""
    if kind == "layernorm_mlp":
        return [getattr(module, ("fc1_weight", "fc2_weight")[gemm], None)]
    if kind == "grouped_linear":
        return [getattr(module, f"weight{gemm}", None)]
    return [getattr(module, name, None) for name in getattr(module, "weight_names", ("weight",))]


def _hook_operands(kind: str, num_gemms: int) -> list[tuple[int, _Side, str]]:
    """(gemm, side, position) of the operands module hooks can see, per module kind."""
    if kind == "linear":
        return [(0, "fwd", "input"), (0, "fwd", "weight"), (0, "bwd", "grad_output")]
    if kind == "layernorm_linear":  # its GEMM input is the LayerNorm output, made inside TE
        return [(0, "fwd", "weight"), (0, "bwd", "grad_output")]
    if kind == "layernorm_mlp":  # fc2's grad_output is the grad of the module output
        return [(0, "fwd", "weight"), (1, "fwd", "weight"), (1, "bwd", "grad_output")]
    if kind == "grouped_linear":  # m_splits live on the device: inputs/grads cannot be split without a sync
        return [(g, "fwd", "weight") for g in range(num_gemms)]
    return []  # te.ops: fused pipelines bypass the ops' own forward, so module hooks do not fire


def _format_of(recipe: Any, side: _Side) -> tuple[Fp8Format, float]:
    helper = recipe.fp8_format.value
    fp8_max = float(helper.max_fwd if side == "fwd" else helper.max_bwd)
    if fp8_max == Fp8Format.E4M3.fp8_max:
        return Fp8Format.E4M3, fp8_max
    if fp8_max == Fp8Format.E5M2.fp8_max:
        return Fp8Format.E5M2, fp8_max
    raise ConfigError(f"te source: FP8 format {recipe.fp8_format} (max {fp8_max}) is not E4M3 or E5M2")


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


# -- the source ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _Column:
    """One operand: where TE keeps it and how it is cast."""

    spec: TensorSpec
    module: nn.Module
    kind: str
    side: _Side
    slot: int
    entry: int
    """Index of (module, side) in the source's state entries (delayed scaling)."""
    fmt: Fp8Format
    pow2: bool = False
    eps: float = 0.0
    margin: float = 0.0
    hooked: bool = False
    index: int = -1
    """Column number in :meth:`TESource.tensors`."""


@dataclass(slots=True)
class _Plan:
    """How to gather the columns for one layout of history lengths (built once per layout)."""

    groups: list[tuple[int, list[int], int, int, torch.Tensor | None]]
    """(history length, entries, start, end in the concatenation, derive-divisor or None)."""
    order: list[int]
    index: torch.Tensor
    fp8_max: torch.Tensor


class TESource:
    """FP8 telemetry of a model's Transformer Engine modules. See the module docstring."""

    kind = "te"

    def __init__(self, modules: Sequence[tuple[str, nn.Module]], *,
                 boundary_slots: BoundarySlots = "auto", exact_counts: ExactCounts = "auto") -> None:
        te = _load_te(required=True)
        assert te is not None
        self._te = te
        if boundary_slots not in ("auto", "all", "none"):
            raise ConfigError(f"boundary_slots must be 'auto', 'all' or 'none', got {boundary_slots!r}")
        found = [(name, m, kind) for name, m in modules if (kind := _kind_of(m, te)) is not None]
        if not found:
            raise ConfigError("te source: no Transformer Engine GEMM modules given")
        self._switchable = [(n, m) for n, m, _ in found]
        ready = [(n, m, k) for n, m, k in found if _state(m, k, "fwd") is not None]
        if not ready:
            names = ", ".join(n or "<model>" for n, _, _ in found[:3])
            raise ConfigError(f"te source: the TE modules ({names}{', ...' if len(found) > 3 else ''}) have no "
                              f"FP8 state yet; {_WARMUP_HINT}")
        if len(ready) < len(found):
            log.warning("fp8guard: te source skips %d TE module(s) that never ran in FP8: %s",
                        len(found) - len(ready), ", ".join(n for n, m, k in found if _state(m, k, "fwd") is None))
        families = {_recipe_family(_state(m, k, "fwd")) for _, m, k in ready}
        if len(families) > 1:
            raise ConfigError(f"te source: the modules use different recipes ({sorted(families)}); "
                              "one Monitor supports one recipe family")
        family = families.pop()
        recipe = _state(ready[0][1], ready[0][2], "fwd").recipe
        self.recipe_name: str = type(recipe).__name__
        """The TE recipe class the source was built for, e.g. ``DelayedScaling``."""
        if family == "delayed":
            self._mode: Literal["state", "hooks"] = "state"
        elif family in _HOOK_RECIPES:
            self._mode = "hooks"
        else:
            raise ConfigError(
                f"te source: recipe {self.recipe_name} is not supported yet (supported: DelayedScaling, "
                "Float8CurrentScaling, Float8BlockScaling); see docs/gpu-te-source.md")
        self._block = family == "float8_block_scaling"
        self._entries: list[tuple[str, nn.Module, str, _Side]] = []
        self._columns: list[_Column] = []
        if self._mode == "state":
            self._build_state_columns(ready, boundary_slots)
        else:
            self._build_hook_columns(ready)
        if not self._columns:
            raise ConfigError(f"te source: no FP8 operand of the TE modules can be observed under {self.recipe_name}")
        for i, c in enumerate(self._columns):
            c.index = i
        self._specs = [c.spec for c in self._columns]
        n = len(self._columns)
        device = self._device()
        self._fp8_max = torch.tensor([c.spec.fp8_max for c in self._columns], dtype=torch.float32, device=device)
        self._pow2 = torch.tensor([c.pow2 for c in self._columns], dtype=torch.bool, device=device)
        self._eps = torch.tensor([c.eps for c in self._columns], dtype=torch.float32, device=device)
        self._amax = torch.zeros(n, dtype=torch.float32, device=device)
        self._counts = torch.zeros(n, 2, dtype=torch.int64, device=device)
        self._counting = False
        self._measure = self._mode == "hooks"
        self._seen = [False] * n
        self._ones = torch.ones(n, dtype=torch.float32, device=device)
        self._any_pow2 = any(c.pow2 for c in self._columns)
        self._any_eps = any(c.eps > 0 for c in self._columns)
        self._plans: dict[tuple[int, ...], _Plan] = {}
        if self._mode == "state":
            hists, scales = self._live_state()
            plan = self._plan_for(hists)
            # The scale a completed amax was measured with is the one from before the update that
            # consumed it: the scale seen at the previous read (here: at attach).
            self._scale_in_use = torch.cat([scales[e] for e in plan.order]).index_select(0, plan.index)
        else:
            self._scale_in_use = torch.ones(n, dtype=torch.float32, device=device)
        self._fp8_mask: torch.Tensor | None = None
        """1 per column in FP8, 0 where the module is in BF16 fallback (None: all in FP8)."""
        self._handles: list[Any] = []
        if exact_counts not in ("auto", "inspect", "hooks"):
            raise ConfigError(f"exact_counts must be 'auto', 'inspect' or 'hooks', got {exact_counts!r}")
        self.exact_counts: Literal["inspect", "hooks"] = (
            "inspect" if exact_counts == "inspect" or (exact_counts == "auto" and not self._block and _inspect_importable())
            else "hooks")
        """How exact counts are taken: ``inspect`` (every operand, TE's tensor-inspection API and
        fp8guard's fused kernel) or ``hooks`` (module hooks: the operands they can reach)."""
        self._inspect: Any = None
        self._inspect_open = False
        if self.exact_counts == "inspect":
            from fp8guard.agent.sources import te_inspect

            self._inspect = te_inspect.InspectCounts(self._inspect_targets(te_inspect.TENSOR_NAMES), self._counts)
        if self._mode == "hooks" or self.exact_counts == "hooks":
            self._install_hooks()

    # -- construction ---------------------------------------------------------------------------

    def _device(self) -> torch.device:
        for _, m, _, _ in self._entries:
            for p in m.parameters():
                return p.device
        for c in self._columns:
            for p in c.module.parameters():
                return p.device
        return torch.device("cuda")

    def _build_state_columns(self, ready: list[tuple[str, nn.Module, str]], boundary_slots: BoundarySlots) -> None:
        candidates: list[_Column] = []
        boundary: list[tuple[_Column, torch.Tensor]] = []
        hook_ops = {(name, g, side, pos) for name, m, kind in ready
                    for g, side, pos in _hook_operands(kind, _num_gemms(m, kind))}
        for name, m, kind in ready:
            states = {side: _state(m, kind, side) for side in _SIDES}
            if any(s is None or not hasattr(s, "amax_history") for s in states.values()):
                log.warning("fp8guard: te source skips %s: incomplete delayed-scaling state", name)
                continue
            slots = {side: int(states[side].scale.numel()) for side in _SIDES}
            gemms = _num_gemms(m, kind)
            expected = (2, 1) if kind == "ops_linear" else (3 * gemms, 2 * gemms)
            if (slots["fwd"], slots["bwd"]) != expected:
                log.warning("fp8guard: te source skips %s: %s slots, expected %s", name,
                            (slots["fwd"], slots["bwd"]), expected)
                continue
            entry: dict[str, int] = {}
            for side in _SIDES:
                entry[side] = len(self._entries)
                self._entries.append((name, m, kind, side))
            roles = {side: _te_roles(m, kind, side, slots[side]) for side in _SIDES}
            recipe = states["fwd"].recipe
            margin = float(getattr(recipe, "margin", 0))
            for g in range(gemms):
                for side, pos in _OPERANDS:
                    slot = _slot(kind, side, g, pos)
                    if slot is None:
                        continue
                    _check_role(name, roles[side], slot, pos)
                    fmt, fp8_max = _format_of(recipe, side)
                    spec = TensorSpec(module=name + _gemm_suffix(kind, g), role=f"{side}_{pos}",
                                      fp8_format=str(fmt), fp8_max=fp8_max)
                    col = _Column(spec=spec, module=m, kind=kind, side=side, slot=slot, entry=entry[side],
                                  fmt=fmt, margin=margin, hooked=(name, g, side, pos) in hook_ops)
                    candidates.append(col)
                    if pos in _BOUNDARY and boundary_slots == "auto":
                        boundary.append((col, states[side].amax_history[:, slot].amax()))
        used: set[int] = set()
        if boundary:
            # One host read at attach (never per step): which output/grad_input slots TE used so far.
            flags = torch.stack([a for _, a in boundary]).gt(0).tolist()
            used = {id(c) for (c, _), f in zip(boundary, flags, strict=True) if f}
        for col in candidates:
            pos = col.spec.role.split("_", 1)[1]
            if pos in _BOUNDARY and (boundary_slots == "none" or (boundary_slots == "auto" and id(col) not in used)):
                continue
            self._columns.append(col)

    def _build_hook_columns(self, ready: list[tuple[str, nn.Module, str]]) -> None:
        for name, m, kind in ready:
            recipe = _state(m, kind, "fwd").recipe
            ops = _hook_operands(kind, _num_gemms(m, kind))
            if not ops:
                log.info("fp8guard: te source cannot observe %s (%s) under %s", name, kind, self.recipe_name)
            for g, side, pos in ops:
                slot = _slot(kind, side, g, pos)
                if slot is None:
                    continue
                if pos == "weight" and not any(isinstance(w, torch.Tensor) and not isinstance(w, self._te.quantized)
                                               for w in _weights(m, kind, g)):
                    continue  # FP8 primary weights: never re-quantized from high precision
                fmt, fp8_max = _format_of(recipe, side)
                q = _quantizer(m, side, slot)
                spec = TensorSpec(module=name + _gemm_suffix(kind, g), role=f"{side}_{pos}",
                                  fp8_format=str(fmt), fp8_max=fp8_max)
                self._columns.append(_Column(
                    spec=spec, module=m, kind=kind, side=side, slot=slot, entry=-1, fmt=fmt,
                    pow2=bool(getattr(q, "force_pow_2_scales", False)),
                    eps=float(getattr(q, "amax_epsilon", 0.0) or 0.0), hooked=True))

    def _install_hooks(self) -> None:
        by_module: dict[int, list[_Column]] = {}
        for c in self._columns:
            if c.hooked:
                by_module.setdefault(id(c.module), []).append(c)
        for cols in by_module.values():
            module, kind = cols[0].module, cols[0].kind
            inp = next((c for c in cols if c.side == "fwd" and c.slot % 3 == 0), None)
            weights = [(c, c.slot // 3) for c in cols if c.side == "fwd" and c.slot % 3 == 1]
            grad = next((c for c in cols if c.side == "bwd"), None)
            if inp is not None or weights:
                self._handles.append(module.register_forward_pre_hook(
                    self._pre_hook(kind, inp, weights), with_kwargs=True))
            if grad is not None:
                self._handles.append(module.register_forward_hook(self._output_hook(grad)))

    # -- hooks (run inside the user's forward/backward) -------------------------------------------

    def _observing(self) -> bool:
        if not (self._measure or self._counting) or not torch.is_grad_enabled():
            return False
        return bool(self._te.fp8_enabled()) and not self._te.recompute_phase()

    def _pre_hook(self, kind: str, inp: _Column | None,
                  weights: list[tuple[_Column, int]]) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not self._observing():
                return
            if inp is not None:
                self._observe(inp, [args[0] if args else kwargs.get("inp")])
            for col, gemm in weights:
                self._observe(col, _weights(module, kind, gemm))
        return hook

    def _output_hook(self, col: _Column) -> Callable[..., None]:
        def grad_hook(grad: torch.Tensor) -> None:
            self._observe(col, [grad])

        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not self._observing():
                return
            out = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(out, torch.Tensor) and out.requires_grad:
                tensor: Any = out  # torch types register_hook loosely
                tensor.register_hook(grad_hook)  # the grad of the module output is its last GEMM's grad_output
        return hook

    def _amax_into(self, x: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst[0] = amax(x)`` with the kernel TE's own casts use (NaN skipped, inf kept)."""
        if self._te.compute_amax is not None and x.is_cuda and x.dtype in _AMAX_DTYPES:
            self._te.compute_amax(x, dst)
        else:
            dst.copy_(nan_ignoring_amax(x).reshape(1))

    def _amax_of(self, xs: list[torch.Tensor]) -> torch.Tensor:
        amax: torch.Tensor | None = None
        for x in xs:
            a = torch.zeros(1, dtype=torch.float32, device=x.device)
            self._amax_into(x, a)
            amax = a if amax is None else torch.maximum(amax, a)
        assert amax is not None
        return amax

    def _observe(self, col: _Column, tensors: Sequence[Any]) -> None:
        xs = [t.detach() for t in tensors
              if isinstance(t, torch.Tensor) and not isinstance(t, self._te.quantized) and t.numel() > 0]
        if not xs:
            return
        i = col.index
        amax: torch.Tensor | None = None
        if self._mode == "hooks":
            acc = self._amax[i:i + 1]
            if len(xs) == 1 and not self._seen[i]:
                # First cast of this operand since the last read: TE's amax kernel writes straight
                # into the accumulator (zeroed at read), two launches per operand and step.
                self._amax_into(xs[0], acc)
                amax = acc
            else:  # later micro-batches, split weights: max-accumulate
                amax = self._amax_of(xs)
                torch.maximum(acc, amax, out=acc)
            self._seen[i] = True
        if not self._counting:
            return
        if self._mode == "state":
            scale = _state(col.module, col.kind, col.side).scale[col.slot:col.slot + 1]  # the live scale of this cast
        else:
            assert amax is not None
            scale = te_current_scale(amax, col.spec.fp8_max, col.pow2, col.eps)
        for x in xs:
            self._counts[i].add_(count_overflow_underflow(x, scale, col.fmt))

    # -- Source protocol ---------------------------------------------------------------------------

    def tensors(self) -> Sequence[TensorSpec]:
        return self._specs

    @property
    def counted(self) -> tuple[bool, ...]:
        """Per column: whether exact counts are measured (False: the count stays 0)."""
        if self._inspect is not None:
            indexes = {t.index for t in self._inspect.targets.values()}
            return tuple(c.index in indexes for c in self._columns)
        return tuple(c.hooked and not self._block for c in self._columns)

    def _inspect_targets(self, names: dict[str, str]) -> dict[tuple[str, str], tuple[int, Fp8Format]]:
        """(TE debug layer name, TE tensor name) -> (column, format) for every countable operand."""
        targets: dict[tuple[str, str], tuple[int, Fp8Format]] = {}
        owners: dict[str, str] = {}
        for c in self._columns:
            tensor_name = names.get(c.spec.role)
            if tensor_name is None or c.kind not in ("linear", "layernorm_linear", "layernorm_mlp"):
                continue  # GroupedLinear splits on the device; te.ops has no debug path
            te_name = getattr(c.module, "name", None)
            if not isinstance(te_name, str) or not te_name:
                raise ConfigError(f"te source: {c.spec.module} has no TE module name; exact counts need one "
                                  "(TE names modules itself unless name=None is forced)")
            qualified = c.spec.module[:-4] if c.kind == "layernorm_mlp" else c.spec.module
            if owners.setdefault(te_name, qualified) != qualified:
                raise ConfigError(f"te source: TE modules {owners[te_name]} and {qualified} share the name "
                                  f"{te_name!r}; exact counts tell operands apart by TE's module names: give "
                                  "them unique name= arguments")
            layer = te_name + (c.spec.module[-4:] if c.kind == "layernorm_mlp" else "")
            targets[(layer, tensor_name)] = (c.index, c.fmt)
        return targets

    def prepare_step(self, step: int, count_every: int) -> None:
        """Called by the Monitor before each step: the step number and the counting cadence
        (0: this rank never counts). Opens TE's debug session the first time counting is due."""
        counter = self._inspect
        if counter is None:
            return
        if count_every > 0 and not self._inspect_open:
            from fp8guard.agent.sources import te_inspect

            te_inspect.attach(counter)
            self._inspect_open = True
        changed = count_every != counter.every
        counter.every = count_every
        if self._inspect_open and counter.owning:
            from fp8guard.agent.sources import te_inspect

            # A new cadence invalidates the 'next debug iteration' TE cached from the old one.
            te_inspect.set_iteration(step, self._switchable, requery=changed)

    def _live_state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        hists: list[torch.Tensor] = []
        scales: list[torch.Tensor] = []
        for name, m, kind, side in self._entries:
            st = _state(m, kind, side)
            hist, scale = getattr(st, "amax_history", None), getattr(st, "scale", None)
            if not isinstance(hist, torch.Tensor) or not isinstance(scale, torch.Tensor):
                raise RuntimeError(f"te source: the delayed-scaling state of {name} is gone (recipe changed or "
                                   "FP8 state reset after attach); attach a new Monitor")
            hists.append(hist)
            scales.append(scale)
        return hists, scales

    def _plan_for(self, hists: list[torch.Tensor]) -> _Plan:
        key = tuple(int(h.shape[0]) for h in hists)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        # Built at attach, and again only if TE reallocates a history with a new length
        # (adjust_amax_history_length): the small host-to-device copies below happen then only.
        by_len: dict[int, list[int]] = {}
        for e, length in enumerate(key):
            by_len.setdefault(length, []).append(e)
        sizes = [int(self._state_scale_numel(e)) for e in range(len(self._entries))]
        device = self._device()
        groups: list[tuple[int, list[int], int, int, torch.Tensor | None]] = []
        order: list[int] = []
        offset: dict[int, int] = {}
        per_pos_max: list[float] = []
        per_pos_div: list[float] = []
        start = 0
        for length, members in by_len.items():
            end = start
            for e in members:
                offset[e] = end
                end += sizes[e]
                order.append(e)
            groups.append((length, members, start, end, None))
            start = end
        per_pos_max = [1.0] * start
        per_pos_div = [1.0] * start
        for c in self._columns:
            per_pos_max[offset[c.entry] + c.slot] = c.spec.fp8_max
            per_pos_div[offset[c.entry] + c.slot] = 2.0 ** c.margin
        fp8_max = torch.tensor(per_pos_max, dtype=torch.float32, device=device)
        div = torch.tensor(per_pos_div, dtype=torch.float32, device=device)
        groups = [(length, members, s, e, div[s:e] if length == 1 else None)
                  for length, members, s, e, _ in groups]
        index = torch.tensor([offset[c.entry] + c.slot for c in self._columns], dtype=torch.long, device=device)
        plan = _Plan(groups=groups, order=order, index=index, fp8_max=fp8_max)
        self._plans[key] = plan
        return plan

    def _state_scale_numel(self, e: int) -> int:
        _, m, kind, side = self._entries[e]
        return int(_state(m, kind, side).scale.numel())

    def read(self, out: torch.Tensor) -> None:
        with torch.no_grad():  # plain reads of TE's buffers, whatever the caller's grad mode
            self._read(out)

    def _read(self, out: torch.Tensor) -> None:
        if self._mode == "hooks":
            amax = self._amax
            out[AMAX].copy_(amax)
            out[HISTORY_MAX].copy_(amax)  # no history under current/block scaling: the window is this step
            self._write_scale(amax, out[SCALE])
            amax.zero_()
            self._seen = [False] * len(self._seen)
            return
        hists, scales = self._live_state()
        plan = self._plan_for(hists)
        scale_now = torch.cat([scales[e] for e in plan.order]) if len(plan.order) > 1 else scales[plan.order[0]]
        latest: list[torch.Tensor] = []
        hmax: list[torch.Tensor] = []
        for length, members, start, end, div in plan.groups:
            if length == 1:
                # TE zeroes the only row right after using it: recover the amax from the new scale.
                assert div is not None
                derived = plan.fp8_max[start:end] / (scale_now[start:end] * div)
                latest.append(derived)
                hmax.append(derived)
                continue
            h = torch.cat([hists[e] for e in members], dim=1) if len(members) > 1 else hists[members[0]]
            latest.append(h[-1])
            hmax.append(h.amax(dim=0))
        all_latest = torch.cat(latest) if len(latest) > 1 else latest[0]
        all_hmax = torch.cat(hmax) if len(hmax) > 1 else hmax[0]
        torch.index_select(all_latest, 0, plan.index, out=out[AMAX])
        torch.index_select(all_hmax, 0, plan.index, out=out[HISTORY_MAX])
        out[SCALE].copy_(self._scale_in_use)
        torch.index_select(scale_now, 0, plan.index, out=self._scale_in_use)
        if self._fp8_mask is not None:
            # A module in BF16 measures nothing, but TE keeps its old history rows (the outlier
            # that caused the fallback among them): report no amax rather than a stale one.
            out[AMAX].mul_(self._fp8_mask)
            out[HISTORY_MAX].mul_(self._fp8_mask)

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

    @property
    def supports_counts(self) -> bool:
        if self._inspect is not None:
            return bool(self._inspect.targets)
        return not self._block and any(c.hooked for c in self._columns)

    def arm_counts(self, enabled: bool) -> None:
        if self._inspect is not None:
            self._inspect.armed = enabled and self._inspect_open and self.supports_counts
            return
        self._counting = enabled and self.supports_counts

    def read_counts(self, out: torch.Tensor) -> None:
        out.copy_(self._counts.t())
        self._counts.zero_()

    def set_fp8(self, modules: Sequence[str] | None, enabled: bool) -> None:
        """BF16 fallback (``enabled=False``) or re-promotion of TE modules (None: all of them).

        Fallback wraps the module's forward in a nested ``te.autocast(enabled=False)`` (TE
        saves and restores the outer autocast state, so nesting is supported). Re-promotion
        removes the wrapper and calls TE's ``reset_fp8_meta_tensors()``: while in BF16 the
        module's history only rolled zeros, so its scale is stale (frozen at the pre-fallback
        window) and must not be reused. A name may also be a GEMM of a module
        (``<module>.fc1``): the whole module switches, as TE switches precision per module.
        """
        wanted = None if modules is None else set(modules)
        for name, module in self._switchable:
            if wanted is not None and not any(w == name or w.startswith(name + ".") for w in wanted):
                continue
            self._switch(module, enabled, reset=True)
        self._update_fp8_mask()

    def _switch(self, module: nn.Module, enabled: bool, *, reset: bool) -> None:
        wrapped = "_fp8guard_forward" in module.__dict__
        if not enabled and not wrapped:
            original = module.forward
            autocast = self._te.autocast

            def forward(*args: Any, _original: Any = original, _autocast: Any = autocast, **kwargs: Any) -> Any:
                with _autocast(enabled=False):
                    return _original(*args, **kwargs)

            module.__dict__["_fp8guard_forward"] = original
            module.__dict__["forward"] = forward
        elif enabled and wrapped:
            del module.__dict__["forward"]
            del module.__dict__["_fp8guard_forward"]
            reset_meta = getattr(module, "reset_fp8_meta_tensors", None)
            if reset and callable(reset_meta):
                reset_meta()

    def precision(self) -> dict[str, bool]:
        return {name: "_fp8guard_forward" not in m.__dict__ for name, m in self._switchable}

    def settle(self, modules: Collection[str]) -> None:
        """TE updates forward scales itself when the probe forward's autocast exits."""

    @contextmanager
    def probe(self, fp8: Mapping[str, bool]) -> Iterator[None]:
        """Probe forwards run under ``no_grad`` (this source's hooks skip them). Under delayed
        scaling the autocast a probe forward enters updates TE's amax histories and scales when it
        exits: they are cloned before and copied back after (a few device copies, no sync).
        Counting is disarmed meanwhile, and no module's FP8 state is reset by the switching."""
        saved = [(h, h.clone()) for pair in zip(*self._live_state(), strict=True) for h in pair] \
            if self._entries else []
        mask, armed = self._fp8_mask, (self._inspect.armed if self._inspect is not None else None)
        before = self.precision()
        if self._inspect is not None:
            self._inspect.armed = False
        try:
            for name, module in self._switchable:
                if name in fp8:
                    # a trial (a module held in BF16, tried in FP8) starts fresh, as a re-promotion would
                    self._switch(module, fp8[name], reset=fp8[name] and not before[name])
            yield
        finally:
            for name, module in self._switchable:
                self._switch(module, before[name], reset=False)
            with torch.no_grad():
                for live, copy in saved:
                    live.copy_(copy)
            self._fp8_mask = mask
            if self._inspect is not None and armed is not None:
                self._inspect.armed = armed

    def _update_fp8_mask(self) -> None:
        in_bf16 = {id(m) for _, m in self._switchable if "_fp8guard_forward" in m.__dict__}
        if not in_bf16:
            self._fp8_mask = None
            return
        flags = [0.0 if id(c.module) in in_bf16 else 1.0 for c in self._columns]
        # a host-to-device copy at a fallback or promotion only, never per step
        self._fp8_mask = torch.tensor(flags, dtype=torch.float32, device=self._device())

    def stop_counting(self) -> None:
        """Leave TE's debug path for good (monitor closed or switched off): TE is told that no
        counting is ever due again, so its layers stay on the normal fused path."""
        if self._inspect is not None and self._inspect_open:
            from fp8guard.agent.sources import te_inspect

            te_inspect.detach(self._inspect)
            self._inspect_open = False
            if self._inspect.owning:
                te_inspect.bump_iteration(self._switchable)

    def close(self) -> None:
        """Remove the module hooks (the source reads nothing afterwards)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._measure = self._counting = False
        self.stop_counting()


def _check_role(name: str, roles: list[Any] | None, slot: int, pos: str) -> None:
    """Cross-check TE's slot layout against ``get_quantizer_roles()``.

    Output/grad_input slots are labelled by TE with their *consumer* (e.g. LayerNormMLP's fc1
    output slot says "input of fc2"), so only the GEMM's own operands are compared.
    """
    if roles is None or pos in _BOUNDARY or slot >= len(roles) or roles[slot] is None:
        return
    tensor_type = getattr(roles[slot], "tensor_type", "")
    if tensor_type and tensor_type != pos:
        log.warning("fp8guard: te source: %s slot %d is %r by TE's layout but %r by get_quantizer_roles()",
                    name, slot, pos, tensor_type)


def _inspect_importable() -> bool:
    try:
        import nvdlfw_inspect.api  # noqa: F401
        import transformer_engine.debug.pytorch.debug_state  # noqa: F401
    except Exception:  # absent, or a TE without its debug tools
        return False
    return True


def discover(model: nn.Module, *, required: bool, boundary_slots: BoundarySlots = "auto",
             exact_counts: ExactCounts = "auto") -> Source | None:
    """A source over the model's TE modules, or None when the model has none.

    Raises :class:`SourceUnavailable` when ``required`` and TE cannot be imported, and
    :class:`ConfigError` when the model has TE modules but no FP8 state yet (run one FP8 step
    first) or uses a recipe this source does not support.
    """
    te = _load_te(required)
    if te is None:
        return None
    found: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if _kind_of(m, te) is not None:
            found.append((name, m))
        elif isinstance(m, te.skipped) and "scaling_fwd" in (getattr(m, "fp8_meta", None) or {}):
            log.info("fp8guard: te source does not monitor FP8 attention (%s)", name)
    if not found:
        return None
    return TESource(found, boundary_slots=boundary_slots, exact_counts=exact_counts)
