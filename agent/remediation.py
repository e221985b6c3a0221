"""``Remediator``: the stock :class:`~fp8guard.agent.commands.CommandHandler`; applies the
service's commands to the training process: BF16 fallback, re-promotion to FP8 and checkpoint
rollback.

A plain loop does not build one: ``Monitor.attach(model, opt, heal=HealConfig("ckpt/"))`` does,
with its checkpoints, and ``monitor.batches(data)`` applies rollbacks at the batch boundary
(:mod:`fp8guard.agent.healing`). Build one yourself for a loop that checkpoints its own way:

    ckpts = CheckpointManager("ckpt/", model=model, optimizer=opt, scheduler=sched,
                              data_state=lambda: {"position": data.position},
                              load_data_state=lambda s: setattr(data, "position", s["position"]))
    monitor = Monitor(MonitorConfig(url=..., run_id=...))
    monitor.attach(model, opt, handler=Remediator(checkpoints=ckpts))
    while monitor.next_step < total:
        step = monitor.next_step
        x, y = data.next()
        loss = model(x, y); loss.backward()
        monitor.step(loss)                # may apply a command, on every rank at the same step
        if monitor.next_step != step + 1:  # rolled back (restored in place): skip the rest
            continue
        opt.step(); sched.step(); opt.zero_grad()
        ckpts.maybe_save(step, extra={"monitor": monitor.state_dict()})

What each command does:

* ``fallback``: every FP8 module named in ``command.modules`` (None: the whole model; a name
  may also be a parent, e.g. ``blocks.3``, meaning every FP8 module under it) computes in high
  precision from now on, through the ``set_fp8(modules, enabled)`` of the source that owns it
  (:class:`~fp8guard.agent.sources.base.SwitchableSource`): each library switches its own way
  (TE a nested autocast, torchao the plain GEMM, the emulation a flag), and this module knows
  none of them. Sources of a kind that ``sources`` lacks are found on the model without hooks
  (:func:`~fp8guard.agent.sources.discover_switches`: emulated and torchao modules; TE modules
  need the monitor's source).
* ``promote``: the same modules go back to FP8; each source leaves no stale FP8 state behind
  (delayed scaling: amax history zeroed, scales 1, because the incident's history would
  otherwise pin the scale; torchao scales dynamically and has none).
* ``rollback``: restores the checkpoint of ``command.checkpoint_step`` in place (model, FP8
  metadata, optimizer, scheduler, RNG, data position), clears the gradients (so an
  ``optimizer.step()`` that still follows in this iteration changes nothing), advances the data
  position by ``command.skip_batches`` (the data-state contract of
  :mod:`fp8guard.agent.checkpoint`: ``data_state()["position"]`` is the next batch's index),
  deletes this rank's checkpoints after the restored step (the abandoned timeline, so a restart
  never resumes from it), and scales the learning rate by ``command.lr_scale`` for
  ``command.lr_scale_steps`` steps. Training continues at ``checkpoint_step + 1``: the Monitor
  moves its step counter there (``monitor.next_step``, the one place to read it). With
  ``defer_restore=True`` (what ``heal=`` uses) ``apply`` only reads and validates the
  checkpoint on every rank; :meth:`Remediator.finish_rollback` restores it at the next batch,
  so the rest of the iteration (``optimizer.step()``, ``scheduler.step()``) acts on the
  abandoned state that the restore overwrites.

Learning-rate scaling: with ``lr_schedule_hook`` the hook is called as ``hook(lr_scale,
lr_scale_steps)`` and owns the change. Otherwise every param group's ``lr`` (and the
scheduler's ``base_lrs``, so closed-form schedulers such as LambdaLR keep the factor) is
multiplied by ``lr_scale``, and :meth:`Remediator.on_step` undoes it at step ``resume_step +
lr_scale_steps`` (``Monitor.step`` calls it at every step, before ``optimizer.step()``). Schedulers
that keep the learning rate elsewhere (OneCycleLR's ``max_lr``) need the hook. A checkpoint
saved while a window is open holds the scaled rate.

Under torch.distributed (initialised, world size > 1) ``apply`` must run on every rank at the
same step, which the Monitor guarantees: the ranks agree through ``all_gather_object`` (a few
small collectives, only when a command is applied) so that every rank gives the same outcome.
A rollback whose checkpoint is missing or unreadable on any rank is applied on none; a module
name counts as unknown only when no rank has it (pipeline stages hold different modules).

``apply`` never raises: problems come back as ``Outcome(AckStatus.FAILED, error=...)``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fp8guard.agent.checkpoint import Checkpoints
from fp8guard.agent.commands import AckStatus, Command, Outcome
from fp8guard.agent.errors import CheckpointError, ConfigError
from fp8guard.agent.lr_window import LrWindow
from fp8guard.agent.sources import discover_switches
from fp8guard.agent.sources.base import Source, SwitchableSource

__all__ = ["Remediator", "SwitchableSource"]

log = logging.getLogger("fp8guard.agent")

@dataclass(slots=True)
class _Switch:
    kind: str
    names: frozenset[str]
    set_fp8: Callable[[Sequence[str], bool], None]


class Remediator:
    """Applies fallback, promotion and rollback commands; see the module docstring.

    ``sources``: the monitor's sources (``monitor.sources``) or empty to find emulated and
    torchao modules on the model (hook-free). ``checkpoints``: needed for rollback. ``optimizer``: whose
    learning rate a rollback scales (default: the CheckpointManager's). ``model``: where to
    look for FP8 modules (default: the CheckpointManager's; a DDP wrapper is looked through);
    names are qualified names in it, as the Monitor reports them. ``sync_ranks=False`` skips
    the cross-rank agreement (only for calling ``apply`` on one rank by hand).
    ``defer_restore=True``: a rollback is validated in ``apply`` and restored by
    :meth:`finish_rollback` (see the module docstring).
    """

    def __init__(
        self,
        *,
        sources: Sequence[Source] = (),
        checkpoints: Checkpoints | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        lr_schedule_hook: Callable[[float, int], None] | None = None,
        model: nn.Module | None = None,
        sync_ranks: bool = True,
        defer_restore: bool = False,
    ) -> None:
        if checkpoints is not None and not isinstance(checkpoints, Checkpoints):
            raise ConfigError(f"checkpoints must be a CheckpointManager or None, got {type(checkpoints).__name__}")
        if lr_schedule_hook is not None and not callable(lr_schedule_hook):
            raise ConfigError("lr_schedule_hook must be a callable (lr_scale, lr_scale_steps) -> None, or None")
        self._sources = list(sources)
        self.checkpoints = checkpoints
        self._optimizer = optimizer
        self._lr_hook = lr_schedule_hook
        self._model = model
        self._sync = sync_ranks
        self._switches: list[_Switch] | None = None
        self._window: LrWindow | None = None
        self._defer = defer_restore
        self._pending: tuple[Command, dict[str, Any]] | None = None
        """A validated rollback waiting for :meth:`finish_rollback` (``defer_restore``)."""

    @property
    def sources(self) -> list[Source]:
        return list(self._sources)

    @sources.setter
    def sources(self, sources: Sequence[Source]) -> None:
        """E.g. ``remediator.sources = monitor.sources`` after ``Monitor.attach``."""
        self._sources = list(sources)
        self._switches = None  # found again at the next command

    # -- the protocol ----------------------------------------------------------------------------

    def apply(self, command: Command, *, step: int) -> Outcome:
        """Apply ``command`` at ``step`` (on every rank at the same step); never raises."""
        try:
            if command.kind == "fallback":
                return self._switch(command, enabled=False)
            if command.kind == "promote":
                return self._switch(command, enabled=True)
            if command.kind == "rollback":
                return self._rollback(command, step)
            return Outcome(AckStatus.IGNORED, error=f"unknown command kind {command.kind!r}")
        except Exception as exc:  # a remediation must never take training down
            log.exception("fp8guard: applying %s command %s failed", command.kind, command.id)
            return Outcome(AckStatus.FAILED, error=f"{type(exc).__name__}: {exc}")

    # -- the loop's hooks ------------------------------------------------------------------------

    def on_step(self, step: int) -> None:
        """Call once per step, before ``optimizer.step()``: ends an LR-scaling window when
        ``step`` reaches its end. Cheap (no device work unless a window ends); never raises."""
        window = self._window
        if window is None or step < window.until:
            return
        try:
            self._end_lr_window(restore=True)
            log.warning("fp8guard: learning rate back to normal at step %d after a rollback", step)
        except Exception:
            log.exception("fp8guard: restoring the learning rate after a rollback failed")

    @property
    def rollback_pending(self) -> bool:
        """A rollback was applied with ``defer_restore`` and waits for :meth:`finish_rollback`."""
        return self._pending is not None

    def finish_rollback(self) -> None:
        """Restore the rollback that ``apply`` validated (``defer_restore``), on every rank.

        Raises :class:`~fp8guard.agent.errors.CheckpointError` if restoring failed: the state is
        then half-restored (and may differ between ranks), so training must not go on."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        command, payload = pending
        target = command.checkpoint_step
        assert target is not None  # validated in apply
        error = self._restore(command, payload, {})
        if error is not None:
            raise CheckpointError(error)
        log.warning("fp8guard: restored the checkpoint of step %d; training continues at step %d", target, target + 1)

    @property
    def lr_scaled_until(self) -> int | None:
        """First step that runs with the original learning rate again, while a window is open."""
        return self._window.until if self._window is not None else None

    # -- fallback / promotion --------------------------------------------------------------------

    def _switch(self, command: Command, *, enabled: bool) -> Outcome:
        wanted = command.modules
        error: str | None = None
        selected: set[str] = set()
        unknown: list[str] = []
        knows_any = False
        try:
            switches = self._find_switches()
            known = frozenset[str]().union(*(s.names for s in switches))
            knows_any = bool(known)
            if wanted is not None:
                if not wanted:
                    error = "the command names no modules (send modules=null for the whole model)"
                for name in wanted:
                    matched = _resolve(name, known)
                    if matched:
                        selected |= matched
                    else:
                        unknown.append(name)
            else:
                selected = set(known)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        views = self.gather((error, unknown, knows_any))
        errors = [(r, e) for r, (e, _, _) in enumerate(views) if e]
        if errors:
            return Outcome(AckStatus.FAILED, error=_per_rank(errors))
        if wanted is not None:
            nowhere = sorted(set.intersection(*(set(u) for _, u, _ in views)))
            if nowhere:
                sample = sorted(frozenset[str]().union(*(s.names for s in self._find_switches())))[:8]
                return Outcome(AckStatus.FAILED, error=(
                    f"unknown FP8 module(s) {nowhere}: no rank has a switchable FP8 module of that name or under "
                    f"it (names look like {sample}; switchable are the modules of sources with set_fp8: "
                    f"emulated and torchao modules found on the model, those of the sources passed)"))
        elif not any(k for _, _, k in views):
            return Outcome(AckStatus.FAILED, error="no FP8 module to switch: no source supports set_fp8 and the model has "
                                           "no emulated or torchao FP8 modules (pass Remediator(sources=monitor."
                                           "sources) or model=)")
        error = None
        try:
            for sw in self._find_switches():
                names = sorted(selected & sw.names)
                if names:
                    sw.set_fp8(names, enabled)
        except Exception as exc:
            log.exception("fp8guard: switching FP8 modules failed")
            error = f"{type(exc).__name__}: {exc}"
        errors = [(r, e) for r, e in enumerate(self.gather(error)) if e]
        if errors:
            return Outcome(AckStatus.FAILED, error=_per_rank(errors))
        details: dict[str, Any] = {"precision": "fp8" if enabled else "bf16", "switched_modules": len(selected)}
        if wanted is not None:
            details["modules"] = sorted(selected)  # parents expanded to the FP8 modules they hold
        return Outcome(AckStatus.APPLIED, details=details)

    def _find_switches(self) -> list[_Switch]:
        if self._switches is not None:
            return self._switches
        switchable: list[SwitchableSource] = [s for s in self._sources if isinstance(s, SwitchableSource)]
        model = self._root_model()
        if model is not None:
            switchable += discover_switches(model, skip={s.kind for s in switchable})
        found = [_Switch(kind=s.kind, names=frozenset(spec.module for spec in s.tensors()), set_fp8=s.set_fp8)
                 for s in switchable]
        self._switches = found
        return found

    def _root_model(self) -> nn.Module | None:
        model = self._model if self._model is not None else (
            self.checkpoints.model if self.checkpoints is not None else None)
        # Look through DDP / DataParallel: the Monitor names modules of the model inside.
        while model is not None and isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel):
            model = model.module
        return model

    # -- rollback --------------------------------------------------------------------------------

    def _rollback(self, command: Command, step: int) -> Outcome:
        ck = self.checkpoints
        target = command.checkpoint_step
        # Checks that come out the same on every rank need no agreement.
        if ck is None:
            return Outcome(AckStatus.FAILED, error="rollback needs Remediator(checkpoints=CheckpointManager(...))")
        if target is None or target < 0:
            return Outcome(AckStatus.FAILED, error=f"rollback needs a checkpoint_step >= 0, got {target!r}")
        if target > step:
            return Outcome(AckStatus.FAILED, error=f"checkpoint step {target} is after the current step {step}; "
                                           "a rollback only goes back")
        skip, scale, scale_steps = command.skip_batches, command.lr_scale, command.lr_scale_steps
        if skip < 0:
            return Outcome(AckStatus.FAILED, error=f"skip_batches must be >= 0, got {skip}")
        if skip > 0 and not ck.restores_data:
            return Outcome(AckStatus.FAILED, error=f"cannot skip {skip} batches: the CheckpointManager has no "
                                           "data_state/load_data_state hooks")
        if not (math.isfinite(scale) and scale > 0) or scale_steps < 0:
            return Outcome(AckStatus.FAILED, error=f"lr_scale must be a finite number > 0 and lr_scale_steps >= 0, got "
                                           f"{scale} and {scale_steps}")
        scaling = scale != 1.0 and scale_steps > 0
        if scaling and self._lr_hook is None and self._lr_optimizer() is None:
            return Outcome(AckStatus.FAILED, error="lr scaling needs an optimizer (Remediator(optimizer=...) or the "
                                           "CheckpointManager's) or an lr_schedule_hook")

        # Phase 1: every rank reads and validates its file; restore only if all of them can.
        payload: dict[str, Any] | None = None
        error: str | None = None
        try:
            payload = ck.read(target)
        except Exception as exc:
            error = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        errors = [(r, e) for r, e in enumerate(self.gather(error)) if e]
        if errors:
            return Outcome(AckStatus.FAILED, error=f"rollback to step {target} applied on no rank: {_per_rank(errors)}")
        assert payload is not None
        details: dict[str, Any] = {"checkpoint_step": target, "resume_step": target + 1, "skip_batches": skip}
        if self._defer:
            self._pending = (command, payload)
            if scaling:
                details.update({"lr_scale": scale, "lr_scale_steps": scale_steps,
                                "lr_restore_step": target + 1 + scale_steps})
            return Outcome(AckStatus.APPLIED, resume_step=target + 1, details={**details, "restore": "next batch"})
        # Phase 2: restore in place.
        error = self._restore(command, payload, details)
        if error is not None:
            return Outcome(AckStatus.FAILED, error=error)
        return Outcome(AckStatus.APPLIED, resume_step=target + 1, details=details)

    def _restore(self, command: Command, payload: dict[str, Any], details: dict[str, Any]) -> str | None:
        """Phase 2 of a rollback, on every rank: restore in place; the error every rank agrees on, or None."""
        ck = self.checkpoints
        assert ck is not None and command.checkpoint_step is not None
        target, skip = command.checkpoint_step, command.skip_batches
        error: str | None = None
        try:
            self._end_lr_window(restore=False)  # the restored optimizer carries the unscaled rate
            ck.restore(payload)
            self._clear_grads()
            details["data_position"] = ck.skip_batches(skip) if skip else ck.data_position()
            details["discarded_checkpoints"] = ck.discard_after(target)
            if command.lr_scale != 1.0 and command.lr_scale_steps > 0:
                details.update(self._start_lr_window(command.lr_scale, command.lr_scale_steps, resume=target + 1))
        except Exception as exc:
            log.exception("fp8guard: restoring the checkpoint of step %d failed", target)
            error = f"{type(exc).__name__}: {exc}"
        errors = [(r, e) for r, e in enumerate(self.gather(error)) if e]
        if errors:
            return (f"rollback to step {target} failed while restoring on {_per_rank(errors)}; the other ranks "
                    f"restored, so the ranks no longer hold the same state: stop the job and restart it from "
                    f"the checkpoint of step {target}")
        return None

    def _clear_grads(self) -> None:
        # Gradients of the abandoned step would otherwise move the restored weights in the
        # optimizer.step() that the loop may still run in this iteration; a None grad is skipped.
        model = self.checkpoints.model if self.checkpoints is not None else None
        if model is not None:
            model.zero_grad(set_to_none=True)
        opt = self._lr_optimizer()
        if opt is not None:
            opt.zero_grad(set_to_none=True)

    # -- learning-rate window --------------------------------------------------------------------

    def _lr_optimizer(self) -> torch.optim.Optimizer | None:
        if self._optimizer is not None:
            return self._optimizer
        return self.checkpoints.optimizer if self.checkpoints is not None else None

    def _start_lr_window(self, scale: float, steps: int, *, resume: int) -> dict[str, Any]:
        info: dict[str, Any] = {"lr_scale": scale, "lr_scale_steps": steps, "lr_restore_step": resume + steps}
        if self._lr_hook is not None:
            self._lr_hook(scale, steps)
            return {**info, "lr_scaled_by": "hook"}
        opt = self._lr_optimizer()
        assert opt is not None  # checked before restoring
        sched = self.checkpoints.scheduler if self.checkpoints is not None else None
        self._window = LrWindow.start([opt], [sched] if sched is not None else [], scale, resume + steps)
        return {**info, "lr_scaled_by": "param_groups"}

    def _end_lr_window(self, *, restore: bool) -> None:
        window, self._window = self._window, None
        if window is not None and restore:
            window.end()

    # -- agreement across ranks ------------------------------------------------------------------

    def gather(self, value: Any) -> list[Any]:
        """``value`` of every rank, in rank order (just ``[value]`` outside torch.distributed)."""
        if not (self._sync and dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return [value]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out


# -- helpers ---------------------------------------------------------------------------------------


def _resolve(name: str, known: Iterable[str]) -> set[str]:
    """The FP8 modules ``name`` denotes: itself, or every one under it if it is a parent."""
    prefix = f"{name}."
    return {k for k in known if k == name or k.startswith(prefix) or name == ""}


def _per_rank(errors: list[tuple[int, str]]) -> str:
    if len(errors) == 1 and errors[0][0] == 0:
        return errors[0][1]
    return "; ".join(f"rank {r}: {e}" for r, e in errors)
