"""``Monitor``: the one object a training loop talks to.

    monitor = Monitor(MonitorConfig(url="http://127.0.0.1:8000", run_id="gpt-fp8")).attach(
        model, optimizer, scheduler=scheduler, heal=HealConfig("ckpt/"))   # heal=: optional
    for batch in monitor.batches(data):   # saves checkpoints; a rollback moves the data back
        loss = model(batch); loss.backward()
        monitor.step(loss)            # no host sync; before optimizer.step and zero_grad
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
    monitor.close()

Per step the monitor only enqueues device work into preallocated buffers; every
``flush_interval_steps`` it enqueues one non-blocking device-to-host copy, and a background
thread encodes and ships it. Configuration errors raise at construction or ``attach``; after
that nothing the monitor does can stop training: an internal error is logged once and the
monitor switches itself off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import torch
from torch import nn

from fp8guard import wire
from fp8guard.agent.batch_payload import encode_flush
from fp8guard.agent.checkpoint import Stateful
from fp8guard.agent.command_desk import CommandDesk
from fp8guard.agent.command_listener import CommandListener
from fp8guard.agent.commands import Command, CommandHandler
from fp8guard.agent.config import MonitorConfig
from fp8guard.agent.distributed import command_rank, rank_and_world, reports, shared_run_id
from fp8guard.agent.errors import ConfigError
from fp8guard.agent.grad_buffer import GradBuffer
from fp8guard.agent.harm import HarmProbe, LossFn
from fp8guard.agent.healing import HealConfig, Healer, plain_batches
from fp8guard.agent.shipper import Shipper
from fp8guard.agent.source_steps import SourceSteps
from fp8guard.agent.sources import discover_sources
from fp8guard.agent.sources.base import ProbeableSource, Source, TensorSpec
from fp8guard.agent.telemetry import (
    FP8_LOSS_GAP,
    GRAD_NORM,
    LOSS,
    LOSS_FP8,
    GradNorm,
    StepRing,
)
from fp8guard.agent.transport import HttpTransport, NullTransport, RunInfo, Transport
from fp8guard.agent.tripwire import Tripwire
from fp8guard.agent.urgency import CommandBoundary

__all__ = ["Monitor"]

log = logging.getLogger("fp8guard.agent")

T = TypeVar("T")

_TENSOR_TABLE_EVERY = 20
"""Re-send the tensor table every this many batches, so a service that lost its database
relearns it instead of refusing the run's statistics forever."""


class Monitor:
    """Streams FP8 telemetry of one model to the fp8guard service. See the module docstring."""

    def __init__(self, config: MonitorConfig | None = None, *, transport: Transport | None = None) -> None:
        self.config = config or MonitorConfig()
        self._transport = transport
        self.hears_commands = True
        """Whether a decision can reach this monitor (False behind a ``NullTransport``): a trip
        waits up to ``tripwire_wait_s`` for one only if it can."""
        self._attached = False
        self._closed = False
        self._broken = False
        self._sources: list[Source] = []
        self._specs: list[TensorSpec] = []
        self._slices: list[slice] = []
        self._grad_norm: GradNorm | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._ring: StepRing | None = None
        self._shipper: Shipper | None = None
        self._events: list[dict[str, Any]] = []
        self._batches = 0
        self._next_step = 0
        self._last_flush = time.monotonic()
        self._steps = SourceSteps([])
        self._desk = CommandDesk(self.event)
        self._boundary = CommandBoundary(self, None)
        self._harm: HarmProbe | None = None
        self._listener: CommandListener | None = None
        self.handler: CommandHandler | None = None
        """Applies the service's commands (``attach(handler=...)``, or the Healer of ``heal=``)."""
        self._healer: Healer | None = None
        self.rank, self.world_size = 0, 1
        self.run_id = ""
        self.segment = self.config.segment
        self.reporting = False
        self.command_rank = 0
        """Under torch.distributed, the rank whose received commands every rank applies (the
        lowest reporting rank: only reporting ranks hear the service), broadcast from it."""

    # -- setup ------------------------------------------------------------------------------

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
               scheduler: Stateful | None = None, heal: HealConfig | None = None,
               handler: CommandHandler | None = None) -> Monitor:
        """Find the FP8 modules of ``model`` and start the background shipper. Returns self.

        ``heal=HealConfig("ckpt/")`` lets the service heal the run: checkpoints in that folder
        (model, ``optimizer``, ``scheduler`` (only used with ``heal``), RNG, data position), BF16 fallback and promotion,
        rollback with batch skipping and a lowered learning rate; iterate the data with
        ``for batch in monitor.batches(data):`` (:mod:`fp8guard.agent.healing`). ``handler``
        instead applies the commands your own way (a :class:`~fp8guard.agent.commands.CommandHandler`,
        e.g. a :class:`~fp8guard.agent.remediation.Remediator`). With neither, commands are
        acknowledged as ignored."""
        if self._attached:
            raise ConfigError("this Monitor is already attached; make one Monitor per model")
        if not isinstance(model, nn.Module):
            raise ConfigError(f"attach() needs the torch.nn.Module to monitor, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
        if heal is not None and handler is not None:
            raise ConfigError("pass heal= (fp8guard's checkpoints and rollback) or handler= (your own), not both")
        if heal is not None and not isinstance(heal, HealConfig):
            raise ConfigError(f"heal must be a HealConfig, got {type(heal).__name__}")
        if scheduler is not None and not (callable(getattr(scheduler, "state_dict", None))
                                          and callable(getattr(scheduler, "load_state_dict", None))):
            raise ConfigError("scheduler must have state_dict() and load_state_dict() (an LR scheduler), or be None")
        cfg = self.config
        self.rank, self.world_size = rank_and_world()
        if cfg.grad_buffer and self.world_size > 1:
            raise ConfigError("grad_buffer is for one process: under torch.distributed, DDP (gradient_as_bucket_view) "
                              "or FSDP own the gradients' layout")
        self.run_id = shared_run_id(cfg.run_id)
        self._sources = discover_sources(model, cfg.sources)
        self._steps = SourceSteps(self._sources)
        self.reporting = reports(cfg.report_ranks, self.rank, [src.kind for src in self._sources])
        self.command_rank = command_rank(cfg.report_ranks, self.world_size)
        self._specs = [spec for src in self._sources for spec in src.tensors()]
        start = 0
        for src in self._sources:
            n = len(src.tensors())
            self._slices.append(slice(start, start + n))
            start += n
        self.handler = handler
        if heal is not None:
            self._healer = Healer(heal, monitor=self, model=model, optimizer=optimizer, scheduler=scheduler,
                                  sources=self._sources)
            self.handler = self._healer
        # Under torch.distributed the norm feeds the tripwire's rank-shared bit, which must be
        # bit-identical on every rank: foreach always (the table kernel falls back to foreach on a
        # step where the host runs far ahead, which ranks would do at different steps).
        buffer = GradBuffer(model, model.parameters()) if cfg.grad_buffer and cfg.compute_grad_norm else None
        self._grad_norm = GradNorm(model.parameters(), backend="foreach" if self.world_size > 1 else "auto",
                                   buffer=buffer)
        self._optimizer = optimizer
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._ring = StepRing(n_tensors=len(self._specs), fp8_max=[s.fp8_max for s in self._specs],
                              capacity=cfg.flush_interval_steps, device=device)
        probeable = [s for s in self._sources if isinstance(s, ProbeableSource)]
        if cfg.harm_interval_steps > 0 and probeable:
            # Every rank probes at the same steps (a sharded model's forward is collective).
            self._harm = HarmProbe(probeable, interval_steps=cfg.harm_interval_steps, band_z=cfg.harm_band_z,
                                   min_gap=cfg.harm_min_gap, warmup_probes=cfg.harm_warmup_probes, device=device)
        if cfg.tripwire and (self.reporting or self.world_size > 1):
            # Under torch.distributed every rank keeps one, reporting or not: all of them must
            # read the same verdict at the same boundary to enter the extra broadcast together.
            self._boundary.tripwire = Tripwire(device, loss_factor=cfg.tripwire_loss_factor,
                                      grad_factor=cfg.tripwire_grad_factor, saturation=cfg.tripwire_saturation,
                                      warmup_steps=cfg.tripwire_warmup_steps, lag_steps=cfg.tripwire_lag_steps,
                                      all_reduce=cfg.tripwire_all_reduce and self.world_size > 1,
                                      early_loss_rise=cfg.tripwire_early_loss_rise,
                                      early_grad_factor=cfg.tripwire_early_grad_factor,
                                      early_steps=cfg.tripwire_early_steps,
                                      backend=cfg.tripwire_backend)
        if self.reporting:
            transport = self._transport or self._default_transport(model)
            self._shipper = Shipper(transport, max_queue=cfg.max_pending_flushes)
            self.hears_commands = bool(getattr(transport, "delivers_commands", True))
            if cfg.tripwire and cfg.url is not None and self._transport is None:
                self._listener = CommandListener(cfg.url, self.run_id, self.receive_commands,
                                                 timeout_s=cfg.timeout_s, token=cfg.token)
            self.event(wire.EventKind.RUN_STARTED, step=self._next_step, data={
                "rank": self.rank, "world_size": self.world_size, "sources": [s.kind for s in self._sources],
                "tensors": len(self._specs)})
        if not self._specs:
            log.warning("fp8guard: no FP8 modules found on %s; reporting training scalars only",
                        type(model).__name__)
        self._attached = True
        self._arm_counts_for(self._next_step)
        return self

    def _default_transport(self, model: nn.Module) -> Transport:
        cfg = self.config
        if cfg.url is None:
            log.warning("fp8guard: no url configured (MonitorConfig(url=...) or $FP8GUARD_URL): "
                        "telemetry is measured but not sent")
            return NullTransport()
        run = RunInfo(run_id=self.run_id, model=cfg.model_name or type(model).__name__,
                      recipe={"sources": [s.kind for s in self._sources]}, world_size=self.world_size,
                      config=cfg.run_config)
        # background: training must never wait for the network, not even the shipper's thread
        # (a hung service would fill its queue); what cannot be sent now goes to the spool.
        return HttpTransport(cfg.url, run, token=cfg.token, timeout_s=cfg.timeout_s, backoff_max_s=cfg.retry_max_s,
                             backoff_base_s=min(0.2, cfg.retry_max_s), spool_dir=cfg.spool_dir,
                             spool_max_bytes=cfg.spool_max_bytes, background=True,
                             on_commands=self.receive_commands)

    # -- the per-step call ----------------------------------------------------------------------

    def step(
        self,
        loss: torch.Tensor | float | None = None,
        *,
        grad_norm: torch.Tensor | float | None = None,
        lr: float | torch.Tensor | None = None,
        tokens: int | None = None,
        step: int | None = None,
        loss_fn: LossFn | None = None,
    ) -> None:
        """Record one training step. Enqueues device work only: no host sync.

        ``grad_norm`` defaults to the global L2 norm of the gradients, computed on the device
        (call before ``zero_grad``); ``lr`` to the optimizer's first param group's; ``step``
        to one more than the last. ``loss_fn`` (no arguments: the current batch's loss with
        the model as it is, e.g. ``lambda: loss_of(model(x), y)``) lets the harm probe measure
        what FP8 costs this run every ``harm_interval_steps`` (``fp8guard.agent.harm``); call
        ``step`` before ``optimizer.step()`` so the weights are the ones the loss saw.
        """
        if not self._attached:
            raise ConfigError("call Monitor.attach(model, optimizer) before Monitor.step()")
        current = self._next_step if step is None else step
        self._steps.end_step()
        if self._closed:
            return
        if self._broken or not self.reporting:
            self._next_step = current + 1
        else:
            try:
                self._boundary.answer_tripwire(current)
                self._record(loss, grad_norm, lr, tokens, step, self._probe(current, loss_fn))
            except Exception:  # monitoring must never take training down
                self._broken = True
                log.exception("fp8guard: monitoring failed and is now off for this run; training continues")
                self._next_step = current + 1
                self._steps.stop_counting()
        if self.handler is not None:  # the one caller of on_step: e.g. ends a lowered-LR window
            try:
                self.handler.on_step(current)
            except Exception:
                log.exception("fp8guard: the command handler's on_step failed")
        self._boundary.close_step(current, grad_norm)

    def _probe(self, current: int, loss_fn: LossFn | None) -> torch.Tensor | None:
        """The harm probe's work at this step (``HarmProbe.on_step``); its own failures switch
        the probe off, never the monitor."""
        if self._harm is None or loss_fn is None:
            return None
        force, self._boundary.probe_now = self._boundary.probe_now, False
        try:
            done = self._harm.on_step(current, loss_fn, alone=self.world_size == 1, force=force)
        except Exception:
            self._harm = None
            log.exception("fp8guard: the harm probe failed and is now off for this run; monitoring continues")
            return None
        for kind, data in done.events:
            self.event(kind, step=current, data=data)
        if done.hurry:
            self._boundary.hurry(current)
        return done.measured

    def _record(self, loss: torch.Tensor | float | None, grad_norm: torch.Tensor | float | None,
                lr: float | torch.Tensor | None, tokens: int | None, step: int | None,
                probe: torch.Tensor | None = None) -> None:
        ring = self._ring
        assert ring is not None
        current = self._next_step if step is None else step
        i = ring.slot()
        if loss is not None:
            _put(ring.scalars[i, LOSS], loss)
        if grad_norm is None and self.config.compute_grad_norm:
            grad_norm = self.grad_norm()
        if grad_norm is not None:
            _put(ring.scalars[i, GRAD_NORM], grad_norm)
        for src, sl in zip(self._sources, self._slices, strict=True):
            src.read(ring.stats[i, :, sl])
        if self._steps.counting:
            j = len(ring.count_steps)
            for src, sl in zip(self._sources, self._slices, strict=True):
                if src.supports_counts:
                    src.read_counts(ring.counts[j, :, sl])
            ring.count_steps.append(current)
        if lr is None and self._optimizer is not None and self._optimizer.param_groups:
            lr = self._optimizer.param_groups[0].get("lr")
        tripwire = self._boundary.tripwire
        if tripwire is not None:
            tripwire.check(current, tick=self._boundary.tick, loss=ring.scalars[i, LOSS] if loss is not None else None,
                                 grad_norm=ring.scalars[i, GRAD_NORM] if grad_norm is not None else None,
                                 saturation=ring.saturation(i) if self._specs else None)
        if probe is not None:
            ring.scalars[i, LOSS_FP8:FP8_LOSS_GAP + 1].copy_(probe)
        ring.commit_step(current, loss_given=loss is not None, norm_given=grad_norm is not None,
                         lr=lr, tokens=tokens, probed=probe is not None)
        self._next_step = current + 1
        self._arm_counts_for(self._next_step)
        if ring.full or time.monotonic() - self._last_flush >= self.config.flush_interval_s:
            self._flush()

    # -- commands -----------------------------------------------------------------------------

    def receive_commands(self, commands: Iterable[Mapping[str, Any] | Command]) -> None:
        """Queue commands from the service (called by the transport's thread, or by tests);
        raw JSON is validated here, at the boundary, and a malformed command is logged and dropped."""
        self._desk.receive(commands)

    def _check_commands(self, step: int) -> None:
        commands = self._desk.take(rank=self.rank, world_size=self.world_size, src=self.command_rank)
        if commands and self._boundary.tripwire is not None:
            # Pending verdicts describe the state before these commands (a rollback abandons it):
            # every rank drops them at this same boundary, so their due reads stay in agreement.
            self._boundary.tripwire.discard()
        for command in commands:
            resume_step = self._desk.apply(command, step, self.handler)
            if resume_step is not None:
                # Telemetry recorded so far belongs to the abandoned stretch: ship it under the old
                # segment, then continue in a new one from the restored step.
                if self.reporting and not self._broken:
                    self._flush()
                self.segment += 1
                self._next_step = resume_step
                self._arm_counts_for(self._next_step)

    def grad_norm(self) -> torch.Tensor | None:
        """The global L2 norm of the attached model's gradients now, on the device (no host sync;
        None before ``attach`` or without gradients): the Monitor's one
        :class:`~fp8guard.agent.telemetry.GradNorm`, built at ``attach`` (its tables too), for
        integrations that record the norm at their own moment."""
        return self._grad_norm() if self._grad_norm is not None else None

    def _arm_counts_for(self, step: int) -> None:
        self._steps.arm_counts_for(step, every=self.config.count_interval_steps, reporting=self.reporting,
                                   stagger=self.config.count_stagger)

    def set_count_interval(self, steps: int) -> None:
        """Change the exact-count cadence from the next step on (0 turns counting off), e.g. count
        every step while investigating an incident and every 100th otherwise."""
        if steps < 0:
            raise ConfigError(f"count interval must be >= 0 (0 turns counting off), got {steps}")
        self.config.count_interval_steps = int(steps)
        if self._attached and not self._closed and not self._broken:
            self._arm_counts_for(self._next_step)

    # -- shipping ---------------------------------------------------------------------------------

    def _flush(self) -> None:
        ring, shipper = self._ring, self._shipper
        assert ring is not None
        self._last_flush = time.monotonic()
        if shipper is None or (len(ring) == 0 and not self._events):
            return
        packet = ring.drain()
        packet.events, self._events = self._events, []
        include_table = self._batches % _TENSOR_TABLE_EVERY == 0
        self._batches += 1
        segment, specs, run_id, rank = self.segment, self._specs, self.run_id, self.rank
        shipper.submit(lambda: encode_flush(packet, run_id=run_id, rank=rank, segment=segment, specs=specs,
                                            include_table=include_table),
                       steps=len(set(packet.steps) | set(packet.count_steps)))

    def event(self, kind: wire.EventKind | str, *, data: dict[str, Any] | None = None, step: int | None = None) -> None:
        """Record a run event (checkpoint saved, ...); it ships with the next flush."""
        kind = wire.EventKind(kind)
        if self.reporting and not self._closed:
            if step is None:
                step = self._next_step - 1 if self._next_step > 0 else None
            self._events.append({"kind": kind.value, "step": step,
                                 "time": time.time(), "data": data or {}})

    def flush(self, timeout_s: float = 30.0) -> None:
        """Ship what was recorded so far and wait until the transport took it (tests, checkpoints)."""
        if self._attached and not self._broken and self.reporting:
            self._flush()
            if self._shipper is not None:
                self._shipper.flush(timeout_s)

    def close(self, *, failed: bool = False, timeout_s: float = 30.0) -> None:
        """Flush, report the run finished (or failed) and stop the shipper. Idempotent."""
        if self._closed or not self._attached:
            self._closed = True
            return
        if self.reporting and not self._broken:
            self.event(wire.EventKind.RUN_FAILED if failed else wire.EventKind.RUN_FINISHED)
            try:
                self._flush()
            except Exception:
                log.exception("fp8guard: final flush failed")
        self._closed = True
        if self._shipper is not None:
            self._shipper.close(timeout_s)
        if self._listener is not None:
            self._listener.close()
        self._steps.stop_counting()
        if self._grad_norm is not None and self._grad_norm.buffer is not None:
            self._grad_norm.buffer.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close(failed=exc is not None)

    # -- introspection ---------------------------------------------------------------------------

    def batches(self, data: Iterable[T], *, epochs: int | None = 1, steps: int | None = None) -> Iterator[T]:
        """Iterate ``data`` (``epochs`` times; None: forever) as the training loop's batches,
        until ``next_step`` reaches ``steps`` if given (a step budget that rollbacks extend).

        With ``attach(heal=...)`` this is where healing meets the loop: a due checkpoint is
        saved when the loop asks for the batch after a completed step, and a rollback restores
        the checkpoint, moves the data back to its position and skips the batches the service
        says (:mod:`fp8guard.agent.healing`). Without ``heal`` it just iterates."""
        if self._healer is not None:
            return self._healer.batches(data, epochs=epochs, steps=steps)
        return plain_batches(data, epochs=epochs, steps=steps, monitor=self)

    @property
    def healer(self) -> Healer | None:
        """The Healer of ``attach(heal=...)`` (its ``checkpoints`` and ``remediator``), else None."""
        return self._healer

    def resume_from(self, state: dict[str, Any], *, checkpoint_step: int) -> None:
        """Continue after a restart from a checkpoint that carried :meth:`state_dict`: the step
        counter and applied commands come back, and a new segment starts (the steps the stopped
        process ran after the checkpoint are an abandoned stretch, as after a rollback)."""
        self.load_state_dict(state)
        self.segment += 1
        self._arm_counts_for(self._next_step)
        self.event(wire.EventKind.RUN_RESUMED, step=checkpoint_step,
                   data={"checkpoint_step": checkpoint_step, "resume_step": self._next_step, "segment": self.segment})

    @property
    def tripwire_broadcasts(self) -> int:
        """Extra command broadcasts entered after the tripwire fired (none in a healthy run)."""
        return self._boundary.broadcasts

    @property
    def _tripwire(self) -> Tripwire | None:
        """This rank's tripwire (None without one, or after it failed)."""
        return self._boundary.tripwire

    @property
    def next_step(self) -> int:
        """The step number the next ``step()`` call records (after a rollback: checkpoint + 1)."""
        return self._next_step

    @property
    def tensors(self) -> Sequence[TensorSpec]:
        return tuple(self._specs)

    @property
    def sources(self) -> Sequence[Source]:
        return tuple(self._sources)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must carry for a resumed run to continue this one."""
        return {"run_id": self.run_id, "next_step": self._next_step, "segment": self.segment,
                "applied_commands": sorted(self._desk.applied_ids)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._next_step = int(state["next_step"])
        self.segment = int(state["segment"])
        self._desk.applied_ids |= set(state.get("applied_commands", []))


def _put(slot: torch.Tensor, value: torch.Tensor | float) -> None:
    """Write a scalar into a device slot: a device copy for tensors, a fill kernel for Python
    numbers (no host tensor, so no host-to-device copy from pageable memory)."""
    if isinstance(value, torch.Tensor):
        slot.copy_(value.detach().reshape(()), non_blocking=True)
    else:
        slot.fill_(float(value))
