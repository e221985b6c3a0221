"""Whether the TE modules ran in FP8 at all since attach: the TE source's ``stale_reason``.

TE modules warmed up once under ``te.autocast`` (the source needs their FP8 state to build its
columns) and then trained outside it keep that state frozen: every amax and scale the monitor
ships would be the warm-up's. :class:`FP8Sentinel` notices the first forward that runs under
TE's FP8 autocast through the TE source's one set of module hooks
(:meth:`~fp8guard.agent.sources.te_hooks.HookObserver.watch`: the pre-hook reads TE's global
FP8 flag, a host bool, no device work), and the watch ends at that first FP8 forward; in a
healthy run it costs one step's hook calls."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from fp8guard.agent.sources.te_hooks import HookObserver

__all__ = ["STALE_TE_MESSAGE", "FP8Sentinel"]

STALE_TE_MESSAGE = (
    "fp8guard: no Transformer Engine module has run a forward in FP8 since attach, so TE's amaxes and "
    "scales never change and the telemetry repeats the warm-up's: run the model's forward inside "
    "te.autocast(enabled=True, recipe=...) (te.fp8_autocast(enabled=True, fp8_recipe=...) before TE 2.x)")


class FP8Sentinel:
    """Whether any of ``modules`` ran a forward under TE's FP8 autocast since :meth:`arm`,
    watched by ``observer``'s hooks until the first such forward, or :meth:`remove`."""

    def __init__(self, observer: HookObserver, modules: Sequence[nn.Module]) -> None:
        self._observer = observer
        self._modules = list(modules)
        self._armed = False

    @property
    def seen(self) -> bool:
        """A TE module ran a forward in FP8 since :meth:`arm`."""
        return self._observer.fp8_seen

    def arm(self) -> None:
        """Start watching (once; later calls do nothing)."""
        if self._armed:
            return
        self._armed = True
        self._observer.watch(self._modules)

    def remove(self) -> None:
        self._observer.unwatch()

    def stale_reason(self, *, any_fp8: bool) -> str | None:
        """The warning when armed, no FP8 forward was seen and some module is meant to run in
        FP8 (``any_fp8``: not every module fell back to BF16); the watch ends either way."""
        self.remove()
        if not self._armed or self.seen or not any_fp8:
            return None
        return STALE_TE_MESSAGE
