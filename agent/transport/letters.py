"""The contract between the byte link and the payload side.

:class:`~fp8guard.agent.transport.link.Link` ships opaque bytes: it never parses nor rewrites a
payload. What it ships is a :class:`Letter`, sealed into bytes at its first attempt (so a drop
report rides on the first batch that actually goes out), and every loss, refusal and report it
meets goes to a :class:`Ledger`, which owns the drop reports and the tensor-table re-sends
(:class:`fp8guard.agent.drop_reports.DropReports`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["Ledger", "Letter", "Sealed"]


@dataclass(frozen=True)
class Sealed:
    """A batch as it goes on the wire: JSON bytes, and the drop report they carry."""

    body: bytes
    claimed: tuple[int, int] | None = None
    """(batches, steps) of the drop report inside, None without one."""
    with_table: bool = False
    """Whether the body re-sends the tensor table."""


class Letter(Protocol):
    """One batch before it is sealed; ``steps`` is how many training steps it holds."""

    @property
    def steps(self) -> int: ...

    @property
    def label(self) -> str:
        """How logs name it (its ``batch_id``)."""

    def seal(self) -> Sealed | None:
        """The bytes of the first attempt, carrying any pending drop report; None: the payload
        cannot be serialised (it is dropped)."""

    def plain(self) -> bytes | None:
        """The bytes as they are, for a batch that goes to the spool without an attempt."""


class Ledger(Protocol):
    """Whom the link tells what became of batches; it answers with drop reports."""

    def lost(self, steps: int, carried: tuple[int, int], *, refused: bool) -> None:
        """A batch is gone for good (with the drop report it carried). ``refused``: the service
        refused it for what it is, so the tensor table may be the cause and is not re-sent."""

    def returned(self, claimed: tuple[int, int] | None, *, with_table: bool = False) -> None:
        """A drop report (and tensor table) did not arrive: it is pending again."""

    def report_due(self) -> bool:
        """Whether a report should go ahead of the next backfill."""

    def has_drops(self) -> bool:
        """Whether lost telemetry waits to be reported."""

    def report(self) -> Sealed | None:
        """A batch of its own with the pending drop report and the tensor table, claimed."""
