"""transformers ``Trainer`` callback: ``FP8GuardTrainerCallback`` streams ``trainer.train()``.

    from transformers import Trainer
    from fp8guard.agent import MonitorConfig
    from fp8guard.agent.integrations.hf import FP8GuardTrainerCallback

    trainer = Trainer(model, args, train_dataset=ds,
                      callbacks=[FP8GuardTrainerCallback(MonitorConfig(url="http://127.0.0.1:8000"))])
    trainer.train()

**Healing** (``heal=True``; ``save_steps`` makes the rollback targets): the service's commands
apply inside ``train``: BF16 fallback and re-promotion of the named modules, and rollback to a
``checkpoint-N`` folder, restored in place with the Trainer's own loaders, with the step
counter, the data and the learning rate as the command says
(:mod:`fp8guard.agent.integrations._hf_heal`). ``handler=`` applies them your own way.

The Trainer hands callbacks neither its per-step loss, nor its inputs, nor its pre-clipping
gradient norm (the loss and norm only reach ``on_log``, every ``logging_steps``). So at
``on_train_begin`` the callback finds the ``Trainer`` that runs it (the caller of its hook,
looked up once on the call stack; ``callback.bind(trainer)`` names it explicitly) and wraps two
of that instance's methods, for this run only (undone when training ends):

* ``trainer.compute_loss``: every training call's loss (before the Trainer divides it for
  gradient accumulation) and its inputs. The step's loss is the mean over its micro-batches,
  or their sum when the Trainer says each is already normalised over the whole step
  (``loss_is_scaled_for_ga``, or ``num_items_in_batch`` given to a model that takes it, or a
  ``compute_loss_func``), as the Trainer itself adds them up. Subclasses' ``compute_loss``,
  ``compute_loss_func`` and label smoothing are covered: it is the Trainer's own loss.
* ``trainer.accelerator.clip_grad_norm_``: the global gradient norm the Trainer computes every
  step (to clip with ``max_grad_norm``, the default 1.0, or with an infinite bound to log it),
  as it returns it: before clipping, on the device. So the norm is recorded every step, with
  default settings, at no extra cost and without a host sync.

Then, step by step (``state.global_step`` before the update, 0-based), ``on_pre_optimizer_step``
records the step, with the learning rate of the first param group: before ``optimizer.step()``,
so the harm probe (every ``MonitorConfig.harm_interval_steps``) measures the weights the loss
saw. **The harm probe's loss** is ``trainer.compute_loss(model, inputs)`` on the step's last
micro-batch (under gradient accumulation: the last one), in the Trainer's
``compute_loss_context_manager``, under ``torch.no_grad``. ``harm_probe=False`` turns it off.

Without the Trainer (not found on the stack), the callback falls back to what callbacks see: a
forward hook adds up the ``loss`` the model's forward returns in training mode (scaled by the
world size when the Trainer averages tokens across devices) and the probe replays that forward;
the gradient norm is read on the device in ``on_pre_optimizer_step`` when ``max_grad_norm`` is
off, else taken from ``on_log`` on logging steps (a clipped norm would hide every spike); a loss
the forward does not return also comes from ``on_log``. Such a step is recorded once its logs are
in (at ``on_log``, ``on_save``, the next ``on_step_begin`` or ``on_train_end``), after the
optimizer stepped, so it carries no probe.

``on_save`` writes ``fp8guard_monitor.json`` (``Monitor.state_dict()``) into the checkpoint
folder and emits ``checkpoint_saved``; ``on_train_begin`` of a resumed run
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
import inspect
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fp8guard import wire
from fp8guard.agent.commands import CommandHandler
from fp8guard.agent.config import MonitorConfig
from fp8guard.agent.errors import ConfigError, SourceUnavailable
from fp8guard.agent.harm import LossFn
from fp8guard.agent.integrations._common import (
    STATE_FILE,
    align_rank,
    config_with_token,
    loss_in,
    read_state,
    set_instance_attr,
    write_state,
)
from fp8guard.agent.integrations._hf_heal import TrainerHealer
from fp8guard.agent.monitor import Monitor
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
    ``heal=True`` applies the service's commands through the Trainer's checkpoints (module
    docstring); ``handler`` applies them your own way (see ``Monitor.attach``); ``token`` is the service
    token (default: the config's, else ``$FP8GUARD_TOKEN``); ``harm_probe=False`` turns the
    harm probe off. After training the monitor stays readable as ``callback.monitor``.
    """

    def __init__(self, config: MonitorConfig | None = None, *, transport: Transport | None = None,
                 handler: CommandHandler | None = None, token: str | None = None, harm_probe: bool = True,
                 heal: bool = False) -> None:
        self.config = config_with_token(config, token)
        if self.config.grad_buffer:
            raise ConfigError("grad_buffer needs a loop that zeroes gradients in place, and HF's Trainer sets them "
                              "to None every step (model.zero_grad()); leave grad_buffer off")
        self.harm_probe = harm_probe
        self.heal = heal
        self.healer: TrainerHealer | None = None
        self._trainer: Any = None
        self._undo: list[Callable[[], None]] = []  # puts the wrapped Trainer methods back
        self._norm: torch.Tensor | float | None = None  # the Trainer's pre-clipping norm of this step
        self._replay: Callable[[], Any] | None = None  # the step's last micro-batch's loss, again
        self.monitor: Monitor | None = None
        self._live = False
        self._transport = transport
        self._handler = handler
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._clipping = False
        self._loss_sum: torch.Tensor | None = None
        self._loss_n = 0
        self._loss_summed = False  # the model normalised by the whole step's token count
        self._loss_scale = 1
        self._pending: _Pending | None = None

    def bind(self, trainer: Any) -> FP8GuardTrainerCallback:
        """Name the Trainer that runs this callback (found on the call stack at ``on_train_begin``
        otherwise): its ``compute_loss`` and gradient norm are then used. Returns self."""
        self._trainer = trainer
        return self

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
        trainer = self._trainer if self._trainer is not None else _calling_trainer(self)
        healer = None
        if self.heal and self._handler is None:
            if trainer is None:
                log.warning("fp8guard: heal=True needs the Trainer (callback.bind(trainer)); commands are not applied")
            else:
                healer = TrainerHealer(trainer, model, sources=())
                if restored is not None:
                    position = restored.get("data_position")
                    healer.drawn = position if isinstance(position, int) else 0
                    healer.remember(state.global_step, folder)
        monitor.attach(model, optimizer, handler=healer or self._handler)
        if healer is not None:
            healer.remediator.sources = monitor.sources
        self.healer = healer
        align_rank(monitor, int(args.process_index), int(args.world_size), "the Trainer")
        self.monitor, self._live = monitor, True
        self._clipping = bool(args.max_grad_norm) and args.max_grad_norm > 0
        self._pending, self._loss_sum, self._loss_n = None, None, 0
        self._norm, self._replay = None, None
        if trainer is not None:
            self._wrap(trainer)
        else:
            log.info("fp8guard: the Trainer running this callback was not found (callback.bind(trainer) names "
                     "it); losses come from the model's forward, clipped runs' grad norms from the logs")
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
        while self._undo:
            self._undo.pop()()
        if self.healer is not None:
            self.healer.undo()
        self._replay = None
        self.monitor.close(failed=failed)

    # -- the Trainer's own loss, inputs and gradient norm --------------------------------------------------

    def _wrap(self, trainer: Any) -> None:
        """Wrap ``trainer.compute_loss`` and ``trainer.accelerator.clip_grad_norm_`` on the
        instance (see the module docstring). The wrappers only keep references: no device work."""
        compute_loss = trainer.compute_loss  # bound: a subclass's override included

        def capture_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            # compute_loss may pop "labels" (label smoothing): the probe gets the inputs as they came
            snapshot = dict(inputs) if isinstance(inputs, Mapping) else inputs
            out = compute_loss(model, inputs, *args, **kwargs)
            if self._live and torch.is_grad_enabled() and getattr(model, "training", False):
                self._on_compute_loss(trainer, compute_loss, model, snapshot, args, kwargs, out)
            return out

        self._undo.append(set_instance_attr(trainer, "compute_loss", capture_loss))
        accelerator = getattr(trainer, "accelerator", None)
        clip = getattr(accelerator, "clip_grad_norm_", None)
        if clip is None:
            return

        def capture_norm(*args: Any, **kwargs: Any) -> Any:
            norm = clip(*args, **kwargs)
            if self._live and isinstance(norm, torch.Tensor | float):
                self._norm = norm  # the total norm before clipping, as the Trainer logs it
            return norm

        self._undo.append(set_instance_attr(accelerator, "clip_grad_norm_", capture_norm))

    def _on_compute_loss(self, trainer: Any, compute_loss: Callable[..., Any], model: Any, inputs: Any,
                         args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        try:
            loss = out[0] if isinstance(out, tuple) else out
            if not isinstance(loss, torch.Tensor):
                return
            loss = loss.detach().float().mean()  # mean: DataParallel returns one loss per device
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._loss_n += 1
            scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
            if scaled is None:  # as Trainer.training_step decides it
                scaled = (bool(getattr(trainer, "model_accepts_loss_kwargs", False))
                          and kwargs.get("num_items_in_batch") is not None) \
                    or getattr(trainer, "compute_loss_func", None) is not None
            self._loss_summed = bool(scaled)

            def replay() -> Any:
                with trainer.compute_loss_context_manager():
                    again = compute_loss(model, dict(inputs) if isinstance(inputs, Mapping) else inputs,
                                         *args, **kwargs)
                return again[0] if isinstance(again, tuple) else again

            self._replay = replay
        except Exception:  # monitoring must never take training down
            log.exception("fp8guard: capturing the loss failed; this micro-batch goes without it")

    # -- per step -----------------------------------------------------------------------------------

    def _capture_loss(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if not module.training or not self._live or not torch.is_grad_enabled():
            return  # evaluation and prediction forwards, the harm probe's replays
        try:
            loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                loss = loss.detach().float().reshape(())
                self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
                self._loss_n += 1
                self._loss_summed = kwargs.get("num_items_in_batch") is not None
                self._replay = lambda: loss_in(module(*args, **kwargs))
        except Exception:  # a forward hook that raised would stop training
            log.exception("fp8guard: capturing the loss failed; losses now come from the Trainer's logs")
            if self._hook is not None:
                self._hook.remove()
                self._hook = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._commit()
        self._loss_sum, self._loss_n = None, 0  # drop forwards of anything but training steps
        self._norm, self._replay = None, None

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                              **kwargs: Any) -> None:
        monitor = self.monitor
        if not self._live or monitor is None:
            return
        self._commit()
        loss: torch.Tensor | None = self._loss_sum
        if loss is not None and not self._loss_summed:
            loss = loss / self._loss_n
        elif loss is not None and self._loss_scale != 1:
            loss = loss * self._loss_scale
        norm, replay = self._norm, self._replay
        self._loss_sum, self._loss_n, self._norm, self._replay = None, 0, None, None
        try:
            if norm is None and self.config.compute_grad_norm and not self._clipping:
                norm = monitor.grad_norm()  # the Monitor's one GradNorm, built at attach
            groups = getattr(optimizer, "param_groups", None)
            lr = groups[0].get("lr") if groups else None
        except Exception:  # monitoring must never take training down
            log.exception("fp8guard: reading the gradient norm failed; this step goes without it")
            norm, lr = None, None
        step = int(state.global_step)
        if loss is None or (norm is None and self._clipping and self.config.compute_grad_norm):
            # Only the Trainer's logs have them: recorded later, after the weights moved, so no probe.
            self._pending = _Pending(step=step, loss=loss, grad_norm=norm, lr=lr)
            return
        loss_fn = _probe_loss(replay) if self.harm_probe and replay is not None else None
        monitor.step(loss, grad_norm=norm, lr=lr, step=step, loss_fn=loss_fn)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.healer is not None:
            self.healer.settle(state, control)  # a rollback applied in this step: back to its checkpoint

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
                write_state(folder, self.state_dict())
        except OSError as exc:  # the checkpoint itself is saved; only the run id is not kept
            log.warning("fp8guard: cannot write %s into %s: %s", STATE_FILE, folder, exc)
        if self.healer is not None:
            self.healer.remember(state.global_step, folder)
        # A checkpoint at global_step G holds the weights after steps 0..G-1.
        monitor.event(wire.EventKind.CHECKPOINT_SAVED, step=state.global_step - 1 if state.global_step else None,
                      data={"path": folder, "global_step": state.global_step})

    def state_dict(self) -> dict[str, Any]:
        """What ``fp8guard_monitor.json`` holds: ``Monitor.state_dict()`` (and, healing, the data
        position a rollback skips batches from)."""
        state = self.monitor.state_dict() if self.monitor is not None else {}
        if self.healer is not None:
            state["data_position"] = self.healer.drawn
        return state


def _probe_loss(replay: Callable[[], Any]) -> LossFn:
    def loss_fn() -> torch.Tensor:
        loss = replay()
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"the harm probe needs a loss tensor, the replayed step gave {type(loss).__name__}")
        return loss.float().mean()

    return loss_fn


def _calling_trainer(callback: FP8GuardTrainerCallback) -> Any:
    """The ``Trainer`` whose callback handler is calling ``callback`` right now, or None.

    Callbacks are not handed their Trainer; every hook is called from a Trainer method through
    its ``CallbackHandler``, so the Trainer is ``self`` a few frames up. Looked up once per run."""
    try:
        from transformers import Trainer
    except ImportError:  # pragma: no cover - the module imports transformers
        return None
    frame = inspect.currentframe()
    try:
        for _ in range(16):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            handler = getattr(candidate, "callback_handler", None)
            if isinstance(candidate, Trainer) and any(c is callback for c in getattr(handler, "callbacks", ())):
                return candidate
        return None
    finally:
        del frame
