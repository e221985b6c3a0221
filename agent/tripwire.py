"""``Tripwire``: a device-side check of every step's telemetry that tells the host, a step or
two later and without a per-step sync, that something is wrong right now.

Per step it enqueues one check on the device (one Triton launch on CUDA,
``fp8guard.agent.kernels.tripwire_check``; elsewhere some forty small torch ops, bit for bit the
same): a non-finite loss or gradient norm, a loss
or gradient norm far above its running baseline (exponential averages kept on the device), or a
saturation ratio far above the FP8 maximum. Before the baseline has its ``warmup_steps`` values,
the bounds are the service's early ones, over fewer steps in a row: a loss above the run's first
loss by ``early_loss_rise``, a gradient norm ``early_grad_factor`` times its smallest value so
far, for ``early_steps`` checks in a row (a learning rate far too high blows up in the first
handful of steps, before any running average means anything). The verdict is copied non-blocking into its own
word of pinned host memory and an event is recorded. The tripwire decides nothing: the
service's rules do. It only makes the agent hurry.

Two reads of each verdict, for two purposes:

- ``peek()`` (no wait, ``event.query()``): at the next step boundary, if the check has
  completed and fired, the monitor flushes at once and starts listening for the decision. When
  a host sees it depends on how far the host runs ahead of the device, so ranks see it at
  different steps; it only ever triggers rank-local work (a flush, a long-poll).
- ``due(tick)`` (a fixed lag of ``lag_steps`` monitor steps): at step boundary ``c`` every
  rank reads the verdict of the check of boundary ``c - lag``, and only if that event has not
  completed yet, waits for it (a deferred sync point: the device has the lag's worth of later
  steps queued behind that event, so the wait costs no device time, and in a loop that syncs
  anyway, e.g. for a logged loss, it never waits at all). Every rank thus learns the same
  verdict at the same step boundary, which is what lets them all enter one extra command
  broadcast together (``Monitor``), without a collective per step.

The verdict has two bits. ``SHARED``: the gradient norm (non-finite or a jump). Under
torch.distributed it is computed after the gradient all-reduce (DDP), or passed in as the global
norm (FSDP/tensor parallel: what ``clip_grad_norm_`` returns), so it is the same number on every
rank; the norm is computed the same way on every rank (foreach under torch.distributed, a
deterministic reduction) and the baseline is updated from that number alone, so every rank's ``SHARED`` bit is identical, and
only it may start a collective. ``LOCAL``: the loss and the saturation ratios, which differ per
rank (each rank's loss is its own micro-batch's; the emulation, torchao and TE's current
scaling keep per-rank amaxes; only TE's delayed scaling all-reduces them, and whether it does
depends on the recipe and its ``fp8_group``); a local trip makes that rank flush early and
nothing more. A NaN loss on any rank reaches ``SHARED`` anyway: its NaN gradients go through the
all-reduce. A saturation-only incident under torch.distributed is therefore flushed at once but
applied at the every-N broadcast; ``all_reduce=True`` makes every bit shared at the price of one
tiny all-reduce per step (device-side with NCCL, no host sync), for runs that want the two-step
answer for per-rank quantities too.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from fp8guard.agent.kernels import triton_available
from fp8guard.agent.kernels.tripwire_check import PARAMS, TripwireCheck

__all__ = ["LOCAL", "SHARED", "Tripwire", "Verdict"]

_EMA = 0.05
SHARED = 1
"""Verdict bit: a quantity that is identical on every rank (the gradient norm) tripped."""
LOCAL = 2
"""Verdict bit: a quantity of this rank only (its loss, its saturation ratios) tripped."""


@dataclass(frozen=True)
class Verdict:
    """What the check of one step said, read at its due step boundary."""

    step: int
    tick: int
    bits: int
    peeked: bool
    """Already seen by ``peek()`` (the monitor has flushed for it)."""
    waited: bool
    """The event had not completed at the due boundary: the host waited for it."""

    @property
    def shared(self) -> bool:
        return bool(self.bits & SHARED)

    @property
    def fired(self) -> bool:
        return self.bits != 0


@dataclass
class _Slot:
    step: int
    tick: int
    index: int
    peeked: bool = False


class Tripwire:
    """Checks written into device buffers, one host word per pending check; see the module docstring."""

    def __init__(self, device: torch.device, *, loss_factor: float, grad_factor: float, saturation: float,
                 warmup_steps: int, use_loss: bool = True, lag_steps: int = 2, all_reduce: bool = False,
                 early_loss_rise: float = 0.05, early_grad_factor: float = 20.0, early_steps: int = 2,
                 backend: Literal["auto", "torch", "triton"] = "auto") -> None:
        """``backend``: ``triton`` runs the check as one launch (:mod:`fp8guard.agent.kernels.tripwire_check`,
        CUDA with Triton, or Triton's CPU interpreter), ``torch`` as some forty small torch ops (the
        reference, bit for bit the same state and verdicts), ``auto`` the kernel where Triton runs
        on CUDA tensors."""
        if lag_steps < 1:
            raise ValueError(f"lag_steps must be >= 1, got {lag_steps}")
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"tripwire backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        self.device = device
        self.loss_factor = float(loss_factor)
        self.grad_factor = float(grad_factor)
        self.saturation = float(saturation)
        self.warmup_steps = int(warmup_steps)
        self.early_loss_rise = float(early_loss_rise)
        self.early_grad_factor = float(early_grad_factor)
        self.early_steps = int(early_steps)
        self.use_loss = use_loss
        self.lag_steps = int(lag_steps)
        self.all_reduce = all_reduce
        """MAX-all-reduce each verdict over the default process group (every rank must check at
        every step boundary then, as the monitor does): all bits become shared."""
        # The state, float32, columns loss and grad norm (the kernel's layout, rows as views): the
        # checks counted into the baseline, the baseline averages, and before the warm-up ends the
        # first loss and the smallest gradient norm (the reference of the early bounds) and how
        # many checks in a row were over them.
        self._state = torch.zeros(4, 2, dtype=torch.float32, device=device)
        self._seen, self._baseline, self._early_ref, self._early_run = self._state.unbind(0)
        # constants of the check, on the device once (a per-step torch.tensor() would copy from
        # the host, which synchronises); both paths read the same float32 values
        values = {"loss_factor": self.loss_factor, "grad_factor": self.grad_factor, "early_mul_loss": 1.0,
                  "early_grad_factor": self.early_grad_factor, "early_loss_rise": self.early_loss_rise,
                  "early_abs_grad": 0.0, "warmup_steps": float(self.warmup_steps),
                  "early_steps": float(self.early_steps), "ema": _EMA, "saturation": self.saturation}
        self._params = torch.tensor([values[name] for name in PARAMS], dtype=torch.float32, device=device)
        self._bit_values = torch.tensor([LOCAL, SHARED], dtype=torch.int32, device=device)
        self._factors = self._params[0:2]
        self._nan = torch.full((), float("nan"), dtype=torch.float32, device=device)
        self._present = torch.eye(2, dtype=torch.bool, device=device)
        """Row i: only quantity i was passed."""
        self._bound_mul = self._params[2:4]
        self._bound_abs = self._params[4:6]
        self._lowers = torch.tensor([False, True], device=device)
        """Only the gradient norm's reference follows a lower value (the loss keeps its first)."""
        # Every intermediate of the check, allocated once: a step's check writes into these
        # (``out=``) and allocates nothing.
        self._x = torch.empty(2, dtype=torch.float32, device=device)
        self._f = [torch.empty(2, dtype=torch.float32, device=device) for _ in range(2)]
        self._b = {name: torch.empty(2, dtype=torch.bool, device=device)
                   for name in ("finite", "warm", "cold", "first", "later", "jump", "over", "early", "lower", "take",
                                "ok", "tripped")}
        self._i = torch.empty(2, dtype=torch.int32, device=device)
        self._bits = torch.zeros((), dtype=torch.int32, device=device)
        self._sat_bit = torch.zeros((), dtype=torch.int32, device=device)
        self._sat_any = torch.zeros((), dtype=torch.bool, device=device)
        self._sat_over: torch.Tensor | None = None
        use_kernel = backend == "triton" or (backend == "auto" and device.type == "cuda" and triton_available(device))
        if use_kernel and not triton_available(device):
            raise ValueError(f"tripwire backend 'triton' needs Triton for {device} tensors")
        self._kernel = TripwireCheck(self._state, self._params, self._bits, local=LOCAL, shared=SHARED) \
            if use_kernel else None
        """The one-launch check, or None: the torch ops."""
        cuda = device.type == "cuda"
        # One word per check that can be pending: the lag's worth, the one just enqueued, and a spare.
        self._capacity = self.lag_steps + 2
        self._host = torch.zeros(self._capacity, dtype=torch.int32, pin_memory=cuda)
        # Verdicts are read straight from these host words (no tensor call, so nothing that could
        # sync; the events say when a copy has landed).
        self._words = (ctypes.c_int32 * self._capacity).from_address(self._host.data_ptr())
        self._events: list[torch.cuda.Event | None] = [None] * self._capacity
        self._pending: list[_Slot] = []
        self._next_tick = 0
        self.fired_steps = 0
        """Checks seen firing (by ``peek`` or ``due``)."""
        self.waits = 0
        """Due reads that found their event incomplete and waited for it."""
        self.last_peeked: Verdict | None = None
        """The verdict of the last check that ``peek`` saw firing (its tick and bits: whether a
        trip goes on at the next boundary, and with which quantities)."""

    # -- the device side ----------------------------------------------------------------------

    def checked(self, tick: int) -> bool:
        """Whether the check of step boundary ``tick`` has been enqueued."""
        return tick < self._next_tick  # ticks are checked in increasing order

    def check(self, step: int, *, loss: torch.Tensor | None, grad_norm: torch.Tensor | None,
              saturation: torch.Tensor | None, tick: int | None = None) -> None:
        """Enqueue the check of ``step`` (device tensors, any of them missing) for step boundary
        ``tick`` (default: the one after the last checked); a second check of a tick is ignored."""
        tick = self._next_tick if tick is None else tick
        if tick < self._next_tick:
            return
        self._next_tick = tick + 1
        loss = loss if self.use_loss else None
        kernel = self._kernel
        if kernel is not None and kernel.accepts(loss) and kernel.accepts(grad_norm) and \
                kernel.accepts(saturation, saturation=True):
            bits = kernel(loss, grad_norm, saturation)  # one launch: the torch ops below, fused
        else:
            bits = self._torch_bits(loss, grad_norm, saturation)
        self._publish(bits, step, tick)

    @property
    def backend(self) -> str:
        """``triton`` (the one-launch check) or ``torch``."""
        return "torch" if self._kernel is None else "triton"

    def _torch_bits(self, loss: torch.Tensor | None, grad_norm: torch.Tensor | None,
                    saturation: torch.Tensor | None) -> torch.Tensor:
        """The check as torch ops: the reference of the kernel, and its fallback."""
        bits = self._scalar_bits(loss, grad_norm)
        if saturation is not None and saturation.numel():
            over = self._sat_over
            if over is None or over.shape != saturation.shape:
                over = self._sat_over = torch.empty(saturation.shape, dtype=torch.bool, device=self.device)
            torch.gt(saturation, self.saturation, out=over)  # NaN compares false: not a trip
            torch.any(over, out=self._sat_any)
            torch.mul(self._sat_any, LOCAL, out=self._sat_bit)
            torch.bitwise_or(bits, self._sat_bit, out=bits)
        return bits

    def _publish(self, bits: torch.Tensor, step: int, tick: int) -> None:
        """All-reduce the verdict where asked, then copy it to its host word (non-blocking)."""
        if self.all_reduce and dist.is_available() and dist.is_initialized():
            # One element, enqueued on the device with NCCL (no host sync); every rank checks at
            # every boundary, so every rank enters it.
            dist.all_reduce(bits, op=dist.ReduceOp.MAX)
            bits = torch.where(bits != 0, bits | SHARED, bits)
        if len(self._pending) >= self._capacity:
            self._pending.pop(0)  # never read (standalone use without due()): its word is reused
        index = tick % self._capacity
        self._pending = [s for s in self._pending if s.index != index]
        # sync point (deferred): a non-blocking copy into this check's own host word, read by
        # peek() once its event completed, or by due() lag_steps boundaries later
        self._host[index:index + 1].copy_(bits.reshape(1), non_blocking=True)
        if self.device.type == "cuda":
            event = self._events[index]
            if event is None:
                event = self._events[index] = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        self._pending.append(_Slot(step=step, tick=tick, index=index))

    def _scalar_bits(self, loss: torch.Tensor | None, grad_norm: torch.Tensor | None) -> torch.Tensor:
        """The loss's and the gradient norm's verdict bits, both quantities at once as a
        2-vector (a fixed, small number of device ops whatever is passed), updating their
        baselines and early references. A missing quantity is NaN here and changes nothing."""
        present = [loss is not None, grad_norm is not None]
        bits = self._bits
        if not any(present):
            return bits.zero_()
        x, (t, u), b = self._x, self._f, self._b
        for k, v in enumerate((loss, grad_norm)):  # two fixed slots, not a walk over anything
            x[k].copy_(v.detach().reshape(()) if v is not None else self._nan)
        seen, base, ref = self._seen, self._baseline, self._early_ref
        torch.sub(x, x, out=t)
        torch.eq(t, 0.0, out=b["finite"])  # x - x is 0 exactly where x is finite
        torch.ge(seen, self.warmup_steps, out=b["warm"])
        torch.lt(seen, self.warmup_steps, out=b["cold"])
        torch.eq(seen, 0.0, out=b["first"])
        torch.ne(seen, 0.0, out=b["later"])
        torch.mul(self._factors, base, out=t)
        torch.gt(x, t, out=b["jump"])
        torch.logical_and(b["jump"], b["warm"], out=b["jump"])
        # before the warm-up: the loss over its first value by the early rise, the gradient norm
        # over the early factor times its smallest value, ``early_steps`` checks in a row
        torch.abs(ref, out=t)
        torch.mul(t, self._bound_abs, out=t)
        torch.mul(ref, self._bound_mul, out=u)
        torch.add(u, t, out=u)  # [ref0 + rise * |ref0|, factor * ref1]
        torch.gt(x, u, out=b["over"])
        for mask in ("finite", "cold", "later"):
            torch.logical_and(b["over"], b[mask], out=b["over"])
        run = self._early_run
        torch.add(run, 1.0, out=t)
        torch.mul(t, b["over"], out=run)  # the run grows while over, else 0 (finite counts: exact)
        torch.ge(run, self.early_steps, out=b["early"])
        torch.lt(x, ref, out=b["lower"])
        torch.logical_and(b["lower"], self._lowers, out=b["lower"])
        torch.logical_or(b["first"], b["lower"], out=b["take"])
        torch.logical_and(b["take"], b["finite"], out=b["take"])
        torch.where(b["take"], x, ref, out=ref)
        torch.logical_not(b["jump"], out=b["ok"])
        torch.logical_and(b["ok"], b["finite"], out=b["ok"])
        torch.sub(x, base, out=t)
        torch.mul(t, _EMA, out=t)
        torch.add(base, t, out=t)
        torch.where(b["first"], x, t, out=t)  # the new average
        torch.where(b["ok"], t, base, out=base)
        torch.add(seen, b["ok"], out=seen)
        tripped = b["tripped"]
        torch.logical_not(b["finite"], out=tripped)
        torch.logical_or(tripped, b["jump"], out=tripped)
        torch.logical_or(tripped, b["early"], out=tripped)
        if not all(present):  # a quantity not passed is NaN here: it must not trip
            torch.logical_and(tripped, self._present[present.index(True)], out=tripped)
        torch.mul(tripped, self._bit_values, out=self._i)
        torch.sum(self._i, dim=0, dtype=torch.int32, out=bits)
        return bits

    # -- the host side ------------------------------------------------------------------------

    def _complete(self, slot: _Slot) -> bool:
        event = self._events[slot.index]  # None on the CPU: the copy was synchronous
        return event is None or bool(event.query())  # type: ignore[no-untyped-call]

    def peek(self) -> int | None:
        """The step of the oldest completed, not yet peeked check that fired (any bit); never waits."""
        for slot in self._pending:
            if slot.peeked:
                continue
            if not self._complete(slot):
                return None  # later checks complete after this one: nothing more to see now
            slot.peeked = True
            bits = int(self._words[slot.index])
            if bits != 0:
                self.fired_steps += 1
                self.last_peeked = Verdict(step=slot.step, tick=slot.tick, bits=bits, peeked=True, waited=False)
                return slot.step
        return None

    def fired(self) -> int | None:
        """The step whose check fired, if that check has completed; never waits. Consumes what
        it read (standalone use; the monitor uses ``peek`` and ``due``)."""
        got = self.peek()
        self._pending = [s for s in self._pending if not s.peeked]
        return got

    def due(self, tick: int) -> Verdict | None:
        """The verdict of the check of step boundary ``tick - lag_steps``, read (and consumed) at
        boundary ``tick`` on every rank alike; None when no such check is pending (the start of
        the run, or dropped by ``discard``). Waits for that one check if it has not completed."""
        want = tick - self.lag_steps
        slot = next((s for s in self._pending if s.tick == want), None)
        if slot is None:
            return None
        self._pending = [s for s in self._pending if s.tick > want]
        waited = False
        if not self._complete(slot):
            # sync point (deferred, lag_steps behind): waits only for the check recorded
            # lag_steps boundaries ago, with the later steps' work already queued behind it
            waited = True
            self.waits += 1
            event = self._events[slot.index]
            assert event is not None
            event.synchronize()
        bits = int(self._words[slot.index])
        if bits and not slot.peeked:
            self.fired_steps += 1
        return Verdict(step=slot.step, tick=slot.tick, bits=bits, peeked=slot.peeked, waited=waited)

    def discard(self) -> None:
        """Forget every pending verdict (a command was just applied: they describe the state
        before it). Called on every rank at the same boundary, so ``due`` stays in agreement."""
        self._pending = []
