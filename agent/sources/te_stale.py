"""Whether the TE modules ran in FP8 at all since attach: the TE source's ``stale_reason``.

TE modules warmed up once under ``te.autocast`` (the source needs their FP8 state to build its
columns) and then trained outside it keep that state frozen: every amax and scale the monitor
ships would be the warm-up's. :class:`FP8Sentinel` notices the first forward that runs under
TE's FP8 autocast with a forward pre-hook per TE module that reads TE's global FP8 flag (a host
bool, no device work) and removes every hook at that first FP8 forward; in a healthy run it
costs one step's hook calls."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

__all__ = ["STALE_TE_MESSAGE", "FP8Sentinel"]

STALE_TE_MESSAGE = (
    "fp8guard: no Transformer Engine module has run a forward in FP8 since attach, so TE's amaxes and "
    "scales never change and the telemetry repeats the warm-up's: run the model's forward inside "
    "te.autocast(enabled=True, recipe=...) (te.fp8_autocast(enabled=True, fp8_recipe=...) before TE 2.x)")


class FP8Sentinel:
    """One-shot forward pre-hooks on ``modules`` that record whether any forward ran under TE's
    FP8 autocast (``fp8_enabled``); all of them go at the first such forward, or at :meth:`remove`."""

    def __init__(self, modules: Sequence[nn.Module], fp8_enabled: Callable[[], bool]) -> None:
        self._modules = list(modules)
        self._fp8_enabled = fp8_enabled
        self._handles: list[Any] = []
        self.seen = False
        """A TE module ran a forward in FP8 since :meth:`arm`."""
        self._armed = False

    def arm(self) -> None:
        """Start watching (once; later calls do nothing)."""
        if self._armed:
            return
        self._armed = True
        self._handles = [m.register_forward_pre_hook(self._hook) for m in self._modules]

    def _hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not self.seen and self._fp8_enabled():
            self.seen = True
            self.remove()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def stale_reason(self, *, any_fp8: bool) -> str | None:
        """The warning when armed, no FP8 forward was seen and some module is meant to run in
        FP8 (``any_fp8``: not every module fell back to BF16); the hooks go either way."""
        self.remove()
        if not self._armed or self.seen or not any_fp8:
            return None
        return STALE_TE_MESSAGE
