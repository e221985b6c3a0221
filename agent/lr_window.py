"""The learning-rate window after a rollback: a factor on every param group's ``lr`` and every
scheduler's ``base_lrs`` for a number of steps, then undone. Shared by the
:class:`~fp8guard.agent.remediation.Remediator` (plain loops) and the framework integrations'
healers (:mod:`fp8guard.agent.integrations._heal`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["LrWindow"]


@dataclass(slots=True)
class LrWindow:
    """A learning rate scaled for a while after a rollback: every param group's ``lr`` and every
    scheduler's ``base_lrs`` (so closed-form schedules such as LambdaLR keep the factor), undone at
    step ``until``. A tensor lr (capturable optimizers) is scaled in place."""

    scale: float
    until: int
    """First step that runs with the original learning rate again."""
    _written: list[tuple[dict[str, Any] | list[Any], Any, Any, Any]] = field(default_factory=list)
    """(container, key, original, written) per value scaled."""

    @classmethod
    def start(cls, optimizers: Iterable[Any], schedulers: Iterable[Any], scale: float, until: int) -> LrWindow:
        window = cls(scale=scale, until=until)
        for opt in optimizers:
            for group in getattr(opt, "param_groups", ()):
                window._scale(group, "lr")
        for sched in schedulers:
            base = getattr(sched, "base_lrs", None)
            if isinstance(base, list):
                for i in range(len(base)):
                    window._scale(base, i)
        return window

    def _scale(self, container: Any, key: Any) -> None:
        value = container[key]
        original = value.clone() if isinstance(value, torch.Tensor) else value
        container[key] = value.mul_(self.scale) if isinstance(value, torch.Tensor) else value * self.scale
        self._written.append((container, key, original, container[key]))

    def end(self) -> None:
        """Undo the factor: back to the original if nobody touched the value, else divide (a
        chainable scheduler moved it meanwhile)."""
        for container, key, original, written in self._written:
            current = container[key]
            if isinstance(current, torch.Tensor):
                current.div_(self.scale)
            else:
                container[key] = original if current == written else current / self.scale
        self._written.clear()
