"""Where a transport's spool lives: the folder the caller chose, or a private default per run and rank."""

from __future__ import annotations

import logging
from pathlib import Path

from fp8guard.agent.transport.base import RunInfo
from fp8guard.agent.transport.private_dir import default_spool_root, ensure_private_dir, user_cache_root
from fp8guard.agent.transport.spool import Spool

__all__ = ["SpoolSite"]

log = logging.getLogger("fp8guard.agent.transport")


class SpoolSite:
    """Opens the spool on first need. ``directory`` defaults to
    ``<user cache>/fp8guard/spool/<run_id>/rank-<rank>`` (the rank of the first payload), created
    private (0700), so neither other users nor ranks sharing a host share a spool. A folder that
    cannot be used is said once; batches that must be spooled are then lost (and reported)."""

    def __init__(self, run: RunInfo, directory: Path | None, max_bytes: int) -> None:
        self._run = run
        self._directory = directory
        self.max_bytes = max_bytes
        self.spool: Spool | None = None
        self.unusable = False
        self._default_root: Path | None = None

    def directory(self, rank: int | None) -> Path | None:
        """The spool's folder; None while the default one waits for the first payload's rank."""
        if self.spool is not None:
            return self.spool.directory
        if self._directory is not None:
            return self._directory
        if rank is None:
            return None
        root = self._default_root or user_cache_root() / "spool"
        return root / self._run.run_id / f"rank-{rank}"

    def usable_directory(self, rank: int | None) -> Path | None:
        """Where batches go if they must be spooled, None if they cannot be (no spool)."""
        return self.directory(rank) if self.max_bytes and not self.unusable else None

    def open(self, rank: int | None) -> Spool | None:
        if self.spool is not None or self.unusable or self.max_bytes == 0:
            return self.spool
        if self._directory is None and rank is not None and self._default_root is None:
            try:
                self._default_root = default_spool_root()
            except OSError as exc:
                self.unusable = True
                log.error("fp8guard: no private spool folder (%s); batches that cannot be delivered are "
                          "dropped (and reported); pass spool_dir= to choose one", exc)
                return None
        directory = self.directory(rank)
        if directory is None:
            return None
        make_dir = None
        if self._default_root is not None and self._directory is None:
            root = self._default_root.parent

            def make_dir(d: Path) -> None:
                ensure_private_dir(root, d)
        try:
            self.spool = Spool(directory, self.max_bytes, make_dir=make_dir, run=self._run)
        except OSError as exc:
            self.unusable = True
            log.warning("fp8guard: cannot use spool directory %s (%s); batches that cannot be delivered "
                        "are dropped", directory, exc)
        return self.spool

    def count(self) -> int:
        """Batches in the spool now."""
        return len(self.spool) if self.spool is not None else 0
