"""The on-disk spool: batches that could not be delivered wait here, in send order, across restarts."""

from __future__ import annotations

import gzip
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from fp8guard.agent.transport.payloads import carried_drops, count_steps

__all__ = ["SPOOL_NAME_RE", "Spool", "SpoolEntry", "SpoolFull"]

log = logging.getLogger("fp8guard.agent.transport")

SPOOL_NAME_RE: Final = re.compile(r"^(\d{12})\.json\.gz$")


class SpoolFull(Exception):
    """One batch is larger than the whole spool."""


@dataclass
class SpoolEntry:
    path: Path
    size: int
    steps: int | None  # None: a file of an earlier process, parsed only if it must be dropped
    carried: tuple[int, int] | None  # telemetry_dropped counts inside the file


class Spool:
    """A directory of ``NNNNNNNNNNNN.json.gz`` files whose lexical order is the send order."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self._max_bytes = max_bytes
        directory.mkdir(parents=True, exist_ok=True)
        self._entries: list[SpoolEntry] = []
        for path in sorted(directory.iterdir()):
            if SPOOL_NAME_RE.match(path.name):
                try:
                    size = path.stat().st_size
                except OSError:  # vanished between listing and stat
                    continue
                self._entries.append(SpoolEntry(path, size, None, None))
        self._bytes = sum(e.size for e in self._entries)
        # Continue after what an earlier process left, so a restart keeps the order.
        match = SPOOL_NAME_RE.match(self._entries[-1].path.name) if self._entries else None
        self._next_seq = int(match.group(1)) + 1 if match else 1

    def __len__(self) -> int:
        return len(self._entries)

    def oldest(self) -> SpoolEntry | None:
        return self._entries[0] if self._entries else None

    def read(self, entry: SpoolEntry) -> bytes:
        return entry.path.read_bytes()

    def remove(self, entry: SpoolEntry) -> None:
        self._entries.remove(entry)
        self._bytes -= entry.size
        try:
            entry.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("fp8guard: cannot delete spooled batch %s: %s", entry.path, exc)

    def describe(self, entry: SpoolEntry) -> tuple[int, tuple[int, int]]:
        """(distinct steps, carried drop counts) of a spooled batch, parsing the file if needed."""
        if entry.steps is None or entry.carried is None:
            try:
                payload = json.loads(gzip.decompress(entry.path.read_bytes()))
            except Exception:  # unreadable or already gone: count it as a batch of unknown steps
                payload = {}
            entry.steps = count_steps(payload)
            entry.carried = carried_drops(payload)
        return entry.steps, entry.carried

    def add(self, gz: bytes, *, steps: int, carried: tuple[int, int]) -> list[SpoolEntry]:
        """Write one batch; returns the evicted oldest entries. Raises SpoolFull or OSError."""
        if len(gz) > self._max_bytes:
            raise SpoolFull
        evicted: list[SpoolEntry] = []
        while self._entries and self._bytes + len(gz) > self._max_bytes:
            entry = self._entries[0]
            self.describe(entry)  # before the file is gone
            self.remove(entry)
            evicted.append(entry)
        self.directory.mkdir(parents=True, exist_ok=True)  # someone may have cleaned the tempdir
        while True:
            path = self.directory / f"{self._next_seq:012d}.json.gz"
            self._next_seq += 1
            try:
                # "x": never overwrite a file someone else put there; take the next number instead.
                with path.open("xb") as f:
                    f.write(gz)
            except FileExistsError:
                continue
            except OSError:
                path.unlink(missing_ok=True)  # a partial file would be backfilled as bad gzip
                raise
            break
        self._entries.append(SpoolEntry(path, len(gz), steps, carried))
        self._bytes += len(gz)
        return evicted
