"""What the three framework integrations share to heal a run: the command handler that applies
the service's commands through the framework's own checkpoints.

* ``fallback`` / ``promote``: the stock :class:`~fp8guard.agent.remediation.Remediator` switches
  the named modules through their sources' ``set_fp8`` (nothing framework-specific).
* ``rollback``: the same Remediator's one rollback path (checks, every rank reads before any
  restores, the agreement across ranks, cleared gradients, the acknowledgement), over
  :class:`FrameworkCheckpoints`: the framework's checkpoint of ``checkpoint_step`` (saved at
  global step ``checkpoint_step + 1``: Lightning's ``.ckpt`` files, the Trainer's
  ``checkpoint-N`` folders, Accelerate's ``save_state`` folders) is read and restored in place by
  the subclass, with the framework's own loaders; checkpoints after the restored one are deleted
  (the abandoned timeline); the data moves on to the checkpoint's data position plus
  ``skip_batches`` optimizer steps' worth of batches; the learning rate is scaled by ``lr_scale``
  for ``lr_scale_steps`` steps once the framework's step has settled (the Remediator's
  ``lr_schedule_hook``: the framework steps its scheduler after the restore).

Data positions count the batches this process drew from the training data (micro-batches, so
``skip_batches`` is multiplied by the gradient accumulation), including those skipped; each
checkpoint records the position at which it was saved. A live data iterator cannot go back: when
the run is already past the position a rollback asks for (the command came late), training
continues where the data is, having skipped more than asked; the acknowledgement says how many.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from fp8guard.agent.checkpoint import Stateful
from fp8guard.agent.commands import AckStatus, Command, Outcome
from fp8guard.agent.errors import CheckpointError
from fp8guard.agent.lr_window import LrWindow
from fp8guard.agent.remediation import Remediator
from fp8guard.agent.sources.base import Source

__all__ = ["FrameworkCheckpoints", "FrameworkHealer", "Saved", "drop"]

log = logging.getLogger("fp8guard.agent")


@dataclass(frozen=True, slots=True)
class Saved:
    """One framework checkpoint this run can roll back to."""

    global_step: int
    """The framework's step counter at save time: the weights after steps 0..global_step-1."""
    path: str
    position: int | None
    """The data position (batches drawn) at save time; None when unknown."""


class FrameworkCheckpoints:
    """A framework's checkpoints as the Remediator's rollback uses them
    (:class:`~fp8guard.agent.checkpoint.Checkpoints`), for one :class:`FrameworkHealer`.

    ``optimizer`` and ``scheduler`` are None: the learning rate goes through the Remediator's
    ``lr_schedule_hook`` (the healer scales it once the framework's step settled), and clearing
    the model's gradients (``set_to_none``) clears every optimizer's, since they step the model's
    parameters."""

    restores_data = True
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Stateful | None = None

    def __init__(self, healer: FrameworkHealer) -> None:
        self._healer = healer
        self.model = healer.model
        self.restored: Saved | None = None
        """The checkpoint the current rollback restored."""
        self.skipped: int | None = None
        """The batches the current rollback skipped past the checkpoint's data position."""

    def read(self, step: int) -> dict[str, Any]:
        h = self._healer
        saved = h.saved.get(step + 1)
        if saved is None:
            known = sorted(s - 1 for s in h.saved)
            raise CheckpointError(f"no {h.framework} checkpoint of step {step} (global step {step + 1}) is known to "
                                  f"this run; checkpoints of steps {known} are")
        return {"saved": saved, "loaded": h._read(saved)}

    def restore(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        self._healer.window = None  # the restored optimizer carries the unscaled rate
        self._healer._restore(payload["loaded"])
        self.restored = payload["saved"]
        return {}

    def skip_batches(self, n: int) -> int | None:
        """Plan the data ``n`` optimizer steps' worth of batches past the restored checkpoint's
        position (``FrameworkHealer._plan_data``); the position it goes to, when known."""
        h, saved = self._healer, self.restored
        assert saved is not None  # after restore
        plan = h._plan_data(saved, n * h.accumulate, h.step)
        self.skipped = plan.get("skipped_batches")
        position = plan.get("data_position")
        return None if position is None else int(position)

    def data_position(self) -> int | None:
        return self.skip_batches(0)

    def discard_after(self, step: int) -> list[int]:
        return self._healer._discard_after(step + 1)


class FrameworkHealer:
    """A :class:`~fp8guard.agent.commands.CommandHandler` for a framework integration; the
    subclass supplies the framework's checkpoints (see the module docstring).

    Subclasses implement ``_read(saved)`` (load and validate, change nothing; raise with a
    message naming the file), ``_restore(loaded)`` (in place), ``_discard(saved)`` (delete a
    checkpoint of the abandoned timeline), ``_optimizers()``/``_schedulers()`` and the data skip.
    """

    framework = "the framework"

    def __init__(self, *, sources: Sequence[Source], model: nn.Module, accumulate: int = 1) -> None:
        self.model = model
        self.accumulate = max(1, int(accumulate))
        self.saved: dict[int, Saved] = {}
        """Checkpoints by global step: the ones saved in this process and the one resumed from."""
        self.drawn = 0
        """Batches drawn from the training data so far (see the module docstring)."""
        self.pending_skip = 0
        """Batches still to skip after the last rollback."""
        self.window: LrWindow | None = None
        self.resume_step: int | None = None
        self.step = 0
        """The step of the command being applied."""
        self._lr: tuple[float, int] = (1.0, 0)
        self.checkpoints = FrameworkCheckpoints(self)
        self.remediator = Remediator(sources=sources, model=model, checkpoints=self.checkpoints,
                                     lr_schedule_hook=self._scale_lr_when_settled)

    # -- what the integration reports --------------------------------------------------------------

    def drew(self, batches: int = 1) -> None:
        self.drawn += batches

    def remember(self, global_step: int, path: str, position: int | None = None) -> None:
        """A checkpoint of ``global_step`` was saved at ``path`` (position: now, unless given)."""
        self.saved[int(global_step)] = Saved(int(global_step), str(path), self.drawn if position is None else position)

    # -- the CommandHandler protocol ---------------------------------------------------------------

    def apply(self, command: Command, *, step: int) -> Outcome:
        """The Remediator applies every command; a rollback's acknowledgement also names the
        framework's checkpoint and the batches skipped. Never raises."""
        if command.kind != "rollback":
            return self.remediator.apply(command, step=step)
        self.step = step
        ck = self.checkpoints
        ck.restored, ck.skipped, self._lr = None, None, (1.0, 0)
        outcome = self.remediator.apply(command, step=step)
        if outcome.status != AckStatus.APPLIED or ck.restored is None:
            self._lr = (1.0, 0)
            return outcome
        self.resume_step = outcome.resume_step
        extra: dict[str, Any] = {"path": ck.restored.path}
        if ck.skipped is not None:
            extra["skipped_batches"] = ck.skipped
        return replace(outcome, details={**outcome.details, **extra})

    def on_step(self, step: int) -> None:
        """Ends a lowered-learning-rate window at its step; never raises."""
        window = self.window
        if window is None or step < window.until:
            return
        self.window = None
        try:
            window.end()
            log.warning("fp8guard: learning rate back to normal at step %d after a rollback", step)
        except Exception:
            log.exception("fp8guard: restoring the learning rate after a rollback failed")

    # -- rollback --------------------------------------------------------------------------------

    def _scale_lr_when_settled(self, scale: float, steps: int) -> None:
        """The Remediator's ``lr_schedule_hook``: remembered until :meth:`settled`."""
        self._lr = (scale, steps)

    def _plan_data(self, saved: Saved, skip: int, step: int) -> dict[str, Any]:
        """Where the data goes after the rollback (``skip`` batches past the checkpoint's
        position): a live iterator only goes forward, ``pending_skip`` batches at the next draw.
        Returns the acknowledgement's ``data_position`` and ``skipped_batches``."""
        position = saved.position if saved.position is not None else \
            self.drawn - (step + 1 - saved.global_step) * self.accumulate
        wanted = position + skip
        self.pending_skip = max(0, wanted - self.drawn)
        return {"data_position": max(wanted, self.drawn), "skipped_batches": max(wanted, self.drawn) - position}

    def settled(self) -> None:
        """After the framework's step that applied a rollback has settled: scale the learning rate
        as the command said (until ``resume_step + lr_scale_steps``)."""
        resume, self.resume_step = self.resume_step, None
        (scale, steps), self._lr = self._lr, (1.0, 0)
        if resume is None:
            return
        log.warning("fp8guard: restored the checkpoint of step %d; training continues at step %d", resume - 1, resume)
        if scale != 1.0 and steps > 0:
            self.window = LrWindow.start(self._optimizers(), self._schedulers(), scale, resume + steps)

    def _discard_after(self, global_step: int) -> list[int]:
        doomed = sorted(s for s in self.saved if s > global_step)
        for s in doomed:
            try:
                self._discard(self.saved.pop(s))
            except Exception:
                log.exception("fp8guard: could not delete the abandoned checkpoint of global step %d", s)
        return [s - 1 for s in doomed]

    # -- the framework's part ----------------------------------------------------------------------

    def _read(self, saved: Saved) -> Any:
        raise NotImplementedError

    def _restore(self, loaded: Any) -> None:
        raise NotImplementedError

    def _discard(self, saved: Saved) -> None:
        raise NotImplementedError

    def _optimizers(self) -> list[Any]:
        raise NotImplementedError

    def _schedulers(self) -> list[Any]:
        raise NotImplementedError


def drop(batches: Iterator[Any], n: int) -> int:
    """Draw ``n`` batches from a live iterator and drop them (a rollback's skip); how many there
    were before it ended."""
    dropped = 0
    try:
        for _ in range(n):
            next(batches)
            dropped += 1
    except StopIteration:
        pass
    return dropped
