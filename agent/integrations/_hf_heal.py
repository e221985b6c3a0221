"""Healing inside ``Trainer.train``: the service's commands applied through the Trainer's own
``checkpoint-N`` folders (``save_steps``).

A rollback restores ``output_dir/checkpoint-<checkpoint_step + 1>`` in place with the loaders
``train(resume_from_checkpoint=...)`` uses (``_load_from_checkpoint`` for the weights,
``_load_optimizer_and_scheduler``, ``_load_rng_state``). It runs in ``on_pre_optimizer_step``,
where the command arrives; the step's gradients are cleared, so the ``optimizer.step()`` that
follows changes nothing. At ``on_step_end`` (after the Trainer stepped the scheduler and counted
the step) the optimizer and scheduler are loaded again, ``state.global_step`` goes back to the
checkpoint's, that step's logging, saving and evaluation are called off (the loss accumulated
for the next log restarts), and the learning rate is scaled. The batches to skip are drawn and
dropped when the Trainer asks for the next step's batches (``get_batch_samples``, wrapped on the
instance). Folders of later checkpoints are deleted (the main process does it).

The Trainer's epoch loop is fixed when ``train`` starts: the steps a rollback repeats and the
batches it skips come out of the epochs planned, so a run whose data ends before ``max_steps``
ends that many steps short (an iterable dataset, or data for more epochs than planned, does not).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from typing import Any

from fp8guard.agent.errors import CheckpointError
from fp8guard.agent.integrations._common import set_instance_attr
from fp8guard.agent.integrations._heal import FrameworkHealer, Saved, drop
from fp8guard.agent.sources.base import Source

__all__ = ["TrainerHealer"]

log = logging.getLogger("fp8guard.agent")

_NEEDED = ("trainer_state.json", "optimizer.pt", "scheduler.pt")
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
            "adapter_model.safetensors", "adapter_model.bin")


class TrainerHealer(FrameworkHealer):
    """The command handler the Trainer callback builds with ``heal=True``."""

    framework = "Trainer"

    def __init__(self, trainer: Any, model: Any, *, sources: list[Source] | tuple[Source, ...]) -> None:
        super().__init__(sources=sources, model=model, accumulate=int(trainer.args.gradient_accumulation_steps))
        self.trainer = trainer
        self._settle: Saved | None = None
        original = trainer.get_batch_samples

        def get_batch_samples(epoch_iterator: Iterator[Any], num_batches: int, device: Any) -> Any:
            if self.pending_skip:
                self._skip(epoch_iterator)
            samples, items = original(epoch_iterator, num_batches, device)
            self.drew(len(samples))
            return samples, items

        self.undo = set_instance_attr(trainer, "get_batch_samples", get_batch_samples)

    def _skip(self, epoch_iterator: Iterator[Any]) -> None:
        n, self.pending_skip = self.pending_skip, 0
        skipped = drop(epoch_iterator, n)
        if skipped < n:
            log.warning("fp8guard: the epoch ended %d batches into the %d to skip after the rollback", skipped, n)
        self.drew(skipped)

    # -- FrameworkHealer ---------------------------------------------------------------------------

    def _read(self, saved: Saved) -> Saved:
        folder = saved.path
        if not os.path.isdir(folder):
            raise CheckpointError(f"the checkpoint folder of global step {saved.global_step} is gone: {folder}")
        missing = [name for name in _NEEDED if not os.path.isfile(os.path.join(folder, name))]
        if not any(os.path.exists(os.path.join(folder, name)) for name in _WEIGHTS):
            missing.append("the model weights")
        if missing:
            raise CheckpointError(f"{folder} has no {', '.join(missing)}: a rollback restores the weights, the "
                                  "optimizer and the scheduler (save_only_model=False)")
        try:
            with open(os.path.join(folder, "trainer_state.json"), encoding="utf-8") as f:
                step = json.load(f).get("global_step")
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{folder}/trainer_state.json is unreadable: {exc}") from exc
        if step != saved.global_step:
            raise CheckpointError(f"{folder} holds global step {step!r}, expected {saved.global_step}")
        return saved

    def _restore(self, saved: Saved) -> None:
        trainer = self.trainer
        trainer._load_from_checkpoint(saved.path)
        trainer._load_optimizer_and_scheduler(saved.path)
        trainer._load_rng_state(saved.path)
        self._settle = saved

    def _discard(self, saved: Saved) -> None:
        trainer = self.trainer
        if trainer.args.should_save:
            shutil.rmtree(saved.path, ignore_errors=True)
        if os.path.abspath(str(trainer.state.best_model_checkpoint or "")) == os.path.abspath(saved.path):
            trainer.state.best_model_checkpoint = None

    def _optimizers(self) -> list[Any]:
        return [self.trainer.optimizer] if self.trainer.optimizer is not None else []

    def _schedulers(self) -> list[Any]:
        sched = self.trainer.lr_scheduler
        return [getattr(sched, "scheduler", sched)] if sched is not None else []  # accelerate's wrapper

    # -- the step's end ----------------------------------------------------------------------------

    def settle(self, state: Any, control: Any) -> None:
        """At ``on_step_end`` of the step that applied a rollback (module docstring); never raises."""
        saved, self._settle = self._settle, None
        if saved is None:
            return
        trainer = self.trainer
        try:
            trainer._load_optimizer_and_scheduler(saved.path)  # the scheduler stepped after the restore
            state.global_step = saved.global_step
            if hasattr(trainer, "_globalstep_last_logged"):
                trainer._globalstep_last_logged = saved.global_step
            tr_loss = getattr(trainer, "_tr_loss", None)
            if tr_loss is not None:
                tr_loss.zero_()  # the abandoned steps' losses
            control.should_log = control.should_save = control.should_evaluate = False
            control.should_training_stop = state.global_step >= state.max_steps
            self.settled()
        except Exception:
            log.exception("fp8guard: finishing the rollback to %s failed", saved.path)
