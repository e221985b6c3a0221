"""Lightning callback: ``FP8GuardCallback`` streams a ``Trainer.fit`` to the fp8guard service.

    from lightning.pytorch import Trainer
    from fp8guard.agent import MonitorConfig
    from fp8guard.agent.integrations.lightning import FP8GuardCallback

    trainer = Trainer(callbacks=[FP8GuardCallback(MonitorConfig(url="http://127.0.0.1:8000", run_id="gpt-fp8"))])
    trainer.fit(model)

**Healing** (``heal=True``, beside a ``ModelCheckpoint(every_n_train_steps=N)`` whose files are
the rollback targets): the service's commands apply inside ``fit``: BF16 fallback and
re-promotion of the named modules, and rollback to a checkpoint file, restored in place with
Lightning's own loaders, with the step counter, the data and the learning rate as the command
says (:mod:`fp8guard.agent.integrations._lightning_heal`). ``handler=`` applies them your own way.

What happens when:

* ``on_train_start`` (optimizers exist and any ``ckpt_path`` was restored, in every strategy)
  attaches a :class:`~fp8guard.agent.Monitor` to the LightningModule and ``trainer.optimizers[0]``.
* ``on_train_batch_start`` remembers the batch (already on the device) and its index: the harm
  probe's batch. Under gradient accumulation the last micro-batch before the step wins.
* ``on_before_backward`` adds up the loss being backpropagated (automatic optimization: Lightning
  has divided each micro-batch's loss by ``accumulate_grad_batches``, so the sum is the step's
  mean loss; under a 16-bit ``GradScaler`` the scale is divided out on the device).
* ``on_before_optimizer_step`` (the attached optimizer only) reads the global gradient norm on
  the device, after AMP unscaling and before Lightning's gradient clipping, so a spike shows up
  at its real size, and the learning rate before the scheduler moves it, then records the step
  as ``trainer.global_step`` (0-based). It is also where the harm probe runs (every
  ``MonitorConfig.harm_interval_steps``): before the optimizer step, so the weights are the
  ones the loss saw. Nothing here syncs with the host.
* the callback's ``state_dict`` (which Lightning stores in every checkpoint) holds
  ``Monitor.state_dict()``: resuming with ``ckpt_path`` continues the same run id (unless
  ``MonitorConfig.run_id`` names another) and emits ``run_resumed``; every save emits
  ``checkpoint_saved``.
* ``on_exception`` closes the run as failed; ``on_fit_end``/``teardown`` as finished.

**The harm probe's loss** (``harm_probe=True``, the default) re-runs the module's
``training_step`` on the remembered batch, through the strategy (same precision context and
wrapper as training) and under ``torch.no_grad``, and takes the loss from its output (a tensor
or ``{"loss": ...}``). While it runs, ``self.log`` and ``self.log_dict`` are silenced, so
nothing is logged twice. The contract: ``training_step`` computes the loss from the batch and
has no other side effects than logging (no counters, no appended lists, no optimizer calls).
A module that cannot promise that passes its own loss instead,
``harm_probe=lambda module, batch: module.loss_of(batch)``; ``harm_probe=False`` turns the probe
off. Under manual optimization ``training_step`` steps the optimizer itself and the step is
recorded from ``on_train_batch_end`` (the batch's averaged ``outputs["loss"]``), after the
weights moved: the probe is off there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fp8guard import wire
from fp8guard.agent.commands import CommandHandler
from fp8guard.agent.config import MonitorConfig
from fp8guard.agent.errors import SourceUnavailable
from fp8guard.agent.harm import LossFn
from fp8guard.agent.integrations._common import align_rank, config_with_token, loss_in
from fp8guard.agent.integrations._lightning_heal import LightningHealer
from fp8guard.agent.monitor import Monitor
from fp8guard.agent.transport import Transport

try:
    from lightning.pytorch import Callback
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        from pytorch_lightning import Callback  # type: ignore[assignment,no-redef,unused-ignore]
        from pytorch_lightning.utilities.signature_utils import (  # type: ignore[no-redef,unused-ignore]
            is_param_in_hook_signature,
        )
    except ImportError as exc:
        raise SourceUnavailable(
            "fp8guard.agent.integrations.lightning needs Lightning: pip install lightning") from exc

__all__ = ["FP8GuardCallback", "HarmLoss"]

log = logging.getLogger("fp8guard.agent")

HarmLoss = Callable[[Any, Any], torch.Tensor]
"""``(lightning_module, batch) -> loss``: the harm probe's loss for modules whose
``training_step`` must not run twice."""


class FP8GuardCallback(Callback):  # type: ignore[misc,unused-ignore]  # Any without Lightning
    """Monitors the FP8 modules of the LightningModule being fit. See the module docstring.

    ``transport`` replaces the HTTP transport built from ``config.url`` (tests, offline runs);
    ``heal=True`` applies the service's commands through Lightning's checkpoints (module docstring);
    ``handler`` applies them your own way (see ``Monitor.attach``); ``token`` is the service
    token (default: the config's, else ``$FP8GUARD_TOKEN``); ``harm_probe``: True (re-run
    ``training_step``, the default), a ``(module, batch) -> loss`` callable, or False (no probe).
    After ``fit`` the monitor stays readable as ``callback.monitor``.
    """

    def __init__(self, config: MonitorConfig | None = None, *, transport: Transport | None = None,
                 handler: CommandHandler | None = None, token: str | None = None,
                 harm_probe: bool | HarmLoss = True, heal: bool = False) -> None:
        super().__init__()
        self.harm_probe = harm_probe
        self.heal = heal
        self.healer: LightningHealer | None = None
        self.config = config_with_token(config, token)
        self.monitor: Monitor | None = None
        self._live = False  # attached and not yet closed
        self._transport = transport
        self._handler = handler
        self._restored: dict[str, Any] | None = None
        self._resumed_from: int | None = None
        self._optimizer: Any = None
        self._loss: torch.Tensor | None = None
        self._batches = 0
        self._pending: tuple[int, torch.Tensor | None, Any] | None = None  # (step, grad norm, lr)
        self._batch: tuple[Any, int] | None = None  # the last micro-batch and its index

    # -- lifecycle --------------------------------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._live:
            return
        config = self.config
        restored = self._restored
        if restored is not None and config.run_id is None:
            config = dataclasses.replace(config, run_id=str(restored["run_id"]))
        # The callback owns the timing of the gradient norm (see on_before_optimizer_step).
        monitor = Monitor(dataclasses.replace(config, compute_grad_norm=False), transport=self._transport)
        if restored is not None:
            monitor.load_state_dict(restored)  # before attach: run_started carries the resumed step
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        healer = None
        if self.heal and self._handler is None:
            healer = LightningHealer(trainer, pl_module, sources=())
            if restored is not None and trainer.ckpt_path and self._resumed_from is not None:
                position = restored.get("data_position")
                healer.drawn = int(position) if isinstance(position, int) else 0
                healer.remember(self._resumed_from, os.fspath(trainer.ckpt_path))
        monitor.attach(pl_module, optimizer, handler=healer or self._handler)
        if healer is not None:
            healer.remediator.sources = monitor.sources
        self.healer = healer
        align_rank(monitor, int(trainer.global_rank), int(trainer.world_size), "Lightning")
        self.monitor, self._live = monitor, True
        self._optimizer = optimizer
        self._loss, self._batches, self._pending, self._batch = None, 0, None, None
        if self._resumed_from is not None:
            monitor.event(wire.EventKind.RUN_RESUMED, data={"global_step": self._resumed_from})
            self._resumed_from = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close(failed=True)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._close(failed=False)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._close(failed=False)

    def _close(self, *, failed: bool) -> None:
        if self.healer is not None:
            self.healer.undo()
        if self._live and self.monitor is not None:
            self._live = False
            self.monitor.close(failed=failed)
            # A later fit() with this callback continues the run unless a checkpoint says otherwise.
            self._restored = self.monitor.state_dict()

    # -- per step -----------------------------------------------------------------------------

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._live:
            self._batch = (batch, batch_idx)  # a reference: the probe's batch, dropped after the step
            if self.healer is not None:
                self.healer.drew()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if not self._live or not pl_module.automatic_optimization:
            return  # manual optimization: the loss comes from on_train_batch_end
        try:
            loss = loss.detach().float().reshape(())
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            scale = getattr(scaler, "_scale", None)  # GradScaler scaled the loss before this hook
            if isinstance(scale, torch.Tensor) and scaler is not None and scaler.is_enabled():
                loss = loss / scale.to(loss.device)  # device division: no host sync
            self._loss = loss if self._loss is None else self._loss + loss
            self._batches += 1
        except Exception:  # monitoring must never take training down
            log.exception("fp8guard: capturing the loss failed; this step goes without it")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if not self._live or getattr(optimizer, "optimizer", optimizer) is not self._optimizer:
            return
        step = int(trainer.global_step)
        monitor = self.monitor
        try:  # the Monitor's one GradNorm, built at attach
            norm = monitor.grad_norm() if self.config.compute_grad_norm and monitor is not None else None
            groups = getattr(optimizer, "param_groups", None)
            lr = groups[0].get("lr") if groups else None
        except Exception:  # monitoring must never take training down
            log.exception("fp8guard: reading the gradient norm failed; this step goes without it")
            norm, lr = None, None
        if not pl_module.automatic_optimization or monitor is None:
            self._pending = (step, norm, lr)  # recorded in on_train_batch_end
            return
        # Automatic optimization: record now, before the optimizer moves the weights, so the
        # harm probe (when due) measures the weights this step's loss saw.
        monitor.step(self._loss, grad_norm=norm, lr=lr, step=step, loss_fn=self._loss_fn(trainer, pl_module))
        self._loss, self._batches, self._batch = None, 0, None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._record_manual(pl_module, outputs)
        if self.healer is not None:
            self.healer.settle()  # a rollback applied in this batch: back to the checkpoint's step

    def _record_manual(self, pl_module: Any, outputs: Any) -> None:
        monitor = self.monitor
        if not self._live or monitor is None or pl_module.automatic_optimization:
            return  # automatic optimization recorded the step in on_before_optimizer_step
        loss = loss_in(outputs)
        if loss is not None:
            loss = loss.detach().float().reshape(())
            self._loss = loss if self._loss is None else self._loss + loss
            self._batches += 1
        if self._pending is None:
            return  # no optimizer step in this batch
        step, norm, lr = self._pending
        total = self._loss
        if total is not None and self._batches > 1:
            total = total / self._batches  # manual optimization does not normalise the loss
        monitor.step(total, grad_norm=norm, lr=lr, step=step)
        self._loss, self._batches, self._pending, self._batch = None, 0, None, None

    # -- the harm probe's loss ---------------------------------------------------------------------

    def _loss_fn(self, trainer: Any, pl_module: Any) -> LossFn | None:
        """The loss of the step's last micro-batch with the model as it is now (see the module
        docstring); built every step (a closure, no work), run only when the probe is due."""
        if self.harm_probe is False or self._batch is None:
            return None
        batch, batch_idx = self._batch
        own = self.harm_probe if callable(self.harm_probe) else None

        def loss_fn() -> torch.Tensor:
            with _logging_silenced(pl_module):
                if own is not None:
                    with trainer.precision_plugin.train_step_context():
                        output = own(pl_module, batch)
                else:
                    # as Lightning's loop passes them: batch_idx only where training_step takes it
                    args = [batch]
                    if is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2):
                        args.append(batch_idx)
                    output = trainer.strategy.training_step(*args)
            loss = loss_in(output)
            if loss is None:
                raise TypeError(f"the harm probe needs a loss: training_step returned {type(output).__name__}; "
                                "pass FP8GuardCallback(harm_probe=lambda module, batch: ...) or harm_probe=False")
            return loss

        return loss_fn

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Lightning stores this in every checkpoint: the run id, next step and segment (and the
        data position, for a rollback to skip batches from)."""
        if self.monitor is not None:
            state = self.monitor.state_dict()
            if self.healer is not None:
                state["data_position"] = self.healer.drawn
            return state
        return dict(self._restored) if self._restored is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)
        monitor = self.monitor
        if self._live and monitor is not None:
            # Strategies that restore after setup (restore_checkpoint_after_setup) land here after
            # attach: the step counters follow, the run id cannot change any more.
            monitor.load_state_dict(state_dict)
            if state_dict.get("run_id") != monitor.run_id:
                log.warning("fp8guard: the checkpoint belongs to run %r but this run reports as %r; set "
                            "MonitorConfig(run_id=...) to continue the same run", state_dict.get("run_id"),
                            monitor.run_id)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        step = checkpoint.get("global_step")
        self._resumed_from = int(step) if isinstance(step, int) else None
        if self._live and self.monitor is not None and self._resumed_from is not None:
            self.monitor.event(wire.EventKind.RUN_RESUMED, data={"global_step": self._resumed_from})
            self._resumed_from = None

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if not self._live or self.monitor is None:
            return
        step = checkpoint.get("global_step", trainer.global_step)
        # A checkpoint at global_step G holds the weights after steps 0..G-1.
        self.monitor.event(wire.EventKind.CHECKPOINT_SAVED, step=step - 1 if step else None,
                           data={"global_step": step, "epoch": checkpoint.get("epoch")})


@contextlib.contextmanager
def _logging_silenced(pl_module: Any) -> Iterator[None]:
    """``self.log``/``self.log_dict`` do nothing inside: the probe's extra ``training_step``
    must not log a second value for the step (instance attributes shadow the methods, and
    are removed again, leaving whatever the instance had before)."""
    saved = {name: pl_module.__dict__[name] for name in ("log", "log_dict") if name in pl_module.__dict__}

    def quiet(*args: Any, **kwargs: Any) -> None:
        return None

    pl_module.__dict__["log"] = quiet
    pl_module.__dict__["log_dict"] = quiet
    try:
        yield
    finally:
        for name in ("log", "log_dict"):
            if name in saved:
                pl_module.__dict__[name] = saved[name]
            else:
                pl_module.__dict__.pop(name, None)
