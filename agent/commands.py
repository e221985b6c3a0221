"""Commands from the service to the agent (the remediation half of the wire protocol).

The service puts pending commands in every ingest answer (``"commands": [...]``) and serves
them at ``GET /v1/runs/{run_id}/commands`` (``?wait=S`` long-polls). The agent applies each at
a step boundary on all ranks at the same step, then acknowledges it with a
``command_acknowledged`` event whose data is a :class:`fp8guard.wire.CommandAck`. The types
themselves live in :mod:`fp8guard.wire`, shared with the service.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from fp8guard.wire import AckStatus, Command, CommandKind

__all__ = ["AckStatus", "Command", "CommandHandler", "CommandKind", "Outcome", "parse_command"]


def parse_command(raw: Mapping[str, Any]) -> Command:
    """Validate one command from the service; raises ValueError naming the bad field."""
    return Command.from_json(raw)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What applying a command did; the monitor acknowledges it to the service."""

    status: AckStatus
    error: str | None = None
    resume_step: int | None = None
    """After a rollback: the step training continues from (checkpoint step + 1)."""
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", AckStatus(self.status))


class CommandHandler(Protocol):
    """Applies the service's commands to the training process (BF16 fallback, re-promotion,
    rollback). :class:`fp8guard.agent.remediation.Remediator` is the stock one;
    ``Monitor.attach(heal=HealConfig(...))`` builds one with checkpoints for a plain loop."""

    def apply(self, command: Command, *, step: int) -> Outcome:
        """Apply ``command`` at ``step``, on every rank at the same step; never raises."""
        ...

    def on_step(self, step: int) -> None:
        """Called by ``Monitor.step`` (its only caller) at every step, before the command boundary
        (e.g. to end a lowered-learning-rate window); never raises, no device sync."""
        ...
