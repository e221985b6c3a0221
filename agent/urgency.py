"""The Monitor's command boundary and its urgency after the tripwire fires.

At the end of every ``Monitor.step`` call, on every rank, commands apply
(:meth:`CommandBoundary.close_step`). In a healthy run that is every
``command_check_interval_steps``. When the tripwire (:mod:`fp8guard.agent.tripwire`) or the
harm probe says something is wrong, the monitor *hurries*: it ships what it recorded at once,
asks the command listener for the decision and checks for it at the following boundaries,
waiting up to ``tripwire_wait_s`` once; under torch.distributed every rank enters an extra
command broadcast at the boundary where the tripwire's shared verdict is due.

A trip that persists (a loss that stays high for many steps) is one incident: the monitor hurries
at its first boundary at once, at every boundary of its first ``_EAGER_BOUNDARIES``, then only
when a quantity not seen in it trips too (new evidence) or at streak boundaries 32, 64, 128, ...;
the flushes every ``flush_interval_steps`` ship the rest as usual. An applied command, or a
boundary whose check did not fire, ends the incident.

The harm probe a trip forces (two extra forwards, :mod:`fp8guard.agent.harm`) backs off sooner:
at the incident's first ``_EAGER_PROBES`` boundaries, on new evidence, at streak boundaries 8,
16, 32, ...; a new incident (after an applied command: does the gap close?) probes at once
again. The probes due every ``harm_interval_steps`` run as usual."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from fp8guard.agent.tripwire import Tripwire

if TYPE_CHECKING:
    from fp8guard.agent.monitor import Monitor

__all__ = ["CommandBoundary"]

log = logging.getLogger("fp8guard.agent")

_MAX_UNANSWERED_WAITS = 3
"""Tripwire waits in a row without a decision after which a persisting trip only ships."""

_EAGER_BOUNDARIES = 16
"""Boundaries of a trip streak at which the monitor hurries every time. The service's longest
rule of consecutive steps is saturation over 10 in a row (``saturation_steps``, its early
divergence rules take 3), and the tripwire's verdict reaches the host a step or two after its
step: 16 covers a rule that decides late in a streak, so its step still ships at once (the
two-step answer of bench/scenarios.py). Past it a streak hurries at powers of two only."""

_EAGER_PROBES = 4
"""Boundaries of a trip streak at which the trip forces a harm probe every time. What the closed
loop needs from a trip is the gap at its start: a reading out of the band bisects (a probe's
reading is read a step later) and its finding is the evidence a fallback needs; a few probes
cover a harm that grows over the trip's first steps. With 4, bench/scenarios.py's decisions are
those of a probe at every tripped step (heal: fallback at 171, one step after the unguarded loss
left its band). A loss that stays high re-measures the same gap: past these, a streak probes on
new evidence and at powers of two only (8, 16, 32, ...): 8 probes over 100 tripped steps
instead of 99, two forwards each (tests/agent/test_urgency.py)."""


class CommandBoundary:
    """Owned by one Monitor: its tripwire, the urgency state, and where commands apply."""

    def __init__(self, monitor: Monitor, tripwire: Tripwire | None) -> None:
        self._m = monitor
        self.tripwire = tripwire
        self.probe_now = False
        """The tripwire fired: run the harm probe at this step, due or not."""
        self._urgent_until: int | None = None
        """After the tripwire fired: check commands at every step boundary up to this step."""
        self._urgent_waited = False
        self._unanswered_waits = 0
        """Waits for a decision in a row that no command answered: a trip that persists (a level
        shift the service does not call an incident) stops waiting up to ``tripwire_wait_s`` per
        step after ``_MAX_UNANSWERED_WAITS`` of them, until a step boundary without a trip. It
        still ships at once: the step that decides may be the fourth of the streak (an LR blowup
        trips from step 1, and the service's early rule decides on step 4)."""
        self._streak = 0
        """Fired checks in a row in the current incident (consecutive ticks, no command applied)."""
        self._streak_tick = -1
        self._streak_bits = 0
        """Verdict bits seen in the current incident (``tripwire.SHARED`` / ``LOCAL``)."""
        self._streak_applied = 0
        self._streak_probe = False
        """Whether the last fired check that ``_news`` counted is one that forces a harm probe."""
        self.tick = 0
        """Monitor.step calls so far: the same count on every rank, whatever the step numbers do
        (a rollback moves them back); the tripwire's fixed-lag read is counted in these."""
        self._extra_broadcast_tick: int | None = None
        """The last boundary at which every rank entered a tripwire's extra command broadcast."""
        self.broadcasts = 0
        """Extra command broadcasts entered after the tripwire fired (none in a healthy run)."""

    def answer_tripwire(self, current: int) -> None:
        """If an earlier step's device check has completed and fired (``Tripwire.peek``, no
        wait): ship everything now and listen for the decision. Rank-local work only: ranks see
        a check complete at different steps, so no collective may hang on this; the boundary
        where every rank acts on a verdict together is ``_tripwire_due``'s."""
        if self.tripwire is None:
            return
        # one process consumes what it read (nothing waits for the lagged read); ranks keep their
        # verdicts for ``due``
        fired = self.tripwire.fired() if self._m.world_size == 1 else self.tripwire.peek()
        if fired is None:
            self._unanswered_waits = 0  # the streak of trips, if any, has ended
            return
        seen = self.tripwire.last_peeked  # the verdict peek just returned
        news = seen is None or self._news(seen.tick, seen.bits)
        # Does the anomaly cost the loss? Probe this step (one process: a rank-local trip must
        # not start forwards that other ranks of a sharded model would not join), at an
        # incident's start and on the streak's back-off (``_EAGER_PROBES``).
        self.probe_now = self._m.world_size == 1 and (seen is None or self._streak_probe)
        if news:
            log.warning("fp8guard: the tripwire fired at step %d; shipping telemetry now", fired)
            self.hurry(current)

    def _news(self, tick: int, bits: int) -> bool:
        """Whether the fired check of boundary ``tick`` is worth hurrying for (see the module
        docstring): the first of an incident always is; a streak of checks at consecutive ticks
        with no command applied meanwhile is one incident."""
        applied = len(self._m._desk.applied_ids)
        if not (self._streak and tick == self._streak_tick + 1 and applied == self._streak_applied):
            self._streak, self._streak_bits, self._streak_applied = 0, 0, applied
        self._streak += 1
        self._streak_tick = tick
        new_bits, self._streak_bits = bits & ~self._streak_bits, self._streak_bits | bits
        k = self._streak
        back_off = k & (k - 1) == 0
        self._streak_probe = bool(new_bits) or k <= _EAGER_PROBES or back_off
        return bool(new_bits) or k <= _EAGER_BOUNDARIES or back_off

    def hurry(self, current: int) -> None:
        """Ship what is recorded now and listen for the decision (a tripped tripwire, a measured
        harm); this rank's work only."""
        m = self._m
        m._flush()
        self._urgent_until = current + m.config.command_check_interval_steps
        self._urgent_waited = False
        if m._listener is not None:
            m._listener.listen(30.0, after=m._desk.last_applied)

    def close_step(self, current: int, grad_norm: torch.Tensor | float | None) -> None:
        """The end of every ``step`` call, on every rank, whatever it reports: commands apply here.

        Under torch.distributed a broadcast is entered by all ranks or by none, and the branch
        taken depends only on what is the same on every rank: the step call count (every
        ``command_check_interval_steps``) and the tripwire's verdict due at this boundary (read
        at a fixed lag, ``Tripwire.due``). A single process applies what has arrived at once."""
        m = self._m
        every_n = (current + 1) % m.config.command_check_interval_steps == 0
        extra = self._tripwire_due(self.tick, current, grad_norm)
        self.tick += 1
        if extra:
            # The command rank's inbox is what the broadcast sends: give the decision its moment to arrive
            # (the other ranks wait in the broadcast meanwhile).
            self._await_decision()
            if not every_n:
                self.broadcasts += 1
        if m.world_size == 1 and self._urgent_until is not None:
            # One process that hurried waits for the decision at this boundary, a regular one
            # (every N) included: checking an empty inbox there applied the decision steps later.
            self._urgent_check(current)
        elif every_n or extra:
            # Every rank reaches this at the same step: the broadcast in check_commands must be
            # entered by all of them.
            m._check_commands(current)
        elif m.world_size == 1 and m._desk.inbox:
            # One process needs no broadcast: a command that has arrived applies at this step.
            m._check_commands(current)

    def _tripwire_due(self, tick: int, current: int, grad_norm: torch.Tensor | float | None) -> bool:
        """Read the verdict due at boundary ``tick``; True when every rank is to enter an extra
        command broadcast now (under torch.distributed, the shared bit fired, and no extra
        broadcast in the last ``command_check_interval_steps`` boundaries: a run that keeps
        tripping is answered at the every-N broadcasts, never held up at each step).

        A verdict that no peek saw (the host ran ahead of the device) makes this rank hurry now;
        a single process then applies the decision at this boundary."""
        m, trip = self._m, self.tripwire
        if trip is None or m.world_size == 1:
            # One process needs no agreement: ``peek`` (never waits) answers it. The lagged read
            # would cap how far the host runs ahead of the device at every step (on the H200 a
            # torchao loop's monitor.step waited 255 ms there).
            return False
        try:
            if m.world_size > 1 and not trip.checked(tick):
                # A rank that does not report (or whose monitoring broke) still checks the shared
                # quantity, so that its verdicts stay the other ranks' verdicts.
                trip.check(current, tick=tick, loss=None, grad_norm=self._shared_grad_norm(grad_norm, trip.device),
                           saturation=None)
            verdict = trip.due(tick)
        except Exception:
            self.tripwire = None
            log.exception("fp8guard: the tripwire failed and is now off on this rank; training continues")
            return False
        if verdict is None or not verdict.fired:
            return False
        if not verdict.peeked and self._news(verdict.tick, verdict.bits):
            log.warning("fp8guard: the tripwire fired at step %d; shipping telemetry now", verdict.step)
            if m.reporting and not m._broken:
                try:
                    self.hurry(current)
                except Exception:
                    log.exception("fp8guard: shipping after the tripwire failed")
        if m.world_size == 1 or not verdict.shared:
            return False
        last = self._extra_broadcast_tick
        if last is not None and tick - last < m.config.command_check_interval_steps:
            return False
        self._extra_broadcast_tick = tick
        return True

    def _shared_grad_norm(self, grad_norm: torch.Tensor | float | None, device: torch.device) -> torch.Tensor | None:
        """The gradient norm as ``Monitor._record`` gives it to the tripwire (float32 on the
        device), for ranks that do not record."""
        if grad_norm is None:
            return self._m.grad_norm() if self._m.config.compute_grad_norm else None
        if isinstance(grad_norm, torch.Tensor):
            return grad_norm.detach().reshape(()).to(device=device, dtype=torch.float32, non_blocking=True)
        return torch.full((), float(grad_norm), dtype=torch.float32, device=device)

    def _await_decision(self) -> None:
        """On the command rank (or alone), wait up to ``tripwire_wait_s`` for a command to arrive;
        only at a boundary where the tripwire's verdict is due and fired, never in a healthy run."""
        m = self._m
        if m.rank != m.command_rank or m.config.tripwire_wait_s <= 0:
            return
        self._wait_for_command()

    def _wait_for_command(self) -> None:
        m = self._m
        if not m.hears_commands:  # shipping is off: no service can answer
            return
        deadline = time.monotonic() + m.config.tripwire_wait_s
        while not m._desk.inbox and time.monotonic() < deadline:
            time.sleep(0.002)

    def _urgent_check(self, current: int) -> None:
        m, inbox = self._m, self._m._desk.inbox
        assert self._urgent_until is not None
        if (not inbox and not self._urgent_waited and m.config.tripwire_wait_s > 0
                and self._unanswered_waits < _MAX_UNANSWERED_WAITS):
            # Only after the tripwire fired, once: the decision is usually tens of ms away.
            self._urgent_waited = True
            self._wait_for_command()
            self._unanswered_waits = 0 if inbox else self._unanswered_waits + 1
        applied = len(m._desk.applied_ids)
        m._check_commands(current)
        if len(m._desk.applied_ids) > applied or current >= self._urgent_until:
            self._urgent_until = None
