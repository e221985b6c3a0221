"""The on-disk spool: batches that could not be delivered wait here, in send order, across restarts."""

from __future__ import annotations

import bisect
import gzip
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from fp8guard.agent.transport.base import RunInfo
from fp8guard.agent.transport.payloads import carried_drops, count_steps

__all__ = ["REGISTRATION_FILE", "SPOOL_NAME_RE", "Spool", "SpoolEntry", "SpoolFull", "read_registration"]

log = logging.getLogger("fp8guard.agent.transport")

SPOOL_NAME_RE: Final = re.compile(r"^(\d{12})\.json\.gz$")
REGISTRATION_FILE: Final = "run.json"
"""Beside the batches: the run's registration (``RunInfo``), so ``fp8guard spool flush`` can
register a run whose every request failed before the process ended."""


class SpoolFull(Exception):
    """One batch is larger than the whole spool."""


@dataclass
class SpoolEntry:
    seq: int
    path: Path
    size: int
    steps: int | None  # None: a file of an earlier process, parsed only if it must be dropped
    carried: tuple[int, int] | None  # telemetry_dropped counts inside the file


class Spool:
    """A directory of ``NNNNNNNNNNNN.json.gz`` files whose number is the send order.

    The number is the batch's place in the order the transport admitted it (``seq``), not the
    time it reached the disk: a batch that fails while later ones were already spooled takes
    its own earlier place, so the backfill keeps the training order. ``make_dir`` creates the
    folder on the first write (a private one for the default location); the folder is not
    created as long as nothing must be spooled. With ``run``, the first write also leaves the
    run's registration beside the batches (:data:`REGISTRATION_FILE`).
    """

    def __init__(self, directory: Path, max_bytes: int, *, make_dir: Callable[[Path], None] | None = None,
                 run: RunInfo | None = None) -> None:
        self.directory = directory
        self._max_bytes = max_bytes
        self._make_dir = make_dir or _plain_mkdir
        self._run = run
        self._entries: list[SpoolEntry] = []
        names = sorted(p for p in directory.iterdir() if SPOOL_NAME_RE.match(p.name)) if directory.is_dir() else []
        for path in names:
            try:
                size = path.stat().st_size
            except OSError:  # vanished between listing and stat
                continue
            self._entries.append(SpoolEntry(_seq_of(path), path, size, None, None))
        self._bytes = sum(e.size for e in self._entries)
        # Continue after what an earlier process left, so a restart keeps the order.
        self.next_seq = self._entries[-1].seq + 1 if self._entries else 1

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

    def add(self, gz: bytes, *, seq: int, steps: int, carried: tuple[int, int]) -> list[SpoolEntry]:
        """Write one batch at its place ``seq``; returns the evicted oldest entries. Raises
        SpoolFull or OSError."""
        if len(gz) > self._max_bytes:
            raise SpoolFull
        evicted: list[SpoolEntry] = []
        while self._entries and self._bytes + len(gz) > self._max_bytes:
            entry = self._entries[0]
            self.describe(entry)  # before the file is gone
            self.remove(entry)
            evicted.append(entry)
        self._make_dir(self.directory)  # on the first write; again if someone cleaned it away
        if self._run is not None:
            self._write_registration(self._run)
        while True:
            path = self.directory / f"{seq:012d}.json.gz"
            try:
                # "x": never overwrite a file someone else put there; take the next number instead.
                with path.open("xb") as f:
                    f.write(gz)
            except FileExistsError:
                seq = max(seq + 1, self.next_seq)
                self.next_seq = seq + 1
                continue
            except OSError:
                path.unlink(missing_ok=True)  # a partial file would be backfilled as bad gzip
                raise
            break
        self.next_seq = max(self.next_seq, seq + 1)
        bisect.insort(self._entries, SpoolEntry(seq, path, len(gz), steps, carried), key=lambda e: e.seq)
        self._bytes += len(gz)
        return evicted


    def _write_registration(self, run: RunInfo) -> None:
        """Once per process and folder, atomically (a reader never sees half a file)."""
        try:
            body = json.dumps({"run_id": run.run_id, **run.registration_body()}, default=str).encode()
            tmp = self.directory / f".{REGISTRATION_FILE}.{os.getpid()}.tmp"
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(body)
            os.replace(tmp, self.directory / REGISTRATION_FILE)
        except (OSError, ValueError) as exc:  # the batches matter more: spool them anyway
            log.warning("fp8guard: cannot write the run's registration to %s: %s", self.directory, exc)
        self._run = None


def read_registration(directory: Path) -> RunInfo | None:
    """The registration a spool left beside its batches, or None (none written, or unreadable)."""
    try:
        data = json.loads((directory / REGISTRATION_FILE).read_bytes())
        return RunInfo(run_id=data["run_id"], model=data.get("model"), recipe=data.get("recipe"),
                       world_size=data.get("world_size", 1), config=data.get("config"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _seq_of(path: Path) -> int:
    match = SPOOL_NAME_RE.match(path.name)
    return int(match.group(1)) if match else 0


def _plain_mkdir(directory: Path) -> None:
    """A folder the caller chose: created with its parents, the last one private (0700)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    directory.mkdir(mode=0o700, exist_ok=True)
