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
import warnings
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from fp8guard import wire
from fp8guard.agent.checkpoint import Stateful
from fp8guard.agent.command_listener import CommandListener
from fp8guard.agent.commands import AckStatus, Command, CommandHandler, Outcome, parse_command
from fp8guard.agent.config import MonitorConfig
from fp8guard.agent.distributed import rank_and_world, shared_run_id
from fp8guard.agent.errors import ConfigError
from fp8guard.agent.harm import HarmProbe, LossFn
from fp8guard.agent.healing import HealConfig, Healer, plain_batches
from fp8guard.agent.kernels import sum_of_squares_into, triton_available
from fp8guard.agent.shipper import Shipper
from fp8guard.agent.sources import discover_sources
from fp8guard.agent.sources.base import COUNT_STATS, STATS, ProbeableSource, Source, TensorSpec
from fp8guard.agent.telemetry import FP8_LOSS_GAP, GRAD_NORM, LOSS, LOSS_FP8, FlushPacket, StepRing
from fp8guard.agent.transport import HttpTransport, NullTransport, RunInfo, Transport
from fp8guard.agent.tripwire import Tripwire

__all__ = ["Monitor", "device_grad_norm"]

log = logging.getLogger("fp8guard.agent")

T = TypeVar("T")

_STALE_CHECK_STEPS = 10
"""After this many ``step`` calls, ask each source once whether its FP8 state ever changed
(``stale_reason``, host only) and warn loudly if not: silent zeros are worse than no data."""

_TENSOR_TABLE_EVERY = 20
"""Re-send the tensor table every this many batches, so a service that lost its database
relearns it instead of refusing the run's statistics forever."""
_MAX_UNANSWERED_WAITS = 3
"""Tripwire waits in a row without a decision after which a persisting trip only ships."""


class Monitor:
    """Streams FP8 telemetry of one model to the fp8guard service. See the module docstring."""

    def __init__(self, config: MonitorConfig | None = None, *, transport: Transport | None = None) -> None:
        self.config = config or MonitorConfig()
        self._transport = transport
        self._attached = False
        self._closed = False
        self._broken = False
        self._sources: list[Source] = []
        self._specs: list[TensorSpec] = []
        self._slices: list[slice] = []
        self._params: list[nn.Parameter] = []
        self._norm_workspace: dict[str, Any] = {}
        self._optimizer: torch.optim.Optimizer | None = None
        self._ring: StepRing | None = None
        self._shipper: Shipper | None = None
        self._events: list[dict[str, Any]] = []
        self._batches = 0
        self._next_step = 0
        self._last_flush = time.monotonic()
        self._counting = False
        self._inbox: deque[Command] = deque()
        self._tripwire: Tripwire | None = None
        self._harm: HarmProbe | None = None
        self._probe_now = False
        """The tripwire fired: run the harm probe at this step, due or not."""
        self._listener: CommandListener | None = None
        self._urgent_until: int | None = None
        """After the tripwire fired: check commands at every step boundary up to this step."""
        self._urgent_waited = False
        self._unanswered_waits = 0
        """Waits for a decision in a row that no command answered: a trip that persists (a level
        shift the service does not call an incident) stops costing ``tripwire_wait_s`` per step
        after ``_MAX_UNANSWERED_WAITS`` of them."""
        self._tick = 0
        """Monitor.step calls so far: the same count on every rank, whatever the step numbers do
        (a rollback moves them back); the tripwire's fixed-lag read is counted in these."""
        self._extra_broadcast_tick: int | None = None
        """The last boundary at which every rank entered a tripwire's extra command broadcast."""
        self.tripwire_broadcasts = 0
        """Extra command broadcasts entered after the tripwire fired (none in a healthy run)."""
        self._applied_ids: set[int] = set()
        self._step_calls = 0
        self._end_failed: set[str] = set()
        self.handler: CommandHandler | None = None
        """Applies the service's commands (``attach(handler=...)``, or the Healer of ``heal=``)."""
        self._healer: Healer | None = None
        self.rank, self.world_size = 0, 1
        self.run_id = ""
        self.segment = self.config.segment
        self.reporting = False

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
        self.run_id = shared_run_id(cfg.run_id)
        self._sources = discover_sources(model, cfg.sources)
        self.reporting = self._decide_reporting()
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
        self._params = [p for p in model.parameters() if p.requires_grad]
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
            self._tripwire = Tripwire(device, loss_factor=cfg.tripwire_loss_factor,
                                      grad_factor=cfg.tripwire_grad_factor, saturation=cfg.tripwire_saturation,
                                      warmup_steps=cfg.tripwire_warmup_steps, lag_steps=cfg.tripwire_lag_steps,
                                      all_reduce=cfg.tripwire_all_reduce and self.world_size > 1,
                                      early_loss_rise=cfg.tripwire_early_loss_rise,
                                      early_grad_factor=cfg.tripwire_early_grad_factor,
                                      early_steps=cfg.tripwire_early_steps)
        if self.reporting:
            transport = self._transport or self._default_transport(model)
            self._shipper = Shipper(transport, max_queue=cfg.max_pending_flushes)
            if cfg.tripwire and cfg.url is not None and self._transport is None:
                self._listener = CommandListener(cfg.url, self.run_id, self.receive_commands, timeout_s=cfg.timeout_s,
                                                 token=cfg.token)
            self.event(wire.EventKind.RUN_STARTED, step=self._next_step, data={
                "rank": self.rank, "world_size": self.world_size, "sources": [s.kind for s in self._sources],
                "tensors": len(self._specs)})
        if not self._specs:
            log.warning("fp8guard: no FP8 modules found on %s; reporting training scalars only",
                        type(model).__name__)
        self._attached = True
        self._arm_counts_for(self._next_step)
        return self

    def _decide_reporting(self) -> bool:
        choice = self.config.report_ranks
        if choice == "all":
            return True
        if choice == "zero":
            return self.rank == 0
        if choice == "auto":
            # TE all-reduces amaxes over the data-parallel group: replicas would send identical data.
            replicated = any(src.kind == "te" for src in self._sources)
            return self.rank == 0 or not replicated
        return self.rank in set(choice)

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
        self._end_fp8_step()
        if self._closed:
            return
        if self._broken or not self.reporting:
            self._next_step = current + 1
        else:
            try:
                self._answer_tripwire(current)
                self._record(loss, grad_norm, lr, tokens, step, self._probe(current, loss_fn))
            except Exception:  # monitoring must never take training down
                self._broken = True
                log.exception("fp8guard: monitoring failed and is now off for this run; training continues")
                self._next_step = current + 1
                self._stop_counting()
        if self.handler is not None:  # the one caller of on_step: e.g. ends a lowered-LR window
            try:
                self.handler.on_step(current)
            except Exception:
                log.exception("fp8guard: the command handler's on_step failed")
        self._command_boundary(current, grad_norm)

    def _end_fp8_step(self) -> None:
        """Close the step in sources whose library needs it (the emulation's scale update when the
        loop has no ``fp8.update()``): training numerics, so on every rank, reporting or not;
        once after ``_STALE_CHECK_STEPS`` calls, warn about a source whose state never changed."""
        for src in self._sources:
            end = getattr(src, "end_step", None)
            if end is not None and src.kind not in self._end_failed:
                try:
                    end()
                except Exception:
                    self._end_failed.add(src.kind)
                    log.exception("fp8guard: closing the FP8 step in the %s source failed; not tried again", src.kind)
        self._step_calls += 1
        if self._step_calls == _STALE_CHECK_STEPS:
            for src in self._sources:
                reason = getattr(src, "stale_reason", None)
                message = reason() if reason is not None else None
                if message:
                    log.warning("%s", message)
                    warnings.warn(message, RuntimeWarning, stacklevel=3)

    # -- the tripwire ---------------------------------------------------------------------------

    def _answer_tripwire(self, current: int) -> None:
        """If an earlier step's device check has completed and fired (``Tripwire.peek``, no
        wait): ship everything now and listen for the decision. Rank-local work only: ranks see
        a check complete at different steps, so no collective may hang on this; the boundary
        where every rank acts on a verdict together is ``_tripwire_due``'s."""
        if self._tripwire is None:
            return
        # one process consumes what it read (nothing waits for the lagged read); ranks keep their
        # verdicts for ``due``
        fired = self._tripwire.fired() if self.world_size == 1 else self._tripwire.peek()
        if fired is None:
            return
        log.warning("fp8guard: the tripwire fired at step %d; shipping telemetry now", fired)
        self._hurry(current)
        # Does the anomaly cost the loss? Probe this step (one process: a rank-local trip must
        # not start forwards that other ranks of a sharded model would not join).
        self._probe_now = self.world_size == 1

    def _hurry(self, current: int) -> None:
        """Ship what is recorded now and listen for the decision (a tripped tripwire, a measured
        harm); this rank's work only."""
        self._flush()
        self._urgent_until = current + self.config.command_check_interval_steps
        self._urgent_waited = False
        if self._listener is not None:
            self._listener.listen(30.0, after=max(self._applied_ids, default=0))

    def _command_boundary(self, current: int, grad_norm: torch.Tensor | float | None) -> None:
        """The end of every ``step`` call, on every rank, whatever it reports: commands apply here.

        Under torch.distributed a broadcast is entered by all ranks or by none, and the branch
        taken depends only on what is the same on every rank: the step call count (every
        ``command_check_interval_steps``) and the tripwire's verdict due at this boundary (read
        at a fixed lag, ``Tripwire.due``). A single process applies what has arrived at once."""
        every_n = (current + 1) % self.config.command_check_interval_steps == 0
        extra = self._tripwire_due(self._tick, current, grad_norm)
        self._tick += 1
        if extra:
            # Rank 0's inbox is what the broadcast sends: give the decision its moment to arrive
            # (the other ranks wait in the broadcast meanwhile).
            self._await_decision()
            if not every_n:
                self.tripwire_broadcasts += 1
        if every_n or extra:
            # Every rank reaches this at the same step: the broadcast in _check_commands must be
            # entered by all of them.
            self._check_commands(current)
        elif self.world_size == 1 and self._urgent_until is not None:
            self._urgent_check(current)
        elif self.world_size == 1 and self._inbox:
            # One process needs no broadcast: a command that has arrived applies at this step.
            self._check_commands(current)

    def _tripwire_due(self, tick: int, current: int, grad_norm: torch.Tensor | float | None) -> bool:
        """Read the verdict due at boundary ``tick``; True when every rank is to enter an extra
        command broadcast now (under torch.distributed, the shared bit fired, and no extra
        broadcast in the last ``command_check_interval_steps`` boundaries: a run that keeps
        tripping is answered at the every-N broadcasts, never held up at each step).

        A verdict that no peek saw (the host ran ahead of the device) makes this rank hurry now;
        a single process then applies the decision at this boundary."""
        trip = self._tripwire
        if trip is None or self.world_size == 1:
            # One process needs no agreement: ``peek`` (never waits) answers it. The lagged read
            # would cap how far the host runs ahead of the device at every step (on the H200 a
            # torchao loop's monitor.step waited 255 ms there).
            return False
        try:
            if self.world_size > 1 and not trip.checked(tick):
                # A rank that does not report (or whose monitoring broke) still checks the shared
                # quantity, so that its verdicts stay the other ranks' verdicts.
                trip.check(current, tick=tick, loss=None, grad_norm=self._shared_grad_norm(grad_norm, trip.device),
                           saturation=None)
            verdict = trip.due(tick)
        except Exception:
            self._tripwire = None
            log.exception("fp8guard: the tripwire failed and is now off on this rank; training continues")
            return False
        if verdict is None or not verdict.fired:
            return False
        if not verdict.peeked:
            log.warning("fp8guard: the tripwire fired at step %d; shipping telemetry now", verdict.step)
            if self.reporting and not self._broken:
                try:
                    self._hurry(current)
                except Exception:
                    log.exception("fp8guard: shipping after the tripwire failed")
        if self.world_size == 1 or not verdict.shared:
            return False
        last = self._extra_broadcast_tick
        if last is not None and tick - last < self.config.command_check_interval_steps:
            return False
        self._extra_broadcast_tick = tick
        return True

    def _shared_grad_norm(self, grad_norm: torch.Tensor | float | None, device: torch.device) -> torch.Tensor | None:
        """The gradient norm as ``_record`` gives it to the tripwire (float32 on the device), for
        ranks that do not record."""
        if grad_norm is None:
            return self._device_grad_norm() if self.config.compute_grad_norm else None
        if isinstance(grad_norm, torch.Tensor):
            return grad_norm.detach().reshape(()).to(device=device, dtype=torch.float32, non_blocking=True)
        return torch.full((), float(grad_norm), dtype=torch.float32, device=device)

    def _await_decision(self) -> None:
        """On rank 0 (or alone), wait up to ``tripwire_wait_s`` for a command to arrive; only at
        a boundary where the tripwire's verdict is due and fired, never in a healthy run."""
        if self.rank != 0 or self.config.tripwire_wait_s <= 0:
            return
        deadline = time.monotonic() + self.config.tripwire_wait_s
        while not self._inbox and time.monotonic() < deadline:
            time.sleep(0.002)

    def _urgent_check(self, current: int) -> None:
        assert self._urgent_until is not None
        if (not self._inbox and not self._urgent_waited and self.config.tripwire_wait_s > 0
                and self._unanswered_waits < _MAX_UNANSWERED_WAITS):
            # Only after the tripwire fired, once: the decision is usually tens of ms away.
            self._urgent_waited = True
            deadline = time.monotonic() + self.config.tripwire_wait_s
            while not self._inbox and time.monotonic() < deadline:
                time.sleep(0.002)
            self._unanswered_waits = 0 if self._inbox else self._unanswered_waits + 1
        applied = len(self._applied_ids)
        self._check_commands(current)
        if len(self._applied_ids) > applied or current >= self._urgent_until:
            self._urgent_until = None

    def _probe(self, current: int, loss_fn: LossFn | None) -> torch.Tensor | None:
        """The harm probe's work at this step (``HarmProbe.on_step``); its own failures switch
        the probe off, never the monitor."""
        if self._harm is None or loss_fn is None:
            return None
        force, self._probe_now = self._probe_now, False
        try:
            done = self._harm.on_step(current, loss_fn, alone=self.world_size == 1, force=force)
        except Exception:
            self._harm = None
            log.exception("fp8guard: the harm probe failed and is now off for this run; monitoring continues")
            return None
        for kind, data in done.events:
            self.event(kind, step=current, data=data)
        if done.hurry:
            self._hurry(current)
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
            grad_norm = self._device_grad_norm()
        if grad_norm is not None:
            _put(ring.scalars[i, GRAD_NORM], grad_norm)
        for src, sl in zip(self._sources, self._slices, strict=True):
            src.read(ring.stats[i, :, sl])
        if self._counting:
            j = len(ring.count_steps)
            for src, sl in zip(self._sources, self._slices, strict=True):
                if src.supports_counts:
                    src.read_counts(ring.counts[j, :, sl])
            ring.count_steps.append(current)
        if lr is None and self._optimizer is not None and self._optimizer.param_groups:
            lr = self._optimizer.param_groups[0].get("lr")
        if self._tripwire is not None:
            self._tripwire.check(current, tick=self._tick, loss=ring.scalars[i, LOSS] if loss is not None else None,
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
        for raw in commands:
            if isinstance(raw, Command):
                self._inbox.append(raw)
                continue
            try:
                self._inbox.append(parse_command(raw))
            except ValueError as exc:
                log.error("fp8guard: ignoring a malformed command from the service: %s", exc)

    def _check_commands(self, step: int) -> None:
        commands: list[Command] = []
        while self._inbox:
            commands.append(self._inbox.popleft())
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            # sync point (intended, every command_check_interval_steps): rank 0 tells every rank
            # what to apply, so all of them act at this same step.
            box: list[Any] = [commands if self.rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            commands = list(box[0] or [])
        if commands and self._tripwire is not None:
            # Pending verdicts describe the state before these commands (a rollback abandons it):
            # every rank drops them at this same boundary, so their due reads stay in agreement.
            self._tripwire.discard()
        for command in commands:
            self._apply(command, step)

    def _apply(self, command: Command, step: int) -> None:
        if command.id in self._applied_ids:
            return  # delivered again (a retried ingest answer, a restarted service): apply once
        self._applied_ids.add(command.id)
        if self.handler is None:
            outcome = Outcome(AckStatus.IGNORED, error="no command handler: Monitor.attach(..., heal=HealConfig(...)) "
                                                       "or handler=")
        else:
            try:
                outcome = self.handler.apply(command, step=step)
            except Exception as exc:  # a failed remediation is reported, never raised into training
                log.exception("fp8guard: applying command %s (%s) failed", command.id, command.kind)
                outcome = Outcome(AckStatus.FAILED, error=f"{type(exc).__name__}: {exc}")
        if outcome.status == "applied":
            log.warning("fp8guard: applied %s at step %d: %s", command.kind, step, command.reason)
        ack = wire.CommandAck(command_id=command.id, status=outcome.status, applied_step=step, error=outcome.error)
        self.event(wire.EventKind.COMMAND_ACKNOWLEDGED, step=step,
                   data={**outcome.details, "kind": str(command.kind), **ack.to_json()})
        if outcome.status is wire.AckStatus.APPLIED:
            kind = {"fallback": wire.EventKind.FALLBACK_APPLIED, "promote": wire.EventKind.PROMOTION_APPLIED,
                    "rollback": wire.EventKind.ROLLBACK_APPLIED}[command.kind]
            self.event(kind, step=step, data={"command_id": command.id,
                                              "modules": list(command.modules) if command.modules else None,
                                              "checkpoint_step": command.checkpoint_step, **outcome.details})
        if outcome.resume_step is not None:
            # Telemetry recorded so far belongs to the abandoned stretch: ship it under the old
            # segment, then continue in a new one from the restored step.
            if self.reporting and not self._broken:
                self._flush()
            self.segment += 1
            self._next_step = outcome.resume_step
            self._arm_counts_for(self._next_step)

    def _device_grad_norm(self) -> torch.Tensor | None:
        return device_grad_norm(self._params, workspace=self._norm_workspace)

    def _arm_counts_for(self, step: int) -> None:
        every = self.config.count_interval_steps
        for src in self._sources:
            prepare = getattr(src, "prepare_step", None)
            if prepare is not None:  # sources that must know the cadence ahead (TE's inspection API)
                prepare(step, every if self.reporting else 0)
        want = every > 0 and step % every == 0 and self.reporting
        if want != self._counting:
            for src in self._sources:
                if src.supports_counts:
                    src.arm_counts(want)
            self._counting = want

    def set_count_interval(self, steps: int) -> None:
        """Change the exact-count cadence from the next step on (0 turns counting off), e.g. count
        every step while investigating an incident and every 100th otherwise."""
        if steps < 0:
            raise ConfigError(f"count interval must be >= 0 (0 turns counting off), got {steps}")
        self.config.count_interval_steps = int(steps)
        if self._attached and not self._closed and not self._broken:
            self._arm_counts_for(self._next_step)

    def _stop_counting(self) -> None:
        for src in self._sources:
            try:
                if src.supports_counts:
                    src.arm_counts(False)
                stop = getattr(src, "stop_counting", None)
                if stop is not None:
                    stop()
            except Exception:
                log.exception("fp8guard: could not switch counting off in %s", src.kind)
        self._counting = False

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
        shipper.submit(lambda: _payload(packet, run_id=run_id, rank=rank, segment=segment, specs=specs,
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
        self._stop_counting()

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
                "applied_commands": sorted(self._applied_ids)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._next_step = int(state["next_step"])
        self.segment = int(state["segment"])
        self._applied_ids |= set(state.get("applied_commands", []))


def device_grad_norm(params: Iterable[nn.Parameter], *, workspace: dict[str, Any] | None = None) -> torch.Tensor | None:
    """Global L2 norm of the gradients, computed on the device (no host sync); None without grads.

    On a GPU with Triton the large gradients are read by a fused sum-of-squares kernel near
    memory bandwidth (``workspace`` keeps its partials buffer between calls); elsewhere, and for
    the small tensors, ``torch._foreach_norm``."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    device = grads[0].device
    if triton_available(device) and all(g.device == device for g in grads):
        ws = workspace if workspace is not None else {}
        out = torch.empty((), dtype=torch.float32, device=device)
        ws["partials"] = sum_of_squares_into(out, grads, partials=ws.get("partials"))
        return out.sqrt_()
    # float32 norms: bf16 per-tensor norms would carry bf16 rounding (0.25% off on the H200 model)
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
    return total


def _put(slot: torch.Tensor, value: torch.Tensor | float) -> None:
    """Write a scalar into a device slot: a device copy for tensors, a fill kernel for Python
    numbers (no host tensor, so no host-to-device copy from pageable memory)."""
    if isinstance(value, torch.Tensor):
        slot.copy_(value.detach().reshape(()), non_blocking=True)
    else:
        slot.fill_(float(value))


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().astype("<f4", copy=False).tobytes()


def _payload(packet: FlushPacket, *, run_id: str, rank: int, segment: int, specs: Iterable[TensorSpec],
             include_table: bool) -> dict[str, Any]:
    """Runs on the shipper's thread: waits for the copies, then encodes."""
    packet.wait()
    specs = list(specs)
    blocks = []
    if specs and packet.steps:
        blocks.append(wire.tensor_stats_block(stats=STATS, steps=packet.steps, n_tensors=len(specs),
                                              data=_to_bytes(packet.stats)))
    if specs and packet.count_steps and packet.counts is not None:
        blocks.append(wire.tensor_stats_block(stats=COUNT_STATS, steps=packet.count_steps, n_tensors=len(specs),
                                              data=_to_bytes(packet.counts)))
    table = [{"index": i, "name": s.name, "module": s.module, "role": s.role, "format": s.fp8_format}
             for i, s in enumerate(specs)] if include_table else []
    return wire.make_batch(run_id=run_id, rank=rank, segment=segment, tensors=table,
                           steps=packet.step_records(), tensor_stats=blocks, events=packet.events)
