"""Every list of kinds the service knows, defined once: detection rules, severities, action
kinds and statuses, module precisions. The protocol's own lists (command kinds, ack statuses,
event kinds) live in :mod:`fp8guard.wire`; ``tests/test_wire_contract.py`` pins how they relate.

Metrics labels, alert kinds, SQL filters and response schemas all take their values from here,
so a new rule or status cannot be known to one stage and unknown to another.
"""

from __future__ import annotations

from enum import StrEnum

from fp8guard.wire import AckStatus, CommandKind

__all__ = ["COMMAND_ACTIONS", "DIVERGENCE_RULES", "FP8_RULES", "ROLLBACK_RULES", "ActionKind", "ActionStatus",
           "AuditEventKind", "Precision", "Role", "Rule", "Severity"]


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class Rule(StrEnum):
    """Detection rules (``service/loop/detector.py``); ``docs/closed-loop.md`` describes each."""

    NONFINITE = "nonfinite"
    LOSS_DIVERGENCE = "loss_divergence"
    """Before the spike rules have a baseline: the loss stays above the run's first loss."""
    GRAD_DIVERGENCE = "grad_divergence"
    """Before the spike rules have a baseline: the gradient norm stays far above its smallest value."""
    LOSS_SPIKE = "loss_spike"
    GRAD_NORM_SPIKE = "grad_norm_spike"
    INF_AMAX = "inf_amax"
    SATURATION = "saturation"
    SATURATION_SPIKE = "saturation_spike"
    """One step far over the FP8 maximum (an outlier): reported at that step, alert only."""
    AMAX_GROWTH = "amax_growth"
    AMAX_RAMP = "amax_ramp"
    """A steady multiplicative climb of a tensor's amax: alert only."""
    STALE_SCALE = "stale_scale"
    UNDERFLOW_GROWTH = "underflow_growth"
    FP8_HARM = "fp8_harm"
    """Measured, not inferred: the agent's harm probe found FP8 raising the loss on the run's own
    batch beyond its band and named the modules (or a trial found modules held in BF16 harmful)."""


FP8_RULES: frozenset[Rule] = frozenset({Rule.SATURATION, Rule.AMAX_GROWTH, Rule.INF_AMAX, Rule.STALE_SCALE,
                                         Rule.FP8_HARM})
"""FP8 numerics that implicate modules: the evidence a BF16 fallback needs, and what delays a
module's re-promotion."""
ROLLBACK_RULES: frozenset[Rule] = frozenset({Rule.LOSS_SPIKE, Rule.NONFINITE, Rule.LOSS_DIVERGENCE,
                                              Rule.GRAD_DIVERGENCE})
"""Findings that ask for a rollback (plus critical gradient-norm spikes)."""
DIVERGENCE_RULES: frozenset[Rule] = frozenset({Rule.LOSS_DIVERGENCE, Rule.GRAD_DIVERGENCE})
"""Divergence from the start: the rollback also lowers the learning rate for good."""


class ActionKind(StrEnum):
    """What the policy decided. The first three are commands to the agent (``wire.CommandKind``)."""

    FALLBACK = CommandKind.FALLBACK.value
    PROMOTE = CommandKind.PROMOTE.value
    ROLLBACK = CommandKind.ROLLBACK.value
    PAGE = "page"
    """Wake a person up (escalation)."""
    ALERT = "alert"
    """A finding worth telling, with nothing to do."""

    @property
    def is_command(self) -> bool:
        return self.value in COMMAND_ACTIONS


COMMAND_ACTIONS: frozenset[str] = frozenset(k.value for k in CommandKind)


class ActionStatus(StrEnum):
    RECOMMENDED = "recommended"
    """Dry run: decided and alerted, never sent."""
    PENDING = "pending"
    """A command waiting for the agent."""
    RECORDED = "recorded"
    """An alert or page: nothing to send."""
    APPLIED = AckStatus.APPLIED.value
    FAILED = AckStatus.FAILED.value
    IGNORED = AckStatus.IGNORED.value


class Precision(StrEnum):
    """A module's precision, as the agent reported it applied."""

    FP8 = "fp8"
    BF16 = "bf16"
    PINNED = "pinned"
    """BF16 by an escalation: the policy never re-promotes it by itself."""


class Role(StrEnum):
    """What a token may do (``docs/security.md``). ``admin`` may do everything."""

    INGEST = "ingest"
    """Register runs, ingest, acknowledge commands, finish runs: only the runs the token registered,
    or those under its run-id prefix. Reads its runs' commands (the long-poll)."""
    READ = "read"
    """Every query, the dashboards, ``/metrics`` and the API documentation."""
    ADMIN = "admin"
    """Guard and policy changes, tokens; everything the other roles may do."""


class AuditEventKind(StrEnum):
    """Run events the service writes itself. Agents cannot send them: ingest accepts only
    ``wire.EventKind``, which does not list these."""

    GUARD_CHANGED = "guard_changed"
    """A run's guard was set or changed: who (token name), old -> new."""
