"""Source for fp8guard's own CPU FP8 emulation (``fp8guard.agent.emulation``).

The monitor closes each step before reading (:meth:`EmulationSource.end_step`): when no scale
update ran since the step's FP8 forwards (the loop has no ``fp8.update()``), it runs one, so the
amax read here is the one the update just consumed (row -1 of the history after the roll, as in
TE). A loop that calls ``Fp8Emulation.update()`` itself must do so before ``Monitor.step()``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from fp8guard.agent.emulated_linear import Fp8EmulatedLinear, update_fp8_state
from fp8guard.agent.fp8 import compute_scale
from fp8guard.agent.sources.base import AMAX, HISTORY_MAX, SCALE, TensorSpec

__all__ = ["EmulationSource"]

# (state side, slot, role): the operands an emulated linear casts (TE without FP8 outputs).
_OPERANDS = (("fwd", 0, "fwd_input"), ("fwd", 1, "fwd_weight"), ("bwd", 0, "bwd_grad_output"))


class EmulationSource:
    kind = "emulation"

    def __init__(self, modules: Sequence[tuple[str, Fp8EmulatedLinear]]) -> None:
        if not modules:
            raise ValueError("EmulationSource needs at least one Fp8EmulatedLinear")
        self._modules = list(modules)
        self._specs = [
            TensorSpec(module=name, role=role, fp8_format=str(m.fwd_format if side == "fwd" else m.bwd_format),
                       fp8_max=(m.fwd_format if side == "fwd" else m.bwd_format).fp8_max)
            for name, m in self._modules
            for side, _, role in _OPERANDS
        ]
        # Column order of the concatenated [fwd input|weight of every module, bwd grad_output of
        # every module] views, permuted to one (input, weight, grad_output) triple per module.
        # History lengths are fixed at construction: decide once whether one fused read works.
        self._uniform_history = len({mod.amax_history_fwd.shape[0] for _, mod in self._modules}) == 1
        self._mods = [mod for _, mod in self._modules]
        m = len(self._modules)
        self._perm = torch.tensor([j for k in range(m) for j in (2 * k, 2 * k + 1, 2 * m + k)])
        # The scale a completed amax was measured with is the one from *before* the update that
        # consumed it, i.e. the scale we saw at the previous step; keep it on the device.
        self._scale_in_use = self._current_scales().clone()

    @classmethod
    def discover(cls, model: nn.Module) -> EmulationSource | None:
        found = [(name, m) for name, m in model.named_modules() if isinstance(m, Fp8EmulatedLinear)]
        return cls(found) if found else None

    def tensors(self) -> Sequence[TensorSpec]:
        return self._specs

    def end_step(self) -> None:
        """Close the step as TE does at the end of autocast and backward: update the scales from
        this step's amaxes, unless the loop already did (``Fp8Emulation.update()``). Called by
        ``Monitor.step`` before reading; host counters only decide, the update is device work."""
        if any(m.fp8_forwards for m in self._mods):
            update_fp8_state(self._mods)

    def stale_reason(self) -> str | None:
        """Why this source's FP8 state has not changed since attach (checked once by the monitor
        after a few steps), naming the fix; None when it did."""
        if any(m.fp8_forwards_total for m in self._mods) or not any(m.fp8_enabled for m in self._mods):
            return None
        return ("fp8guard: no emulated FP8 layer has run a training forward since attach, so every amax is 0 "
                "and every scale 1: pass attach() the model your loop trains (the one emulate_fp8 converted) "
                "and run its forward with gradients enabled")

    def _columns(self, fwd: list[torch.Tensor], bwd: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
        """Concatenate per-module fwd slots (input, weight) and bwd slot (grad_output), then put
        each module's three side by side: a handful of kernels instead of one per module."""
        joined = torch.cat([torch.cat(fwd, dim=dim), torch.cat(bwd, dim=dim)], dim=dim)
        if self._perm.device != joined.device:  # once: no host-to-device copy per step
            self._perm = self._perm.to(joined.device)
        return joined.index_select(dim, self._perm)

    def _current_scales(self) -> torch.Tensor:
        return self._columns([m.scale_fwd[:2] for m in self._mods], [m.scale_bwd[:1] for m in self._mods])

    def read(self, out: torch.Tensor) -> None:
        mods = self._mods
        hist = self._columns([m.amax_history_fwd[:, :2] for m in mods], [m.amax_history_bwd[:, :1] for m in mods],
                             dim=1) if self._uniform_history else None
        if hist is not None and hist.shape[0] > 1:
            out[AMAX].copy_(hist[-1])  # row -1 after the roll: the latest completed amax
            out[HISTORY_MAX].copy_(hist.amax(dim=0))
        else:  # history length 1 (kept aside by the emulation) or mixed lengths
            out[AMAX].copy_(self._columns([m.last_amax_fwd[:2] for m in mods], [m.last_amax_bwd[:1] for m in mods]))
            out[HISTORY_MAX].copy_(self._columns(
                [m.amax_history_fwd[:, :2].amax(dim=0) for m in mods],
                [m.amax_history_bwd[:, :1].amax(dim=0) for m in mods]))
        if not all(m.fp8_enabled for m in mods):
            # A module in BF16 casts nothing: report amax 0 ("not measured"), not its frozen history.
            on = torch.tensor([m.fp8_enabled for m in mods for _ in _OPERANDS], device=out.device)
            out[AMAX].mul_(on)
        out[SCALE].copy_(self._scale_in_use)
        self._scale_in_use.copy_(self._current_scales())

    @property
    def supports_counts(self) -> bool:
        return True

    def arm_counts(self, enabled: bool) -> None:
        for _, m in self._modules:
            m.collect_counts = enabled

    def read_counts(self, out: torch.Tensor) -> None:
        mods = self._mods
        counts = self._columns([m.fp8_counts_fwd[:2] for m in mods], [m.fp8_counts_bwd[:1] for m in mods])
        out.copy_(counts.t())  # counts: [n, 2] int64 (overflow, underflow)
        for _, m in self._modules:
            m.reset_counts()

    def precision(self) -> dict[str, bool]:
        return {name: bool(m.fp8_enabled) for name, m in self._modules}

    @contextmanager
    def probe(self, fp8: Mapping[str, bool]) -> Iterator[None]:
        """A probe forward max-accumulates into row 0 of the amax histories and counts: both are
        put back (device copies of a few small buffers per module) with the flags."""
        saved = [(m, m.fp8_enabled, {k: b.clone() for k, b in m.named_buffers(recurse=False)})
                 for _, m in self._modules]
        try:
            for name, m in self._modules:
                if name in fp8:
                    if fp8[name] and not m.fp8_enabled:
                        m.reset_fp8_state()  # a trial: FP8 as a re-promotion would start it
                    m.fp8_enabled = fp8[name]
            yield
        finally:
            with torch.no_grad():
                for m, enabled, buffers in saved:
                    m.fp8_enabled = enabled
                    for k, b in m.named_buffers(recurse=False):
                        b.copy_(buffers[k])

    @torch.no_grad()
    def settle(self, modules: Collection[str]) -> None:
        """The forward scales of the named modules from the amax their last forward recorded
        (row 0 of the history), as ``Fp8Emulation.update`` would set them (margin 0)."""
        for name, m in self._modules:
            if name in modules:
                m.fp8_scale_fwd.copy_(compute_scale(m.fp8_amax_history_fwd[0], m.fp8_scale_fwd, m.fwd_format.fp8_max))

    def set_fp8(self, modules: Sequence[str] | None, enabled: bool) -> None:
        """BF16 fallback (enabled=False) or re-promotion with a fresh amax history and scale."""
        wanted = None if modules is None else set(modules)
        for name, m in self._modules:
            if wanted is None or name in wanted:
                if enabled and not m.fp8_enabled:
                    m.reset_fp8_state()
                m.fp8_enabled = enabled
