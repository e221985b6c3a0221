"""transformers ``Trainer`` callback: ``FP8GuardTrainerCallback`` streams ``trainer.train()``.

    from transformers import Trainer
    from fp8guard.agent import MonitorConfig
    from fp8guard.agent.integrations.hf import FP8GuardTrainerCallback

    trainer = Trainer(model, args, train_dataset=ds,
                      callbacks=[FP8GuardTrainerCallback(MonitorConfig(url="http://127.0.0.1:8000"))])
    trainer.train()

The Trainer hands callbacks neither its per-step loss nor its pre-clipping gradient norm (both
only reach ``on_log``, every ``logging_steps``), so, step by step (``state.global_step`` before
the update, 0-based):

* **loss**: a forward hook on the model adds up the ``loss`` its forward returns in training mode
  (a dict / ``ModelOutput`` with ``loss``): the mean over the step's micro-batches, or their sum
  when the Trainer passed ``num_items_in_batch`` (the model then normalised by the step's token
  count), scaled by the world size when the Trainer averages tokens across devices, as the
  Trainer does. When the forward returns no loss (``compute_loss_func``, label smoothing, tuple
  outputs, ``DataParallel``), the loss comes from ``on_log`` instead: only on logging steps, and
  it is the Trainer's mean over the logging window.
* **gradient norm**: read on the device in ``on_pre_optimizer_step``. That hook runs after the
  Trainer clipped the gradients, so this is the true norm only with ``max_grad_norm`` off (0 or
  None). With clipping on, a clipped norm would hide every spike, so the Trainer's own
  pre-clipping norm from ``on_log`` is used instead, on logging steps only: set
  ``logging_steps=1`` for every step (with its default ``logging_nan_inf_filter`` the Trainer
  syncs with the host every step anyway).
* **learning rate**: the first param group's, before the scheduler steps.

A step is recorded once its logs are in (at ``on_log``, ``on_save``, the next ``on_step_begin``
or ``on_train_end``). ``on_save`` writes ``fp8guard_monitor.json`` (``Monitor.state_dict()``)
into the checkpoint folder and emits ``checkpoint_saved``; ``on_train_begin`` of a resumed run
(``state.global_step > 0``) reads it back from ``output_dir/checkpoint-<step>`` to continue the
same run id (unless ``MonitorConfig.run_id`` names one) and emits ``run_resumed``.
``on_train_end`` closes the run as finished. The Trainer has no exception hook, so a run that
dies stays ``running`` unless the script closes it::

    try:
        trainer.train()
    except BaseException:
        callback.close(failed=True)
        raise
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fp8guard import wire
from fp8guard.agent.commands import Remediator
from fp8guard.agent.config import MonitorConfig
from fp8guard.agent.errors import SourceUnavailable
from fp8guard.agent.integrations._common import (
    STATE_FILE,
    align_rank,
    config_with_token,
    read_state,
    write_state,
)
from fp8guard.agent.monitor import Monitor, device_grad_norm
from fp8guard.agent.transport import Transport

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - depends on what is installed
    raise SourceUnavailable(
        "fp8guard.agent.integrations.hf needs transformers: pip install transformers") from exc

__all__ = ["STATE_FILE", "FP8GuardTrainerCallback"]

log = logging.getLogger("fp8guard.agent")

"""Written into every checkpoint folder; holds ``Monitor.state_dict()``."""


@dataclass
class _Pending:
    """One optimizer step, held until the Trainer's logs for it are in."""

    step: int
    loss: torch.Tensor | float | None
    grad_norm: torch.Tensor | float | None
    lr: Any


class FP8GuardTrainerCallback(TrainerCallback):  # type: ignore[misc,unused-ignore]  # Any without transformers
    """Monitors the FP8 modules of the model a ``Trainer`` trains. See the module docstring.

    ``transport`` replaces the HTTP transport built from ``config.url`` (tests, offline runs);
    ``remediator`` applies the service's commands (see ``Monitor.attach``); ``token`` is the service
    token (default: the config's, else ``$FP8GUARD_TOKEN``).
    After training the monitor stays readable as ``callback.monitor``.
    """

    def __init__(self, config: MonitorConfig | None = None, *, transport: Transport | None = None,
                 remediator: Remediator | None = None, token: str | None = None) -> None:
        self.config = config_with_token(config, token)
        self.monitor: Monitor | None = None
        self._live = False
        self._transport = transport
        self._remediator = remediator
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._params: list[torch.nn.Parameter] = []
        self._clipping = False
        self._loss_sum: torch.Tensor | None = None
        self._loss_n = 0
        self._loss_summed = False  # the model normalised by the whole step's token count
        self._loss_scale = 1
        self._pending: _Pending | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        if self._live:
            return
        if model is None:
            log.warning("fp8guard: the Trainer passed no model to on_train_begin; not monitoring")
            return
        config = self.config
        restored = None
        if state.global_step > 0:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            restored = read_state(folder)
            if restored is None:
                log.info("fp8guard: resumed at step %d without %s in %s; set MonitorConfig(run_id=...) to "
                         "continue the same run", state.global_step, STATE_FILE, folder)
        if restored is not None and config.run_id is None:
            config = dataclasses.replace(config, run_id=str(restored["run_id"]))
        # The callback owns the timing of the gradient norm (see the module docstring).
        monitor = Monitor(dataclasses.replace(config, compute_grad_norm=False), transport=self._transport)
        if restored is not None:
            monitor.load_state_dict(restored)  # before attach: run_started carries the resumed step
        monitor.attach(model, optimizer, remediator=self._remediator)
        align_rank(monitor, int(args.process_index), int(args.world_size), "the Trainer")
        self.monitor, self._live = monitor, True
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._clipping = bool(args.max_grad_norm) and args.max_grad_norm > 0
        self._pending, self._loss_sum, self._loss_n = None, None, 0
        self._loss_scale = int(args.world_size) if getattr(args, "average_tokens_across_devices", False) else 1
        if getattr(args, "n_gpu", 1) <= 1:  # DataParallel runs the hook once per replica and device
            self._hook = model.register_forward_hook(self._capture_loss, with_kwargs=True)
        if restored is not None:
            monitor.event(wire.EventKind.RUN_RESUMED, data={"global_step": state.global_step})

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self, *, failed: bool = False) -> None:
        """Record what is pending and close the run (``failed`` after an exception). Idempotent."""
        if not self._live or self.monitor is None:
            return
        self._commit()
        self._live = False
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.monitor.close(failed=failed)

    # -- per step -----------------------------------------------------------------------------------

    def _capture_loss(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if not module.training or not self._live:
            return  # evaluation and prediction forwards
        try:
            loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                loss = loss.detach().float().reshape(())
                self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
                self._loss_n += 1
                self._loss_summed = kwargs.get("num_items_in_batch") is not None
        except Exception:  # a forward hook that raised would stop training
            log.exception("fp8guard: capturing the loss failed; losses now come from the Trainer's logs")
            if self._hook is not None:
                self._hook.remove()
                self._hook = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._commit()
        self._loss_sum, self._loss_n = None, 0  # drop forwards of anything but training steps

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                              **kwargs: Any) -> None:
        if not self._live:
            return
        self._commit()
        loss: torch.Tensor | None = self._loss_sum
        if loss is not None and not self._loss_summed:
            loss = loss / self._loss_n
        elif loss is not None and self._loss_scale != 1:
            loss = loss * self._loss_scale
        self._loss_sum, self._loss_n = None, 0
        norm = None
        try:
            if self.config.compute_grad_norm and not self._clipping:
                norm = device_grad_norm(self._params)
            groups = getattr(optimizer, "param_groups", None)
            lr = groups[0].get("lr") if groups else None
        except Exception:  # monitoring must never take training down
            log.exception("fp8guard: reading the gradient norm failed; this step goes without it")
            norm, lr = None, None
        self._pending = _Pending(step=int(state.global_step), loss=loss, grad_norm=norm, lr=lr)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        pending = self._pending
        # Training logs come right after the step they describe (global_step was incremented).
        if pending is not None and logs and state.global_step == pending.step + 1:
            if pending.loss is None and isinstance(logs.get("loss"), int | float):
                pending.loss = float(logs["loss"])
            if pending.grad_norm is None and self._clipping and self.config.compute_grad_norm \
                    and isinstance(logs.get("grad_norm"), int | float):
                pending.grad_norm = float(logs["grad_norm"])
        self._commit()

    def _commit(self) -> None:
        pending, monitor = self._pending, self.monitor
        self._pending = None
        if pending is not None and monitor is not None and self._live:
            monitor.step(pending.loss, grad_norm=pending.grad_norm, lr=pending.lr, step=pending.step)

    # -- checkpoints ----------------------------------------------------------------------------------

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        monitor = self.monitor
        if not self._live or monitor is None:
            return
        self._commit()
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        try:
            if args.should_save and os.path.isdir(folder):
                write_state(folder, monitor.state_dict())
        except OSError as exc:  # the checkpoint itself is saved; only the run id is not kept
            log.warning("fp8guard: cannot write %s into %s: %s", STATE_FILE, folder, exc)
        # A checkpoint at global_step G holds the weights after steps 0..G-1.
        monitor.event(wire.EventKind.CHECKPOINT_SAVED, step=state.global_step - 1 if state.global_step else None,
                      data={"path": folder, "global_step": state.global_step})






