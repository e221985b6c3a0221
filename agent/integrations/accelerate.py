"""Accelerate: ``attach_accelerate`` monitors a hand-written loop (Accelerate has no callbacks).

    monitor = attach_accelerate(accelerator, model, optimizer, MonitorConfig(url="http://127.0.0.1:8000"))
    for batch in loader:
        loss = model(**batch).loss; accelerator.backward(loss)
        monitor.step(loss); optimizer.step(); optimizer.zero_grad()   # step() before optimizer.step()
    monitor.close()

**Healing**: ``attach_accelerate(..., heal=HealConfig("ckpt/", every_n_steps=100))`` and
``for batch in monitor.batches(loader):`` (as a plain loop heals): checkpoints are
``accelerator.save_state`` folders, a rollback restores one with ``accelerator.load_state`` at the
next batch, and the data, step counter and learning rate follow the command
(:mod:`fp8guard.agent.integrations._accelerate_heal`). ``handler=`` applies commands your own way.

``attach_accelerate`` attaches a :class:`~fp8guard.agent.Monitor` to the unwrapped model (so
tensor names do not depend on the DDP/FSDP wrapper) and registers two Accelerate hooks (below).

**The harm probe** (every ``MonitorConfig.harm_interval_steps``) needs the current batch's loss
computed again, before ``optimizer.step()``: call ``monitor.step`` there, as above. The monitor
builds that loss itself when the model's forward returns it (a scalar tensor, ``{"loss": ...}``,
an HF ``ModelOutput``, or a tuple holding one scalar tensor, e.g. ``(logits, loss)``): a forward
hook on the model given to ``attach_accelerate`` keeps a reference to the inputs of the last
training forward (grad enabled, training mode), and the probe calls the model again with them,
through the same wrapper and autocast. Under gradient accumulation (``monitor.step`` once per
optimizer step) that is the last micro-batch. When the loss is computed outside the model
(``criterion(model(x), y)``), hand it over: ``monitor.step(loss, loss_fn=lambda: criterion(model(x), y))``
(a ``loss_fn`` given to ``step`` always wins). ``harm_probe=False`` turns the probe off.

The Accelerate hooks:

* ``save_state``: the main process writes ``fp8guard_monitor.json`` (``Monitor.state_dict()``)
  into the checkpoint folder, and a ``checkpoint_saved`` event is recorded. The hook runs when
  the save starts (Accelerate has no post-save hook).
* ``load_state``: the step counters are restored from that file and ``run_resumed`` is recorded.

The run id is fixed at attach. To continue the run of a checkpoint, name it
(``MonitorConfig(run_id=...)`` or ``$FP8GUARD_RUN_ID``) or pass ``resume_from=<checkpoint dir>``,
which reads it from the file before attaching.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

from fp8guard import wire
from fp8guard.agent.commands import CommandHandler
from fp8guard.agent.config import MonitorConfig
from fp8guard.agent.errors import ConfigError
from fp8guard.agent.healing import HealConfig
from fp8guard.agent.integrations._accelerate_heal import AccelerateHealer
from fp8guard.agent.integrations._common import (
    STATE_FILE,
    config_with_token,
    loss_in,
    read_state,
    write_state,
)
from fp8guard.agent.monitor import Monitor
from fp8guard.agent.transport import Transport

__all__ = ["STATE_FILE", "attach_accelerate"]

log = logging.getLogger("fp8guard.agent")

T = TypeVar("T")

"""Written into every ``save_state`` folder; holds ``Monitor.state_dict()``."""


class _AccelerateMonitor(Monitor):
    """A Monitor whose ``step`` hands the harm probe the model's last training forward, replayed,
    when the loop gives no ``loss_fn`` of its own."""

    def __init__(self, config: MonitorConfig, *, transport: Transport | None, harm_probe: bool) -> None:
        super().__init__(config, transport=transport)
        self.harm_probe = harm_probe
        self._replay: Callable[[], torch.Tensor | None] | None = None
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._told = False
        self.accelerate_healer: AccelerateHealer | None = None

    def watch(self, model: torch.nn.Module) -> None:
        """Remember the inputs of ``model``'s training forwards (references only, no device work)."""
        if self.harm_probe and self.config.harm_interval_steps > 0:
            self._hook = model.register_forward_hook(self._remember, with_kwargs=True)

    def _remember(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if not module.training or not torch.is_grad_enabled():
            return  # evaluation forwards and the probe's own replays
        try:
            if loss_in(output) is None:
                if not self._told:
                    self._told = True
                    log.info("fp8guard: %s's forward returns no loss; for the harm probe pass "
                             "monitor.step(loss, loss_fn=lambda: <the batch's loss>)", type(module).__name__)
                return
            self._replay = lambda: loss_in(module(*args, **kwargs))
        except Exception:  # a forward hook that raised would stop training
            log.exception("fp8guard: remembering the forward failed; the harm probe needs monitor.step(loss_fn=...)")

    def batches(self, data: Iterable[T], *, epochs: int | None = 1, steps: int | None = None) -> Iterator[T]:
        """``Monitor.batches``; with ``attach_accelerate(heal=...)`` healing through ``save_state``/
        ``load_state`` (:mod:`fp8guard.agent.integrations._accelerate_heal`)."""
        if self.accelerate_healer is not None:
            return self.accelerate_healer.batches(data, epochs=epochs, steps=steps)
        return super().batches(data, epochs=epochs, steps=steps)

    def step(self, loss: torch.Tensor | float | None = None, **kwargs: Any) -> None:
        """``Monitor.step``; without a ``loss_fn``, the probe replays the last training forward."""
        replay, self._replay = self._replay, None
        if kwargs.get("loss_fn") is None and replay is not None and self.harm_probe:
            kwargs["loss_fn"] = _probe_loss(replay)
        super().step(loss, **kwargs)

    def close(self, *, failed: bool = False, timeout_s: float = 30.0) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._replay = None
        super().close(failed=failed, timeout_s=timeout_s)


def _probe_loss(replay: Callable[[], torch.Tensor | None]) -> Callable[[], torch.Tensor]:
    def loss_fn() -> torch.Tensor:
        loss = replay()
        if loss is None:
            raise TypeError("the harm probe's replayed forward returned no loss")
        return loss

    return loss_fn


def attach_accelerate(
    accelerator: Any,
    model: Any,
    optimizer: Any = None,
    config: MonitorConfig | None = None,
    *,
    transport: Transport | None = None,
    resume_from: str | os.PathLike[str] | None = None,
    handler: CommandHandler | None = None,
    token: str | None = None,
    harm_probe: bool = True,
    heal: HealConfig | None = None,
) -> Monitor:
    """Attach a Monitor to ``model`` (prepared or not) and hook it into ``accelerator``'s
    checkpoints; returns the Monitor, whose ``step(loss)`` the loop calls before
    ``optimizer.step()``. Configuration errors raise here; later only a rollback that fails
    halfway (``CheckpointError``). ``heal``: heal through ``save_state``/``load_state`` (iterate
    ``monitor.batches(loader)``; module docstring); ``handler``: apply commands your own way;
    ``token``: the service token (default: the config's, else ``$FP8GUARD_TOKEN``);
    ``harm_probe=False``: no harm probe built from the model's forward (module docstring)."""
    config = config_with_token(config, token)
    restored = read_state(os.fspath(resume_from)) if resume_from is not None else None
    if restored is not None and config.run_id is None:
        config = dataclasses.replace(config, run_id=str(restored["run_id"]))
    monitor = _AccelerateMonitor(config, transport=transport, harm_probe=harm_probe)
    if restored is not None:
        monitor.load_state_dict(restored)  # before attach: run_started carries the resumed step
    if heal is not None and handler is not None:
        raise ConfigError("pass heal= (rollback through save_state/load_state) or handler= (your own), not both")
    if heal is not None and not isinstance(heal, HealConfig):
        raise ConfigError(f"heal must be a HealConfig, got {type(heal).__name__}")
    unwrapped = accelerator.unwrap_model(model)
    healer = AccelerateHealer(accelerator, unwrapped, optimizer, heal, monitor) if heal is not None else None
    monitor.attach(unwrapped, optimizer, handler=healer or handler)
    if healer is not None:
        healer.remediator.sources = monitor.sources
        monitor.accelerate_healer = healer
    monitor.watch(model)  # the model the loop calls: its replay goes through the same wrapper
    rank, world = int(accelerator.process_index), int(accelerator.num_processes)
    if (monitor.rank, monitor.world_size) != (rank, world):
        log.warning("fp8guard: torch.distributed says rank %d of %d, Accelerate says %d of %d; reporting as %d",
                    monitor.rank, monitor.world_size, rank, world, rank)
        monitor.rank, monitor.world_size = rank, world
    if restored is not None:
        monitor.event(wire.EventKind.RUN_RESUMED, data={"path": os.fspath(resume_from or "")})

    def save_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        # A monitoring problem must not fail the user's checkpoint.
        try:
            if accelerator.is_main_process:
                write_state(output_dir, monitor.state_dict())
            if healer is not None:
                healer.remember(monitor.next_step, os.fspath(output_dir))
            monitor.event(wire.EventKind.CHECKPOINT_SAVED, data={"path": os.fspath(output_dir)})
        except Exception:
            log.exception("fp8guard: could not record the checkpoint in %s", output_dir)

    def load_hook(models: list[Any], input_dir: str) -> None:
        if healer is not None and healer.rolling_back:
            return  # the monitor moved on to a new segment at the rollback; its counters stay
        try:
            state = read_state(os.fspath(input_dir))
            if state is None:
                log.info("fp8guard: %s has no %s; step numbering continues as it was", input_dir, STATE_FILE)
                return
            monitor.load_state_dict(state)
            if state["run_id"] != monitor.run_id:
                log.warning("fp8guard: the checkpoint belongs to run %r but this run reports as %r; pass "
                            "resume_from= or MonitorConfig(run_id=...) to continue the same run",
                            state["run_id"], monitor.run_id)
            monitor.event(wire.EventKind.RUN_RESUMED, data={"path": os.fspath(input_dir)})
        except Exception:
            log.exception("fp8guard: could not restore the monitor state from %s", input_dir)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    return monitor


