"""Healing inside ``Trainer.fit``: the service's commands applied through Lightning's own checkpoints.

A rollback restores the ``.ckpt`` file the trainer saved at global step ``checkpoint_step + 1``
(``ModelCheckpoint(every_n_train_steps=N)`` or ``trainer.save_checkpoint``; the one ``fit``
resumed from counts too) in place, with Lightning's own loaders (the strategy reads the file; the
checkpoint connector restores the module, with its ``on_load_checkpoint`` hook, the precision
plugin, the optimizers and the LR schedulers). It runs inside the optimizer step that the
command arrived in (``on_before_optimizer_step``, or ``on_train_batch_end`` under manual
optimization), whose gradients it clears, so that step changes nothing; at the batch's end
(before ``ModelCheckpoint`` looks at the step) the step counter goes back to the checkpoint's
``global_step`` (``max_steps`` then trains the rolled-back steps again, as a plain loop does),
the schedulers' state and the learning rate are the checkpoint's again (the scheduler stepped
once more after the restore), the data fetcher skips what the command says, and the learning
rate is scaled. Checkpoint files after the restored one are deleted and forgotten by every
``ModelCheckpoint``. Skipping ends with the epoch: what is left then is reported, not carried.
Mid-fit restoring uses Lightning internals of the 2.x line (``trainer._checkpoint_connector``,
the loops' progress counters, ``fit_loop._data_fetcher``); a missing one fails the rollback
with a message, before anything changed.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from fp8guard.agent.errors import CheckpointError
from fp8guard.agent.integrations._common import set_instance_attr
from fp8guard.agent.integrations._heal import FrameworkHealer, Saved, drop
from fp8guard.agent.sources.base import Source

__all__ = ["LightningHealer"]

log = logging.getLogger("fp8guard.agent")


class LightningHealer(FrameworkHealer):
    """The command handler the Lightning callback builds with ``heal=True``."""

    framework = "Lightning"

    def __init__(self, trainer: Any, pl_module: Any, *, sources: list[Source] | tuple[Source, ...]) -> None:
        super().__init__(sources=sources, model=pl_module, accumulate=int(getattr(trainer, "accumulate_grad_batches", 1)))
        self.trainer = trainer
        self._settle: dict[str, Any] | None = None
        self._lrs: list[list[Any]] = []
        original = trainer.save_checkpoint

        def save_checkpoint(filepath: Any, weights_only: bool | None = None, storage_options: Any = None) -> None:
            original(filepath, weights_only, storage_options)
            if not weights_only:  # a weights-only file cannot restore the optimizer
                self.remember(int(trainer.global_step), os.fspath(filepath))

        self.undo = set_instance_attr(trainer, "save_checkpoint", save_checkpoint)

    # -- FrameworkHealer ---------------------------------------------------------------------------

    def _read(self, saved: Saved) -> dict[str, Any]:
        trainer = self.trainer
        for owner, name in ((trainer, "_checkpoint_connector"), (trainer.fit_loop, "epoch_loop")):
            if not hasattr(owner, name):
                raise CheckpointError(f"this Lightning has no {type(owner).__name__}.{name}: rolling back inside fit "
                                      "needs Lightning 2.x")
        if not os.path.exists(saved.path):
            raise CheckpointError(f"the checkpoint of global step {saved.global_step} is gone: {saved.path}")
        ckpt: dict[str, Any] = trainer.strategy.load_checkpoint(saved.path)
        if ckpt.get("global_step") != saved.global_step:
            raise CheckpointError(f"{saved.path} holds global step {ckpt.get('global_step')!r}, expected "
                                  f"{saved.global_step}")
        missing = [k for k in ("state_dict", "optimizer_states", "lr_schedulers") if k not in ckpt]
        if missing:
            raise CheckpointError(f"{saved.path} has no {', '.join(missing)} (saved with save_weights_only=True?): "
                                  "a rollback restores the optimizer too")
        return ckpt

    def _restore(self, ckpt: dict[str, Any]) -> None:
        connector = self.trainer._checkpoint_connector
        connector._loaded_checkpoint = ckpt
        try:
            connector.restore_model()
            connector.restore_precision_plugin_state()
            connector.restore_optimizers_and_schedulers()
        finally:
            connector._loaded_checkpoint = {}
        self._lrs = [[group["lr"] for group in opt.param_groups] for opt in self.trainer.optimizers]
        self._settle = ckpt

    def _discard(self, saved: Saved) -> None:
        self.trainer.strategy.remove_checkpoint(saved.path)
        for cb in self.trainer.checkpoint_callbacks:
            _forget(cb, saved.path)

    def _optimizers(self) -> list[Any]:
        return list(self.trainer.optimizers)

    def _schedulers(self) -> list[Any]:
        return [config.scheduler for config in self.trainer.lr_scheduler_configs]

    # -- the batch's end ---------------------------------------------------------------------------

    def settle(self) -> None:
        """After the batch that applied a rollback (see the module docstring); never raises."""
        ckpt, self._settle = self._settle, None
        if ckpt is None:
            return
        trainer = self.trainer
        try:
            for config, state in zip(trainer.lr_scheduler_configs, ckpt["lr_schedulers"], strict=False):
                config.scheduler.load_state_dict(state)
            for opt, lrs in zip(trainer.optimizers, self._lrs, strict=False):
                for group, lr in zip(opt.param_groups, lrs, strict=False):
                    group["lr"] = lr
            loop = trainer.fit_loop.epoch_loop
            step = int(ckpt["global_step"])
            back = int(trainer.global_step) - step
            if trainer.lightning_module.automatic_optimization:
                total = loop.automatic_optimization.optim_progress.optimizer.step.total
            else:
                total = loop.manual_optimization.optim_step_progress.total
            total.ready -= back
            total.completed -= back
            saved_loop = ckpt.get("loops", {}).get("fit_loop", {}).get("epoch_loop.state_dict", {})
            loop._batches_that_stepped = int(saved_loop.get("_batches_that_stepped", loop._batches_that_stepped - back))
            for cb in trainer.checkpoint_callbacks:
                if hasattr(cb, "_last_global_step_saved"):
                    cb._last_global_step_saved = step  # the file of this step exists: no second save of it
            self.settled()
            self._skip_data()
        except Exception:
            log.exception("fp8guard: finishing the rollback to global step %s failed", ckpt.get("global_step"))

    def _skip_data(self) -> None:
        n, self.pending_skip = self.pending_skip, 0
        fetcher = getattr(self.trainer.fit_loop, "_data_fetcher", None)
        if n <= 0:
            return
        if fetcher is None or type(fetcher).__name__ == "_DataLoaderIterDataFetcher":
            log.warning("fp8guard: cannot skip %d batches after the rollback: training_step takes the dataloader "
                        "iterator itself", n)
            return
        skipped = drop(fetcher, n)
        if skipped < n:
            log.warning("fp8guard: the epoch ended %d batches into the %d to skip after the rollback; the next epoch "
                        "starts from its beginning", skipped, n)
        self.drew(skipped)


def _forget(cb: Any, path: str) -> None:
    """Drop a deleted file from a ``ModelCheckpoint``'s bookkeeping (so it is never reported as the
    best or last checkpoint, nor deleted twice)."""
    best_k = getattr(cb, "best_k_models", None)
    if isinstance(best_k, dict) and best_k.pop(path, None) is not None and best_k:
        ranked = sorted(best_k, key=lambda p: float("nan") if best_k[p] is None else float(best_k[p]),
                        reverse=getattr(cb, "mode", "min") != "min")
        cb.best_model_path, cb.kth_best_model_path = ranked[0], ranked[-1]
        cb.best_model_score, cb.kth_value = best_k[ranked[0]], best_k[ranked[-1]]
    for name in ("best_model_path", "kth_best_model_path", "last_model_path"):
        if getattr(cb, name, None) == path:
            setattr(cb, name, "")
