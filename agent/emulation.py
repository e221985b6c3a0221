"""CPU (and any-device) emulation of Transformer Engine's DelayedScaling FP8 recipe for ``nn.Linear``.

Usage::

    emu = emulate_fp8(model, EmulationConfig(amax_history_len=16))
    for batch in data:
        loss = loss_fn(model(batch))
        loss.backward()
        emu.update()          # once per forward/backward pair, see Fp8Emulation.update
        opt.step(); opt.zero_grad()

Under a :class:`~fp8guard.agent.Monitor` the ``emu.update()`` line is not needed: ``monitor.step``
closes the step itself when the loop has not (no FP8 forward since the last update), as TE does
at the end of its autocast and backward. Call it before ``monitor.step`` or not at all.

Numerics per emulated linear (TE's slot layout, casts and GEMMs): :mod:`fp8guard.agent.emulated_linear`.

Nothing on the per-step path syncs with the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from .emulated_linear import BWD_SLOTS, FWD_SLOTS, Fp8EmulatedLinear, update_fp8_state
from .fp8 import Fp8Format

__all__ = [
    "BWD_SLOTS",
    "FWD_SLOTS",
    "EmulationConfig",
    "Fp8EmulatedLinear",
    "Fp8Emulation",
    "emulate_fp8",
    "update_fp8_state",
]

_FP8_FORMATS = ("hybrid", "e4m3")


@dataclass(kw_only=True, slots=True)
class EmulationConfig:
    """Knobs of the emulated DelayedScaling recipe (names and defaults follow TE)."""

    margin: int = 0
    """Scale is ``fp8_max / amax / 2**margin``; a larger margin leaves more headroom."""
    amax_history_len: int = 1024
    """Rows of amax history kept per slot (TE default 1024)."""
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    """How the history reduces to one amax: max over all rows, or the most recent step only."""
    fp8_format: Literal["hybrid", "e4m3"] = "hybrid"
    """"hybrid": E4M3 forward, E5M2 backward (TE's HYBRID); "e4m3": E4M3 everywhere."""
    module_filter: Callable[[str, nn.Linear], bool] | None = None
    """Called with (qualified name, module); return False to leave that Linear in high precision."""

    def __post_init__(self) -> None:
        if isinstance(self.margin, bool) or not isinstance(self.margin, int):
            raise ValueError(f"margin must be an int (power-of-two headroom), got {self.margin!r}")
        if (
            isinstance(self.amax_history_len, bool)
            or not isinstance(self.amax_history_len, int)
            or self.amax_history_len < 1
        ):
            raise ValueError(
                f"amax_history_len must be an int >= 1 (TE's default is 1024), got {self.amax_history_len!r}"
            )
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}"
            )
        if self.fp8_format not in _FP8_FORMATS:
            given: object = self.fp8_format
            hint = " (TE does not support E5M2 in the forward pass)" if given == "e5m2" else ""
            raise ValueError(f"fp8_format must be 'hybrid' or 'e4m3', got {given!r}{hint}")
        if self.module_filter is not None and not callable(self.module_filter):
            raise ValueError("module_filter must be a callable (name, module) -> bool, or None")

    @property
    def fwd_format(self) -> Fp8Format:
        """FP8 format of the forward casts (always E4M3)."""
        return Fp8Format.E4M3

    @property
    def bwd_format(self) -> Fp8Format:
        """FP8 format of the backward casts (E5M2 for "hybrid")."""
        return Fp8Format.E5M2 if self.fp8_format == "hybrid" else Fp8Format.E4M3


def _is_plain_linear(m: nn.Module) -> bool:
    # Only modules whose forward *is* nn.Linear.forward: a subclass overriding forward (LoRA, ...)
    # would lose its behaviour. MultiheadAttention's out_proj never has its forward called (MHA
    # reads .weight directly), so swapping it would silently emulate nothing.
    return (
        isinstance(m, nn.Linear)
        and not isinstance(m, NonDynamicallyQuantizableLinear)
        and type(m).forward is nn.Linear.forward
    )


class Fp8Emulation:
    """Handle on a model whose Linear layers were swapped for ``Fp8EmulatedLinear``.

    Build it with :meth:`apply` (or :func:`emulate_fp8`); call :meth:`update` once per step.
    """

    def __init__(self, config: EmulationConfig, modules: list[tuple[str, Fp8EmulatedLinear]]) -> None:
        """Internal: use :meth:`apply`."""
        self._config = config
        self._modules = modules
        self._by_name = dict(modules)

    @classmethod
    def apply(cls, model: nn.Module, config: EmulationConfig | None = None) -> Fp8Emulation:
        """Swap every matching ``nn.Linear`` inside ``model`` (in place) and return the handle.

        The module objects are replaced in their parents (every parent, if one Linear is shared);
        weight/bias Parameters are reused. Hooks registered on the original Linear modules are not
        carried over. Raises ValueError if nothing matched.
        """
        cfg = config if config is not None else EmulationConfig()
        if isinstance(model, Fp8EmulatedLinear) or _is_plain_linear(model):
            raise ValueError(
                "model is itself a Linear and cannot be replaced in place; wrap it in a container "
                "(e.g. nn.Sequential(linear)) before calling emulate_fp8"
            )
        wrappers: dict[int, Fp8EmulatedLinear] = {}
        named: list[tuple[str, Fp8EmulatedLinear]] = []
        for name, mod in model.named_modules():
            if not _is_plain_linear(mod):
                continue
            lin = cast(nn.Linear, mod)
            if cfg.module_filter is not None and not cfg.module_filter(name, lin):
                continue
            wrapper = Fp8EmulatedLinear(
                lin,
                amax_history_len=cfg.amax_history_len,
                fwd_format=cfg.fwd_format,
                bwd_format=cfg.bwd_format,
                margin=cfg.margin,
                amax_compute_algo=cfg.amax_compute_algo,
            )
            wrapper.train(lin.training)
            wrappers[id(lin)] = wrapper
            named.append((name, wrapper))
        if not named:
            n_lin = sum(1 for m in model.modules() if isinstance(m, nn.Linear))
            why = "module_filter rejected all of them" if n_lin else "the model has none"
            raise ValueError(
                f"no nn.Linear was converted ({n_lin} found; {why}); pass a model with nn.Linear "
                "layers or relax EmulationConfig.module_filter"
            )
        # remove_duplicate=False visits every parent of a shared Linear, so all references move.
        for _, parent in model.named_modules(remove_duplicate=False):
            for child_name, child in list(parent.named_children()):
                if id(child) in wrappers:
                    setattr(parent, child_name, wrappers[id(child)])
        return cls(cfg, named)

    @property
    def config(self) -> EmulationConfig:
        """The configuration the model was converted with."""
        return self._config

    def modules(self) -> list[tuple[str, Fp8EmulatedLinear]]:
        """(qualified name, module) of every emulated linear, in ``named_modules`` order."""
        return list(self._modules)

    def _select(self, names: Iterable[str] | None) -> Iterator[Fp8EmulatedLinear]:
        if names is None:
            yield from (m for _, m in self._modules)
            return
        if isinstance(names, str):
            raise ValueError(f"names must be an iterable of module names, not a single string {names!r}")
        wanted = list(names)
        unknown = [n for n in wanted if n not in self._by_name]
        if unknown:
            known = ", ".join(sorted(self._by_name)[:10])
            raise ValueError(f"unknown emulated module(s) {unknown}; known names include: {known}")
        yield from (self._by_name[n] for n in wanted)

    def set_fp8(self, names: Iterable[str] | None, enabled: bool) -> None:
        """Switch FP8 emulation on/off per module (``names=None``: all). Off means plain F.linear.

        Turning a module back on keeps its (possibly stale) scales; call :meth:`reset_fp8_state`
        on re-promotion.
        """
        for m in list(self._select(names)):
            m.fp8_enabled = bool(enabled)

    def reset_fp8_state(self, names: Iterable[str] | None = None) -> None:
        """Zero amax histories and reset scales to 1 for ``names`` (None: all)."""
        for m in list(self._select(names)):
            m.reset_fp8_state()

    def set_collect_counts(self, enabled: bool, names: Iterable[str] | None = None) -> None:
        """Turn exact overflow/underflow counting on/off for ``names`` (None: all)."""
        for m in list(self._select(names)):
            m.collect_counts = bool(enabled)

    def reset_counts(self, names: Iterable[str] | None = None) -> None:
        """Zero the overflow/underflow accumulators for ``names`` (None: all)."""
        for m in list(self._select(names)):
            m.reset_counts()

    @torch.no_grad()
    def update(self) -> None:
        """Close the step: reduce each amax history, recompute scales, roll the histories.

        Call once after every backward (per micro-batch, to match TE, which updates at each
        ``fp8_autocast`` exit and at the end of each backward). Placement relative to
        ``optimizer.step()`` does not matter: only FP8 metadata changes. TE updates the forward
        state at autocast exit and the backward state at the end of backward; doing both here is
        equivalent because the backward dequantizes with scales saved in the forward. Modules with
        ``fp8_enabled=False`` are skipped (their state is frozen until re-promotion).

        All modules on a device are updated in one batched pass over concatenated buffers.
        """
        update_fp8_state(m for _, m in self._modules)


def emulate_fp8(model: nn.Module, config: EmulationConfig | None = None) -> Fp8Emulation:
    """Convert ``model``'s Linear layers to emulated FP8 in place; see :meth:`Fp8Emulation.apply`."""
    return Fp8Emulation.apply(model, config)
