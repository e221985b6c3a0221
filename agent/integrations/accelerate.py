"""Accelerate: ``attach_accelerate`` monitors a hand-written loop (Accelerate has no callbacks).

    monitor = attach_accelerate(accelerator, model, optimizer, MonitorConfig(url="http://127.0.0.1:8000"))
    for batch in loader:
        loss = model(**batch).loss; accelerator.backward(loss)
        monitor.step(loss); optimizer.step(); optimizer.zero_grad()   # step() before zero_grad
    monitor.close()

``attach_accelerate`` attaches a :class:`~fp8guard.agent.Monitor` to the unwrapped model (so
tensor names do not depend on the DDP/FSDP wrapper) and registers two Accelerate hooks:

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
from typing import Any

from fp8guard import wire
from fp8guard.agent.commands import Remediator
from fp8guard.agent.config import MonitorConfig
from fp8guard.agent.integrations._common import STATE_FILE, config_with_token, read_state, write_state
from fp8guard.agent.monitor import Monitor
from fp8guard.agent.transport import Transport

__all__ = ["STATE_FILE", "attach_accelerate"]

log = logging.getLogger("fp8guard.agent")

"""Written into every ``save_state`` folder; holds ``Monitor.state_dict()``."""


def attach_accelerate(
    accelerator: Any,
    model: Any,
    optimizer: Any = None,
    config: MonitorConfig | None = None,
    *,
    transport: Transport | None = None,
    resume_from: str | os.PathLike[str] | None = None,
    remediator: Remediator | None = None,
    token: str | None = None,
) -> Monitor:
    """Attach a Monitor to ``model`` (prepared or not) and hook it into ``accelerator``'s
    checkpoints; returns the Monitor, whose ``step(loss)`` the loop calls. Configuration errors
    raise here, nothing later does. ``token``: the service token (default: the config's, else
    ``$FP8GUARD_TOKEN``)."""
    config = config_with_token(config, token)
    restored = read_state(os.fspath(resume_from)) if resume_from is not None else None
    if restored is not None and config.run_id is None:
        config = dataclasses.replace(config, run_id=str(restored["run_id"]))
    monitor = Monitor(config, transport=transport)
    if restored is not None:
        monitor.load_state_dict(restored)  # before attach: run_started carries the resumed step
    monitor.attach(accelerator.unwrap_model(model), optimizer, remediator=remediator)
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
            monitor.event(wire.EventKind.CHECKPOINT_SAVED, data={"path": os.fspath(output_dir)})
        except Exception:
            log.exception("fp8guard: could not record the checkpoint in %s", output_dir)

    def load_hook(models: list[Any], input_dir: str) -> None:
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


