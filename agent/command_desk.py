"""The Monitor's command desk: the inbox of the service's commands, their delivery to every rank
at one step boundary, their application through the command handler, and the acknowledgements.

Only the Monitor uses this (``Monitor.receive_commands`` is the public entry); what a command
does is the handler's business (:class:`~fp8guard.agent.commands.CommandHandler`)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch.distributed as dist

from fp8guard import wire
from fp8guard.agent.commands import AckStatus, Command, CommandHandler, Outcome, parse_command

__all__ = ["CommandDesk"]

log = logging.getLogger("fp8guard.agent")

EventSink = Callable[..., None]
"""``Monitor.event``: ``(kind, *, step, data)``."""


class CommandDesk:
    """Holds the commands that arrived and the ids already applied (a checkpoint carries them)."""

    def __init__(self, event: EventSink) -> None:
        self._event = event
        self.inbox: deque[Command] = deque()
        self.applied_ids: set[int] = set()

    def receive(self, commands: Iterable[Mapping[str, Any] | Command]) -> None:
        """Queue commands (any thread); raw JSON is validated here, at the boundary, and a
        malformed command is logged and dropped; a copy of a command applied or queued already is
        dropped too."""
        for raw in commands:
            try:
                command = raw if isinstance(raw, Command) else parse_command(raw)
            except ValueError as exc:
                log.error("fp8guard: ignoring a malformed command from the service: %s", exc)
                continue
            # The service delivers a command more than once (each ingest answer and the long-poll
            # carry every pending command until its acknowledgement is stored): a copy of one applied
            # (or being applied: its id is recorded first) or already queued is not a new command.
            # Left in the inbox it would read as an answer and end the wait for the next decision.
            if command.id in self.applied_ids or any(c.id == command.id for c in tuple(self.inbox)):
                continue
            self.inbox.append(command)

    @property
    def last_applied(self) -> int:
        """The highest command id applied so far (0 before any): the listener asks for newer ones."""
        return max(self.applied_ids, default=0)

    def take(self, *, rank: int, world_size: int, src: int = 0) -> list[Command]:
        """Empty the inbox; under torch.distributed every rank gets rank ``src``'s commands (the
        Monitor's ``command_rank``: a reporting rank; what other ranks received is dropped here,
        the same commands reach ``src``)."""
        commands: list[Command] = []
        while self.inbox:
            commands.append(self.inbox.popleft())
        if dist.is_available() and dist.is_initialized() and world_size > 1:
            # sync point (intended, every command_check_interval_steps): rank src tells every rank
            # what to apply, so all of them act at this same step.
            box: list[Any] = [commands if rank == src else None]
            dist.broadcast_object_list(box, src=src)
            commands = list(box[0] or [])
        return commands

    def apply(self, command: Command, step: int, handler: CommandHandler | None) -> int | None:
        """Apply ``command`` once (a command delivered again is skipped) and record its
        acknowledgement; returns the step the run resumes from when the command moved it back."""
        if command.id in self.applied_ids:
            return None  # delivered again (a retried ingest answer, a restarted service): apply once
        self.applied_ids.add(command.id)
        if handler is None:
            outcome = Outcome(AckStatus.IGNORED, error="no command handler: Monitor.attach(..., heal=HealConfig(...)) "
                                                       "or handler=")
        else:
            try:
                outcome = handler.apply(command, step=step)
            except Exception as exc:  # a failed remediation is reported, never raised into training
                log.exception("fp8guard: applying command %s (%s) failed", command.id, command.kind)
                outcome = Outcome(AckStatus.FAILED, error=f"{type(exc).__name__}: {exc}")
        if outcome.status == "applied":
            log.warning("fp8guard: applied %s at step %d: %s", command.kind, step, command.reason)
        ack = wire.CommandAck(command_id=command.id, status=outcome.status, applied_step=step, error=outcome.error)
        self._event(wire.EventKind.COMMAND_ACKNOWLEDGED, step=step,
                    data={**outcome.details, "kind": str(command.kind), **ack.to_json()})
        if outcome.status is wire.AckStatus.APPLIED:
            kind = {"fallback": wire.EventKind.FALLBACK_APPLIED, "promote": wire.EventKind.PROMOTION_APPLIED,
                    "rollback": wire.EventKind.ROLLBACK_APPLIED}[command.kind]
            self._event(kind, step=step, data={"command_id": command.id,
                                               "modules": list(command.modules) if command.modules else None,
                                               "checkpoint_step": command.checkpoint_step, **outcome.details})
        return outcome.resume_step
