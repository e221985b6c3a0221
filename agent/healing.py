"""Healing a plain training loop: checkpoints, rollback, batch skipping and a lowered learning
rate, from two arguments.

    monitor = Monitor(MonitorConfig(url=..., run_id=...)).attach(
        model, opt, scheduler=sched, heal=HealConfig("ckpt/", every_n_steps=100))
    for x, y in monitor.batches(data):
        loss = loss_fn(model(x), y); loss.backward()
        monitor.step(loss)
        opt.step(); sched.step(); opt.zero_grad()
    monitor.close()

``heal=`` builds a :class:`~fp8guard.agent.checkpoint.CheckpointManager` in the folder and a
:class:`~fp8guard.agent.remediation.Remediator` around it (the monitor's command handler).
``monitor.batches(data)`` wraps the data: whenever the loop asks for the next batch, the step
that just finished is complete (``optimizer.step()`` ran), so that is where a due checkpoint is
saved (with the monitor's state, announced to the service with a ``checkpoint_saved`` event),
and where a rollback takes effect:

* ``monitor.step`` applies a rollback command at the step boundary: the checkpoint is read and
  validated on every rank (a missing or unreadable one fails the command, training goes on),
  and the monitor's step counter moves to ``checkpoint_step + 1``;
* the rest of that iteration (``optimizer.step()``, ``scheduler.step()``) runs on the abandoned
  state, which the restore then overwrites: nothing of it survives;
* at the next batch the checkpoint is restored in place (model with its FP8 state, optimizer,
  scheduler, RNG), later checkpoints of the abandoned stretch are deleted, the data goes back to
  the checkpoint's position and ``skip_batches`` further, and the learning rate is scaled by
  ``lr_scale`` for ``lr_scale_steps`` steps (param groups and the scheduler's ``base_lrs``;
  ``HealConfig(lr_schedule_hook=...)`` for schedulers that keep it elsewhere).

How the data goes back (:class:`Batches`): an object with ``state_dict``/``load_state_dict``
(torchdata's ``StatefulDataLoader``, or your own) whose ``state_dict()`` answers is saved and
restored through them; any other re-iterable (a list, a ``DataLoader``) is iterated again from the start of the epoch and the
batches before the position are drawn and dropped, with the global torch RNG as it was when the
epoch began (so a shuffling ``DataLoader`` without a ``generator`` replays the same order); a
one-shot iterator (a generator) cannot go back: the batches the rollback abandoned are not seen
again, and at least ``skip_batches`` batches after the checkpoint's position are skipped.

``HealConfig(resume=True)`` continues a restarted job from the newest checkpoint in the folder
at the first batch (model, optimizer, scheduler, RNG, data, the monitor's step counter).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from torch import nn

from fp8guard import wire
from fp8guard.agent.checkpoint import CheckpointManager, Stateful
from fp8guard.agent.commands import Command, Outcome
from fp8guard.agent.errors import CheckpointError, ConfigError
from fp8guard.agent.remediation import Remediator
from fp8guard.agent.sources.base import Source

if TYPE_CHECKING:
    from fp8guard.agent.monitor import Monitor

__all__ = ["Batches", "HealConfig", "Healer", "plain_batches"]

log = logging.getLogger("fp8guard.agent")

T = TypeVar("T")


@dataclass(slots=True)
class HealConfig:
    """How ``Monitor.attach(..., heal=HealConfig(...))`` heals a plain loop; see the module docstring."""

    directory: str | os.PathLike[str]
    """This job's checkpoint folder (one file per rank and step; created if missing)."""
    every_n_steps: int = 100
    """Save after every this many completed steps (the rollback targets the service picks from)."""
    keep_last: int = 5
    """Checkpoints kept per rank (the newest known-good one is never pruned)."""
    resume: bool = False
    """At the first batch, continue from the newest checkpoint in ``directory`` if there is one
    (a restarted job); False starts afresh (older checkpoints there are pruned as new ones come)."""
    lr_schedule_hook: Callable[[float, int], None] | None = None
    """Called as ``hook(lr_scale, lr_scale_steps)`` after a rollback instead of scaling the param
    groups' learning rate (schedulers that keep the rate elsewhere, e.g. OneCycleLR's ``max_lr``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str | os.PathLike) or not os.fspath(self.directory):
            raise ConfigError(f"HealConfig.directory must be a folder path, got {self.directory!r}")
        for name in ("every_n_steps", "keep_last"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"HealConfig.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.resume, bool):
            raise ConfigError(f"HealConfig.resume must be True or False, got {self.resume!r}")
        if self.lr_schedule_hook is not None and not callable(self.lr_schedule_hook):
            raise ConfigError("HealConfig.lr_schedule_hook must be a callable (lr_scale, lr_scale_steps) -> None")


class Healer:
    """The command handler ``Monitor.attach(heal=...)`` installs: a :class:`Remediator` whose
    rollbacks take effect at the next batch of ``monitor.batches(data)``, plus the checkpoints.

    Built by the monitor; ``monitor.healer`` returns it (``healer.checkpoints`` is the
    :class:`CheckpointManager`, ``healer.remediator`` the :class:`Remediator`)."""

    def __init__(self, config: HealConfig, *, monitor: Monitor, model: nn.Module,
                 optimizer: torch.optim.Optimizer | None, scheduler: Stateful | None,
                 sources: Iterable[Source]) -> None:
        self.config = config
        self._monitor = monitor
        self._batches: Batches[Any] | None = None
        self.checkpoints = CheckpointManager(config.directory, model=model, optimizer=optimizer, scheduler=scheduler,
                                             data_state=self._data_state, load_data_state=self._load_data_state,
                                             every_n_steps=config.every_n_steps, keep_last=config.keep_last)
        self.remediator = Remediator(sources=list(sources), checkpoints=self.checkpoints, optimizer=optimizer,
                                     lr_schedule_hook=config.lr_schedule_hook, model=model, defer_restore=True)
        self._warned_no_batches = False
        self._resumed = False
        if not config.resume and self.checkpoints.steps():
            log.warning("fp8guard: %s already holds checkpoints (steps %s) and HealConfig(resume=False): this run "
                        "starts afresh and prunes them as it saves its own", self.checkpoints.directory,
                        self.checkpoints.steps()[-5:])

    # -- the CommandHandler protocol -------------------------------------------------------------

    def apply(self, command: Command, *, step: int) -> Outcome:
        if command.kind == "rollback" and (self._batches is None or self._batches.done):
            # heal= restores at the next batch of monitor.batches(): without it nothing would.
            return Outcome(wire.AckStatus.FAILED, error="heal= rolls back at the next batch of monitor.batches(data), "
                                                        "which this loop does not iterate: write `for batch in "
                                                        "monitor.batches(data):`")
        return self.remediator.apply(command, step=step)

    def on_step(self, step: int) -> None:
        if self._batches is None and not self._warned_no_batches and step >= self.config.every_n_steps:
            self._warned_no_batches = True
            log.warning("fp8guard: heal= saves checkpoints and applies rollbacks at the batch boundary of "
                        "monitor.batches(data), which this loop does not use: write `for batch in "
                        "monitor.batches(data):` (no checkpoint was saved)")
        self.remediator.on_step(step)

    # -- the loop's side -------------------------------------------------------------------------

    def batches(self, data: Iterable[T], *, epochs: int | None = 1, steps: int | None = None) -> Iterator[T]:
        if self._batches is not None and not self._batches.done:
            raise ConfigError("monitor.batches() is already iterating; use one at a time")
        stream = Batches(data, epochs=epochs)
        _check_steps(steps)
        self._batches = stream
        return self._drive(stream, steps)

    def _drive(self, stream: Batches[T], steps: int | None) -> Iterator[T]:
        if self.config.resume and not self._resumed:
            self._resumed = True  # once per job, not at every monitor.batches() (e.g. per epoch)
            self._resume()
        yield from drive(stream, lambda: self._monitor.next_step, steps, self._boundary)

    def _boundary(self, completed: bool) -> None:
        if self.remediator.rollback_pending:
            self.remediator.finish_rollback()  # raises CheckpointError if the restore failed
        elif completed:
            self._maybe_save(self._monitor.next_step - 1)  # a step completed (optimizer.step ran)

    def _maybe_save(self, step: int) -> None:
        if step < 0 or (step + 1) % self.config.every_n_steps != 0:
            return
        monitor = self._monitor
        try:
            path = self.checkpoints.save(step, extra={"monitor": monitor.state_dict()})
        except Exception:  # a full disk must not take training down; the service keeps the older ones
            log.exception("fp8guard: saving the checkpoint of step %d failed; training continues", step)
            return
        monitor.event(wire.EventKind.CHECKPOINT_SAVED, step=step, data={"path": str(path)})

    def _resume(self) -> None:
        # Every rank resumes from the same step: the newest one all of them hold (a crash while
        # saving can leave the newest file on some ranks only).
        per_rank = self.remediator.gather(set(self.checkpoints.steps()))
        common = set.intersection(*per_rank)
        if not common:
            if any(per_rank):
                log.warning("fp8guard: no checkpoint step is held by every rank (%s); starting afresh",
                            [sorted(s)[-3:] for s in per_rank])
            return
        step = max(common)
        extra = self.checkpoints.load(step)
        state = extra.get("monitor")
        if isinstance(state, dict):
            self._monitor.resume_from(state, checkpoint_step=step)
        log.warning("fp8guard: resumed from the checkpoint of step %d in %s", step, self.checkpoints.directory)

    # -- data-state hooks of the CheckpointManager ---------------------------------------------

    def _data_state(self) -> dict[str, Any]:
        if self._batches is None:
            return {"position": 0}
        return self._batches.state_dict()

    def _load_data_state(self, state: dict[str, Any]) -> None:
        if self._batches is None:
            raise CheckpointError("restoring the data position needs monitor.batches(data)")
        self._batches.load_state_dict(state)


def drive(stream: Batches[T], next_step: Callable[[], int], steps: int | None,
          boundary: Callable[[bool], None]) -> Iterator[T]:
    """The batch boundary every healer shares: before each batch ``boundary(completed)`` runs
    (``completed``: a training step ended since the last batch, so a checkpoint may be due; or a
    rollback waits to be restored), then the stream stops at ``steps`` or at the data's end. The
    stream is marked done when the loop leaves, however it leaves."""
    seen = next_step()
    try:
        while True:
            boundary(next_step() != seen)
            seen = next_step()
            if steps is not None and seen >= steps:
                return
            try:
                batch = stream.next()
            except StopIteration:
                return
            yield batch
    finally:
        stream.done = True


def _check_steps(steps: int | None) -> None:
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
        raise ConfigError(f"steps must be an int >= 0 or None, got {steps!r}")


def plain_batches(data: Iterable[T], *, epochs: int | None, steps: int | None, monitor: Monitor) -> Iterator[T]:
    """``monitor.batches`` without ``heal``: the data, ``epochs`` times, until ``steps``."""
    _check_steps(steps)
    for batch in Batches(data, epochs=epochs):
        if steps is not None and monitor.next_step >= steps:
            return
        yield batch


def _gives_state(data: object) -> bool:
    """Whether ``data`` saves and restores its own position: it has ``state_dict`` and
    ``load_state_dict``, and ``state_dict()`` answers when tried, once, here. (An Accelerate
    DataLoader prepared without ``use_stateful_dataloader=True`` has both methods, but its
    ``state_dict()`` raises AttributeError.) Otherwise the data is replayed from its epoch's start."""
    state_dict = getattr(data, "state_dict", None)
    if not (callable(state_dict) and callable(getattr(data, "load_state_dict", None))):
        return False
    try:
        state_dict()
    except Exception as exc:
        log.info("fp8guard: %s.state_dict() failed (%s: %s); a rollback replays its epoch from the start instead",
                 type(data).__name__, type(exc).__name__, exc)
        return False
    return True


class Batches(Generic[T]):
    """A position in a stream of batches that a checkpoint can save and a rollback can move
    back (see the module docstring for the three kinds of data). ``position`` is the index of
    the next batch over all epochs; ``epochs=None`` iterates the data forever.

    :meth:`load_state_dict` only records where to go; the stream gets there at the next
    :meth:`next`, so a restore followed by a skip replays the data once."""

    def __init__(self, data: Iterable[T], *, epochs: int | None = 1) -> None:
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
            raise ConfigError(f"epochs must be an int >= 1 or None (forever), got {epochs!r}")
        if not isinstance(data, Iterable):
            raise ConfigError(f"monitor.batches() needs an iterable of batches, got {type(data).__name__}")
        self.data = data
        self.epochs = epochs
        self.stateful = _gives_state(data)
        self.one_shot = isinstance(data, Iterator) and not self.stateful
        self.position = 0
        self.done = False
        self._epoch = 0
        self._offset = 0
        """Batches of the current epoch drawn so far."""
        self._epoch_rng: torch.Tensor | None = None
        self._it: Iterator[T] | None = None
        self._lookahead: list[T] = []
        self._target: dict[str, Any] | None = None
        self._warned_one_shot = False
        self._exhausted = False

    def __iter__(self) -> Iterator[T]:
        while True:
            try:
                batch = self.next()
            except StopIteration:
                self.done = True
                return
            yield batch

    def next(self) -> T:
        if self._target is not None:
            target, self._target = self._target, None
            self._seek(target)
        return self._draw()

    def _draw(self) -> T:
        while True:
            if self._exhausted:
                raise StopIteration
            if self._lookahead:
                batch = self._lookahead.pop()
            else:
                if self._it is None:
                    if self.epochs is not None and self._epoch >= self.epochs:
                        raise StopIteration
                    self._start_epoch()
                assert self._it is not None
                try:
                    batch = next(self._it)
                except StopIteration:
                    self._it = None
                    self._epoch += 1
                    self._offset = 0
                    if self.one_shot:  # an iterator runs out once: there is no next epoch
                        self._exhausted = True
                    continue
            self.position += 1
            self._offset += 1
            return batch

    def _start_epoch(self) -> None:
        self._epoch_rng = torch.get_rng_state()
        self._it = iter(self.data)

    def state_dict(self) -> dict[str, Any]:
        """The data-state contract of :mod:`fp8guard.agent.checkpoint`: ``position`` plus where
        this epoch began; tensors and plain values only (read back with ``weights_only``). A
        position loaded but not reached yet is what it returns (so a skip adds to it)."""
        if self._target is not None:
            return dict(self._target)
        state: dict[str, Any] = {"position": self.position, "epoch": self._epoch, "offset": self._offset,
                                 "anchor": self.position}
        if self.stateful:
            state["loader"] = self.data.state_dict()  # type: ignore[attr-defined]
        elif not self.one_shot and self._epoch_rng is not None:
            state["epoch_rng"] = self._epoch_rng.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go to ``state`` at the next batch: its anchor (a saved position), then ``position -
        anchor`` batches further (a rollback's skip)."""
        self._target = dict(state)

    def _seek(self, state: dict[str, Any]) -> None:
        target, anchor = int(state["position"]), int(state.get("anchor", state["position"]))
        if self.one_shot:
            if target < self.position and not self._warned_one_shot:
                self._warned_one_shot = True
                log.warning("fp8guard: the data is a one-shot iterator: the batches after the checkpoint are not "
                            "replayed (pass a re-iterable or an object with state_dict/load_state_dict)")
            self._skip(target - self.position)
            return
        self._lookahead.clear()
        self._it = None
        self._epoch = int(state.get("epoch", 0))
        self._offset = 0
        self.position = anchor - int(state.get("offset", 0))
        if self.stateful:
            self.data.load_state_dict(state["loader"])  # type: ignore[attr-defined]
            self._it = iter(self.data)
            self._offset = int(state.get("offset", 0))
            self.position = anchor
        else:
            self._replay(int(state.get("offset", 0)), state.get("epoch_rng"))
        self._skip(target - self.position)

    def _replay(self, offset: int, epoch_rng: torch.Tensor | None) -> None:
        """Iterate the epoch again from its start with the RNG it began with, to ``offset``."""
        if self.epochs is not None and self._epoch >= self.epochs:
            return
        rng_now = torch.get_rng_state()
        try:
            if epoch_rng is not None:
                torch.set_rng_state(epoch_rng)
            self._start_epoch()
            assert self._it is not None
            try:
                # The first draw is where a shuffling sampler draws its seed: under the epoch's RNG.
                self._lookahead.append(next(self._it))
            except StopIteration:
                self._it = None
                return
        finally:
            torch.set_rng_state(rng_now)
        self._skip(offset)

    def _skip(self, n: int) -> None:
        for _ in range(max(0, n)):
            try:
                self._draw()
            except StopIteration:
                return
