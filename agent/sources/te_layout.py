"""Where Transformer Engine keeps each FP8 GEMM operand of a module, and how it is cast.

Shared by the recipe families of the TE source (:mod:`te_delayed`, :mod:`te_current`): module
kinds, TE's quantizer slot layout (forward ``[input, weight, output]`` and backward
``[grad_output, grad_input]`` per GEMM), column labels, formats and maxima from the recipe, and
the :class:`Column` record of one operand. Reads module attributes only: no device work.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from fp8guard.agent.errors import ConfigError
from fp8guard.agent.fp8 import Fp8Format
from fp8guard.agent.sources.base import TensorSpec
from fp8guard.agent.sources.te_access import TEApi

__all__ = ["BOUNDARY", "OPERANDS", "SIDES", "Column", "Side", "check_role", "format_of", "gemm_suffix",
           "hook_operands", "kind_of", "num_gemms", "quantizer", "recipe_family", "slot_of", "state_of",
           "te_roles", "weights_of"]

log = logging.getLogger("fp8guard.agent")

Side = Literal["fwd", "bwd"]
_RECIPE_CHECKS = ("delayed", "float8_current_scaling", "float8_block_scaling", "mxfp8", "nvfp4", "custom")
OPERANDS: tuple[tuple[Side, str], ...] = (
    ("fwd", "input"), ("fwd", "weight"), ("fwd", "output"), ("bwd", "grad_output"), ("bwd", "grad_input"))
"""(side, position) of one GEMM's operands, in column order."""
SIDES: tuple[Side, Side] = ("fwd", "bwd")
_FWD_POS = ("input", "weight", "output")
_BWD_POS = ("grad_output", "grad_input")
BOUNDARY = ("output", "grad_input")
"""Slots TE uses only with ``fp8_output`` / ``fp8_grad``."""


@dataclass(slots=True)
class Column:
    """One operand: where TE keeps it and how it is cast."""

    spec: TensorSpec
    module: nn.Module
    kind: str
    side: Side
    slot: int
    entry: int
    """Index of (module, side) in the delayed-scaling reader's state entries (-1: none)."""
    fmt: Fp8Format
    pow2: bool = False
    eps: float = 0.0
    margin: float = 0.0
    hooked: bool = False
    index: int = -1
    """Column number in :meth:`TESource.tensors`."""


def kind_of(module: nn.Module, te: TEApi) -> str | None:
    for cls, kind in te.kinds:
        if isinstance(module, cls):
            return kind
    return None


def state_of(module: nn.Module, kind: str, side: Side) -> Any:
    """TE's RecipeState of one direction, or None before the first FP8 forward."""
    key = f"scaling_{side}"
    if kind == "ops_linear":
        metas = getattr(module, "_fp8_metas", None)
        meta = metas.get("forward" if side == "fwd" else "backward") if metas else None
        return meta.get(key) if meta else None
    fp8_meta = getattr(module, "fp8_meta", None)
    return fp8_meta.get(key) if isinstance(fp8_meta, dict) else None


def quantizer(module: nn.Module, side: Side, slot: int) -> Any:
    try:
        quantizers: Any = getattr(module, "quantizers", None)
        return quantizers[f"scaling_{side}"][slot]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None


def recipe_family(state: Any) -> str:
    recipe = getattr(state, "recipe", None)
    for name in _RECIPE_CHECKS:
        check = getattr(recipe, name, None)
        if callable(check) and check():
            return name
    return type(recipe).__name__ if recipe is not None else type(state).__name__


def num_gemms(module: nn.Module, kind: str) -> int:
    if kind == "layernorm_mlp":
        return 2
    if kind == "grouped_linear":
        return int(getattr(module, "num_gemms", 1))
    return 1


def gemm_suffix(kind: str, gemm: int) -> str:
    if kind == "layernorm_mlp":
        return (".fc1", ".fc2")[gemm]
    if kind == "grouped_linear":
        return f".gemm{gemm}"
    return ""


def slot_of(kind: str, side: Side, gemm: int, pos: str) -> int | None:
    """TE's quantizer slot of an operand (None: the module has no such slot)."""
    if kind == "ops_linear":  # BasicLinear: forward [input, weight], backward [grad_output]
        return {"input": 0, "weight": 1}.get(pos) if side == "fwd" else (0 if pos == "grad_output" else None)
    if side == "fwd":
        return 3 * gemm + _FWD_POS.index(pos)
    return 2 * gemm + _BWD_POS.index(pos)


def te_roles(module: nn.Module, kind: str, side: Side, n: int) -> list[Any] | None:
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


def check_role(name: str, roles: list[Any] | None, slot: int, pos: str) -> None:
    """Cross-check TE's slot layout against ``get_quantizer_roles()``.

    Output/grad_input slots are labelled by TE with their *consumer* (e.g. LayerNormMLP's fc1
    output slot says "input of fc2"), so only the GEMM's own operands are compared.
    """
    if roles is None or pos in BOUNDARY or slot >= len(roles) or roles[slot] is None:
        return
    tensor_type = getattr(roles[slot], "tensor_type", "")
    if tensor_type and tensor_type != pos:
        log.warning("fp8guard: te source: %s slot %d is %r by TE's layout but %r by get_quantizer_roles()",
                    name, slot, pos, tensor_type)


def weights_of(module: nn.Module, kind: str, gemm: int) -> list[Any]:
    """The weight tensors a GEMM quantizes (a split Linear weight is one quantized tensor)."""
    if kind == "layernorm_mlp":
        return [getattr(module, ("fc1_weight", "fc2_weight")[gemm], None)]
    if kind == "grouped_linear":
        return [getattr(module, f"weight{gemm}", None)]
    return [getattr(module, name, None) for name in getattr(module, "weight_names", ("weight",))]


def hook_operands(kind: str, gemms: int) -> list[tuple[int, Side, str]]:
    """(gemm, side, position) of the operands module hooks can see, per module kind."""
    if kind == "linear":
        return [(0, "fwd", "input"), (0, "fwd", "weight"), (0, "bwd", "grad_output")]
    if kind == "layernorm_linear":  # its GEMM input is the LayerNorm output, made inside TE
        return [(0, "fwd", "weight"), (0, "bwd", "grad_output")]
    if kind == "layernorm_mlp":  # fc2's grad_output is the grad of the module output
        return [(0, "fwd", "weight"), (1, "fwd", "weight"), (1, "bwd", "grad_output")]
    if kind == "grouped_linear":  # m_splits live on the device: inputs/grads cannot be split without a sync
        return [(g, "fwd", "weight") for g in range(gemms)]
    return []  # te.ops: fused pipelines bypass the ops' own forward, so module hooks do not fire


def format_of(recipe: Any, side: Side) -> tuple[Fp8Format, float]:
    helper = recipe.fp8_format.value
    fp8_max = float(helper.max_fwd if side == "fwd" else helper.max_bwd)
    if fp8_max == Fp8Format.E4M3.fp8_max:
        return Fp8Format.E4M3, fp8_max
    if fp8_max == Fp8Format.E5M2.fp8_max:
        return Fp8Format.E5M2, fp8_max
    raise ConfigError(f"te source: FP8 format {recipe.fp8_format} (max {fp8_max}) is not E4M3 or E5M2")
