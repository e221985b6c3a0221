"""The Monitor's side of its sources' per-step lifecycle: closing the FP8 step where a library
needs it, arming exact counts at their cadence, and the one-time warning about a source whose
FP8 state never changed (silent zeros are worse than no data)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence

from fp8guard.agent.sources.base import Source

__all__ = ["SourceSteps", "first_whole_window_end"]

log = logging.getLogger("fp8guard.agent")

_STALE_CHECK_STEPS = 10
"""After this many ``step`` calls, ask each source once whether its FP8 state ever changed
(``stale_reason``, host only) and warn loudly if not: silent zeros are worse than no data."""


def first_whole_window_end(start: int, every: int) -> int:
    """Staggered counting: the first multiple of ``every`` whose window of ``every`` steps
    (``end - every + 1 .. end``) lies wholly at or after ``start``, the step the schedule began."""
    return -(-(start + every - 1) // every) * every


class SourceSteps:
    """Drives the optional per-step hooks of a Monitor's sources (``end_step``, ``prepare_step``,
    ``arm_counts``, ``stop_counting``, ``stale_reason``); host work only."""

    def __init__(self, sources: Sequence[Source]) -> None:
        self.sources = list(sources)
        self.counting = False
        """Whether the sources count exactly at the step being recorded."""
        self._end_failed: set[str] = set()
        self._step_calls = 0
        self._schedule: tuple[int, bool] | None = None
        """(cadence, staggered) of the last ``arm_counts_for``."""
        self._last_step = -1
        """The step of the last ``arm_counts_for``."""
        self.stagger_from = 0
        """Staggered counting: the step the schedule (re)started from."""

    def end_step(self) -> None:
        """Close the step in sources whose library needs it (the emulation's scale update when the
        loop has no ``fp8.update()``): training numerics, so on every rank, reporting or not;
        once after ``_STALE_CHECK_STEPS`` calls, warn about a source whose state never changed."""
        for src in self.sources:
            end = getattr(src, "end_step", None)
            if end is not None and src.kind not in self._end_failed:
                try:
                    end()
                except Exception:
                    self._end_failed.add(src.kind)
                    log.exception("fp8guard: closing the FP8 step in the %s source failed; not tried again", src.kind)
        self._step_calls += 1
        if self._step_calls == _STALE_CHECK_STEPS:
            for src in self.sources:
                reason = getattr(src, "stale_reason", None)
                message = reason() if reason is not None else None
                if message:
                    log.warning("%s", message)
                    warnings.warn(message, RuntimeWarning, stacklevel=4)

    def arm_counts_for(self, step: int, *, every: int, reporting: bool, stagger: bool = False) -> None:
        """Tell the sources whether ``step`` counts exactly (every ``every`` steps, when reporting).

        ``stagger``: a source that can (TE's inspection API) counts each module at its own step
        of the ``every`` steps up to a multiple of ``every``, where the counts are read; only whole
        windows are read, so the schedule restarts (and the first read waits for a whole window)
        after a step that does not follow the last one (a rollback) or a change of cadence.
        Ignored unless every source that counts can stagger (see :meth:`_staggering`)."""
        stagger = stagger and every > 0 and self._staggering()  # (counting off: nothing to ask)
        if (every, stagger) != self._schedule or not self._last_step <= step <= self._last_step + 1:
            self.stagger_from = step
        self._schedule, self._last_step = (every, stagger), step
        for src in self.sources:
            prepare = getattr(src, "prepare_step", None)
            if prepare is not None:  # sources that must know the cadence ahead (TE's inspection API)
                if stagger:  # only then: a source's prepare_step(step, every) need not know of it
                    prepare(step, every if reporting else 0, stagger_from=self.stagger_from)
                else:
                    prepare(step, every if reporting else 0)
        whole = not stagger or every <= 0 or step >= first_whole_window_end(self.stagger_from, every)
        want = every > 0 and step % every == 0 and reporting and whole
        if want != self.counting:
            for src in self.sources:
                if src.supports_counts:
                    src.arm_counts(want)
            self.counting = want

    def _staggering(self) -> bool:
        """Whether every source that counts can stagger (TE's inspection API in a debug session
        fp8guard owns, which sets its iterations). Asked per step: whether fp8guard owns TE's
        session is known once counting first opens it. With one that cannot (the emulation,
        torchao, TE's module hooks, a session the script opened), every source counts at the
        multiples, the first one included, so no report mixes whole windows with single steps."""
        counting = [src for src in self.sources if src.supports_counts]
        return bool(counting) and all(getattr(src, "staggers_counts", False) for src in counting)

    def stop_counting(self) -> None:
        for src in self.sources:
            try:
                if src.supports_counts:
                    src.arm_counts(False)
                stop = getattr(src, "stop_counting", None)
                if stop is not None:
                    stop()
            except Exception:
                log.exception("fp8guard: could not switch counting off in %s", src.kind)
        self.counting = False
