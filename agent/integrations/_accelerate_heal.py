"""Healing an Accelerate loop through ``accelerator.save_state`` / ``load_state``.

    monitor = attach_accelerate(accelerator, model, optimizer, config, heal=HealConfig("ckpt/", every_n_steps=100))
    for batch in monitor.batches(loader):
        loss = model(**batch).loss; accelerator.backward(loss)
        monitor.step(loss); optimizer.step(); scheduler.step(); optimizer.zero_grad()

The checkpoints are Accelerate's own: every ``every_n_steps`` completed steps, when the loop asks
``monitor.batches`` for the next batch, ``accelerator.save_state(directory/step-<step>)`` saves
what ``accelerator.prepare`` registered (models, optimizers, schedulers, RNG states) and the
position in the data (an object registered with ``register_for_checkpointing``, saved as
Accelerate's ``custom_checkpoint_<i>.pkl``); the ``keep_last`` newest folders are kept. Folders
the loop saves itself with ``save_state`` (its own naming, or Accelerate's automatic naming) are
rollback targets too.

A rollback is validated in ``monitor.step`` (the folder is there with its weights and optimizer
state) and restored at the next batch with ``accelerator.load_state``, which overwrites what
the rest of that iteration did (``optimizer.step()``, ``scheduler.step()``); the data goes back
to the checkpoint's position and ``skip_batches`` further (heal's ``Batches``: re-iterables are
replayed, one-shot iterators only skip forward), later folders are deleted and the learning
rate is scaled. ``HealConfig(resume=True)`` loads the newest folder at the first batch. A restore
that fails once begun raises :class:`~fp8guard.agent.errors.CheckpointError`: the state is then
half-restored and training must not go on.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from fp8guard.agent.errors import CheckpointError
from fp8guard.agent.healing import Batches, HealConfig, drive
from fp8guard.agent.integrations._heal import FrameworkHealer, Saved
from fp8guard.agent.monitor import Monitor

__all__ = ["AccelerateHealer"]

log = logging.getLogger("fp8guard.agent")

T = TypeVar("T")

_FOLDER = re.compile(r"^step-(\d+)$")
_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "pytorch_model_fsdp_0", "model_0.safetensors")


class _DataPosition:
    """Registered with ``accelerator.register_for_checkpointing``: the loop's place in its data."""

    def __init__(self, healer: AccelerateHealer) -> None:
        self.healer = healer

    def state_dict(self) -> dict[str, Any]:
        stream = self.healer.stream
        return stream.state_dict() if stream is not None else {"position": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.healer.loaded_data = dict(state)


class AccelerateHealer(FrameworkHealer):
    """The command handler ``attach_accelerate(..., heal=HealConfig(...))`` builds."""

    framework = "Accelerate"

    def __init__(self, accelerator: Any, model: Any, optimizer: Any, config: HealConfig, monitor: Monitor) -> None:
        super().__init__(sources=(), model=model, accumulate=int(getattr(accelerator, "gradient_accumulation_steps", 1)))
        self.accelerator = accelerator
        self.config = config
        self.monitor = monitor
        self.optimizer = optimizer
        self.stream: Batches[Any] | None = None
        self.loaded_data: dict[str, Any] | None = None
        self._pending: Saved | None = None
        self._skip = 0
        self.rolling_back = False
        """True while ``load_state`` restores a rollback's folder (the monitor's load hook stands aside)."""
        self.directory = os.fspath(config.directory)
        accelerator.register_for_checkpointing(_DataPosition(self))

    # -- the loop's side -------------------------------------------------------------------------

    def batches(self, data: Iterable[T], *, epochs: int | None = 1, steps: int | None = None) -> Iterator[T]:
        stream: Batches[T] = Batches(data, epochs=epochs)
        self.stream = stream
        return self._drive(stream, steps)

    def _drive(self, stream: Batches[T], steps: int | None) -> Iterator[T]:
        if self.config.resume:
            self._resume()
        for batch in drive(stream, lambda: self.monitor.next_step, steps, self._boundary):
            self.drawn = stream.position
            yield batch

    def _boundary(self, completed: bool) -> None:
        if self._pending is not None:
            self._finish()
        elif completed and self.monitor.next_step % self.config.every_n_steps == 0:
            self._save(self.monitor.next_step)

    def _save(self, global_step: int) -> None:
        try:
            auto = self.accelerator.project_configuration.automatic_checkpoint_naming
            self.accelerator.save_state(None if auto else os.path.join(self.directory, f"step-{global_step - 1:09d}"))
        except Exception:  # a full disk must not take training down; the service keeps the older ones
            log.exception("fp8guard: accelerator.save_state after step %d failed; training continues", global_step - 1)
            return
        ours = sorted(s for s, saved in self.saved.items() if _FOLDER.match(os.path.basename(saved.path)))
        for step in ours[:-self.config.keep_last]:
            self._discard(self.saved.pop(step))

    def _resume(self) -> None:
        try:
            names = [n for n in os.listdir(self.directory) if _FOLDER.match(n)]
        except FileNotFoundError:
            return
        if not names:
            return
        path = os.path.join(self.directory, max(names))
        self.accelerator.load_state(path)  # the monitor's state comes back through its load hook
        if self.loaded_data is not None and self.stream is not None:
            self.stream.load_state_dict(self.loaded_data)
        self.remember(self.monitor.next_step, path, position=int((self.loaded_data or {}).get("position", 0)))
        log.warning("fp8guard: resumed from %s", path)

    def _finish(self) -> None:
        saved, self._pending = self._pending, None
        assert saved is not None
        try:
            self.loaded_data = None
            self.rolling_back = True
            try:
                self.accelerator.load_state(saved.path)
            finally:
                self.rolling_back = False
            if self.stream is not None:
                if self.loaded_data is None:
                    raise CheckpointError(f"{saved.path} holds no data position (saved without heal=?)")
                target = dict(self.loaded_data)
                target["position"] = int(target["position"]) + self._skip
                self.stream.load_state_dict(target)
            self.settled()
        except Exception as exc:
            raise CheckpointError(f"restoring {saved.path} after a rollback failed halfway ({type(exc).__name__}: "
                                  f"{exc}); restart the job from that folder") from exc

    # -- FrameworkHealer ---------------------------------------------------------------------------

    def _read(self, saved: Saved) -> Saved:
        if self.stream is None:
            raise CheckpointError("a rollback is restored at the next batch of monitor.batches(loader), which this "
                                  "loop does not iterate: write `for batch in monitor.batches(loader):`")
        folder = saved.path
        if not os.path.isdir(folder):
            raise CheckpointError(f"the save_state folder of step {saved.global_step - 1} is gone: {folder}")
        names = set(os.listdir(folder))
        if not any(n in names for n in _WEIGHTS):
            raise CheckpointError(f"{folder} holds no model weights")
        if self.optimizer is not None and not any(n.startswith("optimizer") for n in names):
            raise CheckpointError(f"{folder} holds no optimizer state")
        return saved

    def _restore(self, saved: Saved) -> None:
        self._pending = saved  # at the next batch: the rest of this iteration runs on the abandoned state

    def _plan_data(self, saved: Saved, skip: int, step: int) -> dict[str, Any]:
        self._skip = skip
        if self.stream is None or saved.position is None:
            return {"skipped_batches": skip}
        return {"data_position": saved.position + skip, "skipped_batches": skip}

    def _discard(self, saved: Saved) -> None:
        if self.accelerator.is_main_process:
            shutil.rmtree(saved.path, ignore_errors=True)

    def _optimizers(self) -> list[Any]:
        return [self.optimizer] if self.optimizer is not None else []

    def _schedulers(self) -> list[Any]:
        return [getattr(s, "scheduler", s) for s in getattr(self.accelerator, "_schedulers", [])]
