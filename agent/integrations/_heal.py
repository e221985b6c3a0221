"""What the three framework integrations share to heal a run: the command handler that applies
the service's commands through the framework's own checkpoints.

* ``fallback`` / ``promote``: the stock :class:`~fp8guard.agent.remediation.Remediator` switches
  the named modules through their sources' ``set_fp8`` (nothing framework-specific).
* ``rollback``: the framework's checkpoint of ``checkpoint_step`` (saved at global step
  ``checkpoint_step + 1``: Lightning's ``.ckpt`` files, the Trainer's ``checkpoint-N`` folders,
  Accelerate's ``save_state`` folders) is read and restored in place by the subclass, with the
  framework's own loaders; the gradients of the abandoned step are cleared; checkpoints after the
  restored one are deleted (the abandoned timeline); the data moves on to the checkpoint's data
  position plus ``skip_batches`` optimizer steps' worth of batches; the learning rate is scaled
  by ``lr_scale`` for ``lr_scale_steps`` steps.

Data positions count the batches this process drew from the training data (micro-batches, so
``skip_batches`` is multiplied by the gradient accumulation), including those skipped; each
checkpoint records the position at which it was saved. A live data iterator cannot go back: when
the run is already past the position a rollback asks for (the command came late), training
continues where the data is, having skipped more than asked; the acknowledgement says how many.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from fp8guard.agent.commands import AckStatus, Command, Outcome
from fp8guard.agent.lr_window import LrWindow
from fp8guard.agent.remediation import Remediator
from fp8guard.agent.sources.base import Source

__all__ = ["FrameworkHealer", "Saved"]

log = logging.getLogger("fp8guard.agent")


@dataclass(frozen=True, slots=True)
class Saved:
    """One framework checkpoint this run can roll back to."""

    global_step: int
    """The framework's step counter at save time: the weights after steps 0..global_step-1."""
    path: str
    position: int | None
    """The data position (batches drawn) at save time; None when unknown."""


class FrameworkHealer:
    """A :class:`~fp8guard.agent.commands.CommandHandler` for a framework integration; the
    subclass supplies the framework's checkpoints (see the module docstring).

    Subclasses implement ``_read(saved)`` (load and validate, change nothing; raise with a
    message naming the file), ``_restore(loaded)`` (in place), ``_discard(saved)`` (delete a
    checkpoint of the abandoned timeline), ``_optimizers()``/``_schedulers()`` and the data skip.
    """

    framework = "the framework"

    def __init__(self, *, sources: Sequence[Source], model: nn.Module, accumulate: int = 1) -> None:
        self.switches = Remediator(sources=sources, model=model)
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
        self._lr: tuple[float, int] = (1.0, 0)

    # -- what the integration reports --------------------------------------------------------------

    def drew(self, batches: int = 1) -> None:
        self.drawn += batches

    def remember(self, global_step: int, path: str, position: int | None = None) -> None:
        """A checkpoint of ``global_step`` was saved at ``path`` (position: now, unless given)."""
        self.saved[int(global_step)] = Saved(int(global_step), str(path), self.drawn if position is None else position)

    # -- the CommandHandler protocol ---------------------------------------------------------------

    def apply(self, command: Command, *, step: int) -> Outcome:
        try:
            if command.kind == "rollback":
                return self._rollback(command, step)
            return self.switches.apply(command, step=step)
        except Exception as exc:  # a remediation must never take training down
            log.exception("fp8guard: applying %s command %s failed", command.kind, command.id)
            return Outcome(AckStatus.FAILED, error=f"{type(exc).__name__}: {exc}")

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

    def _rollback(self, command: Command, step: int) -> Outcome:
        target = command.checkpoint_step
        if target is None or target < 0 or target > step:
            return Outcome(AckStatus.FAILED, error=f"rollback needs a checkpoint step in 0..{step}, got {target!r}")
        saved = self.saved.get(target + 1)
        error: str | None = None
        loaded: Any = None
        if saved is None:
            known = sorted(s - 1 for s in self.saved)
            error = (f"no {self.framework} checkpoint of step {target} (global step {target + 1}) is known to this "
                     f"run; checkpoints of steps {known} are")
        else:
            try:
                loaded = self._read(saved)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        errors = [(r, e) for r, e in enumerate(self.switches.gather(error)) if e]
        if errors:
            return Outcome(AckStatus.FAILED, error=f"rollback to step {target} applied on no rank: {_per_rank(errors)}")
        assert saved is not None
        details: dict[str, Any] = {"checkpoint_step": target, "resume_step": target + 1, "path": saved.path,
                                   "skip_batches": command.skip_batches}
        try:
            if self.window is not None:
                self.window = None  # the restored optimizer carries the unscaled rate
            self._restore(loaded)
            self._clear_grads()
            details["discarded_checkpoints"] = self._discard_after(target + 1)
            details.update(self._plan_data(saved, command.skip_batches * self.accumulate, step))
            if command.lr_scale != 1.0 and command.lr_scale_steps > 0:
                details.update(lr_scale=command.lr_scale, lr_scale_steps=command.lr_scale_steps,
                               lr_restore_step=target + 1 + command.lr_scale_steps)
        except Exception as exc:
            log.exception("fp8guard: restoring the %s checkpoint %s failed", self.framework, saved.path)
            error = f"{type(exc).__name__}: {exc}"
        errors = [(r, e) for r, e in enumerate(self.switches.gather(error)) if e]
        if errors:
            return Outcome(AckStatus.FAILED, error=(
                f"rollback to step {target} failed while restoring on {_per_rank(errors)}: stop the job and restart "
                f"it from {saved.path}"))
        self._lr = (command.lr_scale, command.lr_scale_steps)
        self.resume_step = target + 1
        return Outcome(AckStatus.APPLIED, resume_step=target + 1, details=details)

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

    def _clear_grads(self) -> None:
        # The abandoned step's gradients would otherwise move the restored weights in the
        # optimizer step the framework still runs in this iteration (a None grad is skipped).
        for opt in self._optimizers():
            opt.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

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


def _per_rank(errors: list[tuple[int, str]]) -> str:
    if len(errors) == 1 and errors[0][0] == 0:
        return errors[0][1]
    return "; ".join(f"rank {r}: {e}" for r, e in errors)

