"""Commands from the service to the agent (the remediation half of the wire protocol).

The service puts pending commands in every ingest answer (``"commands": [...]``) and serves
them at ``GET /v1/runs/{run_id}/commands``. The agent applies each at a step boundary on all
ranks at the same step, then acknowledges it with a ``command_acknowledged`` event
(``data: {"command_id", "status": "applied"|"failed"|"ignored", "applied_step", "error"}``).
Command ids make delivery idempotent: an id seen before is never applied twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

__all__ = ["Command", "CommandKind", "Outcome", "Remediator", "parse_command"]

CommandKind = Literal["fallback", "promote", "rollback"]
_KINDS = ("fallback", "promote", "rollback")


@dataclass(frozen=True, slots=True)
class Command:
    id: int
    kind: CommandKind
    reason: str = ""
    modules: tuple[str, ...] | None = None
    """fallback/promote: the modules to switch (qualified names); None = the whole model."""
    checkpoint_step: int | None = None
    """rollback: restore the checkpoint saved at this step (the newest known-good before the
    anomaly's onset, with a margin)."""
    skip_batches: int = 0
    """rollback: data batches to skip after restoring (the bad window; PaLM skipped 200-500)."""
    lr_scale: float = 1.0
    """rollback: multiply the learning rate by this for ``lr_scale_steps`` steps after restoring."""
    lr_scale_steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def parse_command(raw: Mapping[str, Any]) -> Command:
    """Validate one command from the service; raises ValueError naming the bad field."""
    kind = raw.get("kind")
    if kind not in _KINDS:
        raise ValueError(f"command kind {kind!r} is not one of {_KINDS}")
    cid = raw.get("id")
    if not isinstance(cid, int) or isinstance(cid, bool):
        raise ValueError(f"command id must be an int, got {cid!r}")
    modules = raw.get("modules")
    if modules is not None and (not isinstance(modules, list) or not all(isinstance(m, str) for m in modules)):
        raise ValueError("command modules must be a list of module names or null")
    ckpt = raw.get("checkpoint_step")
    if kind == "rollback" and not isinstance(ckpt, int):
        raise ValueError("a rollback command needs an int checkpoint_step")
    return Command(
        id=cid, kind=kind, reason=str(raw.get("reason", "")),
        modules=tuple(modules) if modules is not None else None,
        checkpoint_step=ckpt if isinstance(ckpt, int) else None,
        skip_batches=int(raw.get("skip_batches") or 0),
        lr_scale=float(raw.get("lr_scale") or 1.0),
        lr_scale_steps=int(raw.get("lr_scale_steps") or 0),
        extra={k: v for k, v in raw.items() if k not in {"id", "kind", "reason", "modules", "checkpoint_step",
                                                         "skip_batches", "lr_scale", "lr_scale_steps"}},
    )


@dataclass(frozen=True, slots=True)
class Outcome:
    """What applying a command did; the monitor acknowledges it to the service."""

    status: Literal["applied", "failed", "ignored"]
    error: str | None = None
    resume_step: int | None = None
    """After a rollback: the step training continues from (checkpoint step + 1)."""
    details: dict[str, Any] = field(default_factory=dict)


class Remediator(Protocol):
    """Applies commands to the training process (BF16 fallback, re-promotion, rollback)."""

    def apply(self, command: Command, *, step: int) -> Outcome: ...

    def on_step(self, step: int) -> None:
        """Called by the monitor at every step (e.g. to end a lowered-learning-rate window)."""
