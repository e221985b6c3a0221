"""Access to Transformer Engine: the one place the TE source imports ``transformer_engine``, and
the one seam through which tests give it a stand-in.

:func:`load_te` returns :class:`TEApi`, the few parts of TE 2.x the source touches (module
classes, the FP8/recompute state queries, TE's amax kernel, ``te.autocast``). It builds them from
the ``transformer_engine.pytorch`` module handle (:func:`api_from`), so a stand-in only has to
expose the same attributes::

    with te_access.substitute(fake_te_pytorch):   # tests: the source runs over fake modules on CPU
        source = te.discover(model, required=True)

A stand-in proves the source's own logic (column layout, reads, switching), never TE's
behaviour on a GPU: that is what ``tests/agent/test_te_source_*.py`` check on a real one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from fp8guard.agent.errors import SourceUnavailable

__all__ = ["TEApi", "api_from", "inspect_importable", "load_te", "substitute"]


@dataclass(frozen=True, slots=True)
class TEApi:
    """The parts of Transformer Engine 2.x the TE source touches."""

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
    real: bool = True
    """False for a stand-in (:func:`substitute`): TE's debug tools are then never used."""


_substitute: TEApi | None = None


def api_from(te: Any, *, tex: Any = None, real: bool = True) -> TEApi:
    """:class:`TEApi` from a ``transformer_engine.pytorch`` handle (``te``) and, optionally, the
    ``transformer_engine_torch`` extension (``tex``, for its amax kernel)."""
    kinds: list[tuple[type, str]] = [
        (te.LayerNormMLP, "layernorm_mlp"), (te.LayerNormLinear, "layernorm_linear"),
        (te.GroupedLinear, "grouped_linear"), (te.Linear, "linear")]
    basic_linear = getattr(getattr(te, "ops", None), "BasicLinear", None)
    if isinstance(basic_linear, type):
        kinds.append((basic_linear, "ops_linear"))
    skipped = tuple(t for t in (getattr(te, "DotProductAttention", None),) if isinstance(t, type))
    quantized = tuple(t for t in (getattr(te, "QuantizedTensorStorage", None), getattr(te, "QuantizedTensor", None))
                      if isinstance(t, type))
    return TEApi(kinds=tuple(kinds), skipped=skipped, quantized=quantized,
                 fp8_enabled=te.quantization.FP8GlobalStateManager.is_fp8_enabled,
                 recompute_phase=te.distributed.in_fp8_activation_recompute_phase,
                 compute_amax=getattr(tex, "compute_amax", None) if tex is not None else None,
                 autocast=getattr(te, "autocast", None) or te.fp8_autocast, real=real)


def load_te(required: bool) -> TEApi | None:
    """TE's parts, or None when TE is absent and not required.

    A model can hold TE modules only once TE was imported, so without ``required`` an
    un-imported TE means "no TE modules" and costs no import. Under :func:`substitute` the
    stand-in is returned whatever is installed.
    """
    if _substitute is not None:
        return _substitute
    if not required and "transformer_engine.pytorch" not in sys.modules:
        return None
    try:
        import transformer_engine.pytorch as te
        import transformer_engine.pytorch.distributed
        import transformer_engine.pytorch.quantization  # noqa: F401  (api_from reads both submodules)
    except Exception as exc:  # ImportError, or a TE whose extension does not load
        if required:
            raise SourceUnavailable(
                f"source 'te' needs Transformer Engine: pip install 'fp8guard[te]' ({exc})") from exc
        return None
    try:
        import transformer_engine_torch as tex
    except Exception:  # the torch fallback gives the same amax, with one more pass
        tex = None
    return api_from(te, tex=tex)


@contextmanager
def substitute(te: Any, *, tex: Any = None) -> Iterator[TEApi]:
    """Inside: the TE source reads ``te`` (a stand-in with the attributes of
    ``transformer_engine.pytorch`` that :func:`api_from` reads) instead of Transformer Engine."""
    global _substitute
    previous = _substitute
    _substitute = api_from(te, tex=tex, real=False)
    try:
        yield _substitute
    finally:
        _substitute = previous


def inspect_importable(api: TEApi) -> bool:
    """Whether TE's tensor-inspection tools (nvdlfw-inspect, TE's debug package) import."""
    if not api.real:
        return False
    try:
        import nvdlfw_inspect.api  # noqa: F401
        import transformer_engine.debug.pytorch.debug_state  # noqa: F401
    except Exception:  # absent, or a TE without its debug tools
        return False
    return True
