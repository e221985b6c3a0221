"""Lightning callback: ``FP8GuardCallback`` streams a ``Trainer.fit`` to the fp8guard service.

    from lightning.pytorch import Trainer
    from fp8guard.agent import MonitorConfig
    from fp8guard.agent.integrations.lightning import FP8GuardCallback

    trainer = Trainer(callbacks=[FP8GuardCallback(MonitorConfig(url="http://127.0.0.1:8000", run_id="gpt-fp8"))])
    trainer.fit(model)

What happens when:

* ``on_train_start`` (optimizers exist and any ``ckpt_path`` was restored, in every strategy)
  attaches a :class:`~fp8guard.agent.Monitor` to the LightningModule and ``trainer.optimizers[0]``.
* ``on_before_optimizer_step`` (the attached optimizer only) reads the global gradient norm on
  the device, after AMP unscaling and before Lightning's gradient clipping, so a spike shows up
  at its real size; also the learning rate before the scheduler moves it.
* ``on_train_batch_end`` adds the batch's loss (``outputs["loss"]``) and, on a batch whose
  optimizer stepped, records the step as ``trainer.global_step`` at that optimizer step (0-based).
  With ``accumulate_grad_batches=k`` Lightning has divided each batch's loss by k, so the sum is
  the step's mean loss. Nothing here syncs with the host.
* the callback's ``state_dict`` (which Lightning stores in every checkpoint) holds
  ``Monitor.state_dict()``: resuming with ``ckpt_path`` continues the same run id (unless
  ``MonitorConfig.run_id`` names another) and emits ``run_resumed``; every save emits
  ``checkpoint_saved``.
* ``on_exception`` closes the run as failed; ``on_fit_end``/``teardown`` as finished.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch

from fp8guard import wire
from fp8guard.agent.commands import Remediator
from fp8guard.agent.config import MonitorConfig
from fp8guard.agent.errors import SourceUnavailable
from fp8guard.agent.integrations._common import align_rank, config_with_token
from fp8guard.agent.monitor import Monitor, device_grad_norm
from fp8guard.agent.transport import Transport

try:
    from lightning.pytorch import Callback
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        from pytorch_lightning import Callback  # type: ignore[assignment,no-redef,unused-ignore]
    except ImportError as exc:
        raise SourceUnavailable(
            "fp8guard.agent.integrations.lightning needs Lightning: pip install lightning") from exc

__all__ = ["FP8GuardCallback"]

log = logging.getLogger("fp8guard.agent")


class FP8GuardCallback(Callback):  # type: ignore[misc,unused-ignore]  # Any without Lightning
    """Monitors the FP8 modules of the LightningModule being fit. See the module docstring.

    ``transport`` replaces the HTTP transport built from ``config.url`` (tests, offline runs);
    ``remediator`` applies the service's commands (see ``Monitor.attach``); ``token`` is the service
    token (default: the config's, else ``$FP8GUARD_TOKEN``).
    After ``fit`` the monitor stays readable as ``callback.monitor``.
    """

    def __init__(self, config: MonitorConfig | None = None, *, transport: Transport | None = None,
                 remediator: Remediator | None = None, token: str | None = None) -> None:
        super().__init__()
        self.config = config_with_token(config, token)
        self.monitor: Monitor | None = None
        self._live = False  # attached and not yet closed
        self._transport = transport
        self._remediator = remediator
        self._restored: dict[str, Any] | None = None
        self._resumed_from: int | None = None
        self._params: list[torch.nn.Parameter] = []
        self._optimizer: Any = None
        self._loss: torch.Tensor | None = None
        self._batches = 0
        self._pending: tuple[int, torch.Tensor | None, Any] | None = None  # (step, grad norm, lr)

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
        monitor.attach(pl_module, optimizer, remediator=self._remediator)
        align_rank(monitor, int(trainer.global_rank), int(trainer.world_size), "Lightning")
        self.monitor, self._live = monitor, True
        self._optimizer = optimizer
        self._params = [p for p in pl_module.parameters() if p.requires_grad]
        self._loss, self._batches, self._pending = None, 0, None
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
        if self._live and self.monitor is not None:
            self._live = False
            self.monitor.close(failed=failed)
            # A later fit() with this callback continues the run unless a checkpoint says otherwise.
            self._restored = self.monitor.state_dict()

    # -- per step -----------------------------------------------------------------------------

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if not self._live or getattr(optimizer, "optimizer", optimizer) is not self._optimizer:
            return
        try:
            norm = device_grad_norm(self._params) if self.config.compute_grad_norm else None
            groups = getattr(optimizer, "param_groups", None)
            lr = groups[0].get("lr") if groups else None
            self._pending = (int(trainer.global_step), norm, lr)
        except Exception:  # monitoring must never take training down
            log.exception("fp8guard: reading the gradient norm failed; this step goes without it")
            self._pending = (int(trainer.global_step), None, None)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        monitor = self.monitor
        if not self._live or monitor is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            loss = loss.detach().float().reshape(())
            self._loss = loss if self._loss is None else self._loss + loss
            self._batches += 1
        if self._pending is None:
            return  # accumulating gradients: the step is recorded on the batch that steps
        step, norm, lr = self._pending
        total = self._loss
        if total is not None and not pl_module.automatic_optimization and self._batches > 1:
            total = total / self._batches  # manual optimization does not normalise the loss
        monitor.step(total, grad_norm=norm, lr=lr, step=step)
        self._loss, self._batches, self._pending = None, 0, None

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Lightning stores this in every checkpoint: the run id, next step and segment."""
        if self.monitor is not None:
            return self.monitor.state_dict()
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




