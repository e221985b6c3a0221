"""What a service process knows of what it wrote, so the ingest path need not read it back.

``WriteCache`` holds facts that never change once committed (a run's primary key, a stat's id,
that tensors 0..n-1 are defined), which every process may cache without coordination, and
hints that another process's write can make stale, each checked where it is used: roll-up
tails (``rollup_writer``, checked against the rank's batch counter under its row lock) and each
rank's progress row (``telemetry_writer._accept``, checked by the statement that bumps it).
Each transaction learns into its own ``CacheTxn``; the store publishes it only after commit.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fp8guard.service.store.rollup_writer import RollupTail

__all__ = ["CacheTxn", "Progress", "WriteCache"]


class Progress(NamedTuple):
    """A rank's progress row: as the batch found it (read under the rank's row lock, ``batches``
    counting the batch itself), or as a batch left it."""

    last_step: int | None
    last_segment: int
    batches: int


@dataclass
class WriteCache:
    """Facts that never change once committed (a run's primary key, a stat's id, that tensors
    0..n-1 are defined), so every service process may cache them without coordination, and two
    hints per (run, rank), checked where used: roll-up tails and the progress row. Each transaction learns into its own ``CacheTxn``; the store publishes it only
    after commit, so a rolled-back batch never leaves a stale entry, and several writer threads
    never see each other's uncommitted facts."""

    run_pks: dict[str, int] = field(default_factory=dict)
    stat_ids: dict[tuple[int, str], int] = field(default_factory=dict)
    tensors_defined: dict[int, int] = field(default_factory=dict)
    tails: OrderedDict[tuple[int, int], RollupTail] = field(default_factory=OrderedDict)
    """Per (run, rank): the newest roll-up rows this process wrote, valid only while the
    rank's ``batches`` counter shows no other writer wrote since (checked under the row lock)."""
    max_tails: int = 256
    progress: OrderedDict[tuple[int, int], Progress] = field(default_factory=OrderedDict)
    """Per (run, rank): the rank's progress row as this process's last committed write of it
    left it; a hint, checked by the next write (``_accept``)."""
    max_progress: int = 4096
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def begin(self, *, optimistic: bool = True) -> CacheTxn:
        return CacheTxn(self, optimistic=optimistic)

    def publish(self, txn: CacheTxn) -> None:
        with self._lock:
            for kind, key, value in txn.pending:
                if kind in ("tails", "progress"):
                    newest: OrderedDict[tuple[int, int], Any] = getattr(self, kind)
                    old = newest.get(key)
                    if old is None or old.batches < value.batches:  # writers may publish out of order
                        newest[key] = value
                        newest.move_to_end(key)
                    while len(newest) > (self.max_tails if kind == "tails" else self.max_progress):
                        newest.popitem(last=False)
                    continue
                table: dict[Any, Any] = getattr(self, kind)
                table[key] = max(value, table.get(key, value)) if kind == "tensors_defined" else value
        txn.pending.clear()
        txn.staged_tails.clear()
        txn.staged_progress.clear()


@dataclass
class CacheTxn:
    """One transaction's view of the ``WriteCache``: reads go through, new facts wait in ``pending``."""

    shared: WriteCache
    optimistic: bool = True
    """Whether a rank's known progress may stand in for reading it (False: the retry after
    ``StaleProgress``)."""
    pending: list[tuple[str, Any, Any]] = field(default_factory=list)
    staged_tails: dict[tuple[int, int], RollupTail] = field(default_factory=dict)
    """Tails written earlier in this (group) transaction: visible to its later batches only."""
    staged_progress: dict[tuple[int, int], Progress] = field(default_factory=dict)

    @property
    def run_pks(self) -> dict[str, int]:
        return self.shared.run_pks

    @property
    def stat_ids(self) -> dict[tuple[int, str], int]:
        return self.shared.stat_ids

    @property
    def tensors_defined(self) -> dict[int, int]:
        return self.shared.tensors_defined

    def tail(self, key: tuple[int, int]) -> RollupTail | None:
        return self.staged_tails.get(key) or self.shared.tails.get(key)

    def known_progress(self, key: tuple[int, int]) -> Progress | None:
        """The rank's progress row as this process last wrote it, if it may be relied on."""
        if not self.optimistic:
            return None
        return self.staged_progress.get(key) or self.shared.progress.get(key)

    def wrote_progress(self, key: tuple[int, int], progress: Progress) -> None:
        self.pending.append(("progress", key, progress))
        self.staged_progress[key] = progress
