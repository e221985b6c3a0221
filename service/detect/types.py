"""Domain types of detection and policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

__all__ = ["Finding", "Severity"]


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


@dataclass(frozen=True, slots=True)
class Finding:
    rule: str
    severity: Severity
    step: int
    onset_step: int
    explanation: str
    """One sentence, for people."""
    modules: tuple[str, ...] = ()
    evidence: dict[str, Any] = field(default_factory=dict)
    """Tensors, steps, values."""
