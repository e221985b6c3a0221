"""Sending what spools hold once their runs ended: the engine of ``fp8guard spool flush``.

A spool (see :mod:`~fp8guard.agent.transport.spool`) is a folder of ``NNNNNNNNNNNN.json.gz``
ingest bodies, oldest first, with the run's registration beside them. A flush sends each body
as it is, through the agent's own :class:`~fp8guard.agent.transport.delivery.Courier` (the run
registered first, transient failures retried with the same bytes), and deletes a file only
after the service acknowledged it. The service deduplicates by ``batch_id``, so a flush that
is interrupted, or runs beside a live agent on the same folder, stores nothing twice. A batch
the service refuses is kept (the person flushing decides what to do with it); a failure the
service may get over (unreachable, a refused token) stops that spool, keeping the rest in order.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from fp8guard.agent.transport.base import RunInfo
from fp8guard.agent.transport.delivery import Courier, Outcome
from fp8guard.agent.transport.private_dir import user_cache_root
from fp8guard.agent.transport.ratelimit import WARN_INTERVAL_S, RateLimiter
from fp8guard.agent.transport.spool import REGISTRATION_FILE, SPOOL_NAME_RE, read_registration

__all__ = ["FlushReport", "SpoolContents", "default_spool_roots", "find_spools", "flush_spool"]


@dataclass(frozen=True)
class SpoolContents:
    """One spool folder as found: its batches, oldest first, and the run they belong to."""

    directory: Path
    files: tuple[Path, ...]
    size: int
    run: RunInfo | None
    """The registration the agent left beside the batches (None: an agent older than the file)."""
    run_id: str
    """The registration's run id, else the first batch's, else ``?``."""


@dataclass
class FlushReport:
    """What one flush did to one spool."""

    spool: SpoolContents
    sent: int = 0
    """Acknowledged by the service (duplicates included) and deleted."""
    duplicates: int = 0
    """Of ``sent``: the service had them already (an earlier flush, or the agent itself)."""
    refused: list[tuple[Path, str]] = field(default_factory=list)
    """Kept: the service refused these bodies for what they are (file, the service's reason)."""
    stopped: str | None = None
    """Why the flush of this spool stopped early (the rest is kept), or None."""
    unanswered: bool = False
    """It stopped because the service gave no answer at all (later spools would fare no better)."""

    @property
    def left(self) -> int:
        """Batches still in the spool after the flush."""
        return len(self.spool.files) - self.sent


def default_spool_roots() -> list[Path]:
    """Where the agent puts default spools (``<root>/<run_id>/rank-<rank>``), if they exist: the
    user cache folder, and the temp-folder fallback for hosts whose home is read-only."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    roots = [user_cache_root() / "spool", Path(tempfile.gettempdir()) / f"fp8guard-{uid}" / "spool"]
    return [r for r in roots if r.is_dir()]


def find_spools(root: Path) -> list[SpoolContents]:
    """Every folder at or under ``root`` that holds spooled batches, by path (links not followed)."""
    found: list[SpoolContents] = []
    for directory, _dirs, names in os.walk(root):
        batches = sorted(n for n in names if SPOOL_NAME_RE.match(n))
        if batches:
            found.append(_contents(Path(directory), batches))
    return sorted(found, key=lambda c: c.directory)


def flush_spool(spool: SpoolContents, *, url: str, token: str | None = None, attempts: int = 3,
                timeout_s: float = 10.0, client: httpx.Client | None = None,
                sleep: Callable[[float], None] = time.sleep) -> FlushReport:
    """Send one spool's batches oldest first; delete each once acknowledged. Never raises for
    what the service or the disk does: that ends in the report."""
    report = FlushReport(spool)
    with _client(url, timeout_s, client) as http:
        courier = Courier(url=url, run=spool.run, client=http, prefix="" if str(http.base_url) else url,
                          token=token, backoff_base_s=0.2, backoff_max_s=5.0, sleep=sleep, rng=random.Random(),
                          limiter=RateLimiter(WARN_INTERVAL_S, time.monotonic))
        for path in spool.files:
            try:
                body = path.read_bytes()
            except FileNotFoundError:  # a live agent on this folder sent it meanwhile
                report.sent += 1
                continue
            except OSError as exc:
                report.refused.append((path, f"cannot read it: {exc}"))
                continue
            answer = courier.deliver(body, gzipped=True, batch_id=f"spool:{path.name}", attempts=attempts)
            if answer.outcome is Outcome.DELIVERED:
                path.unlink(missing_ok=True)
                report.sent += 1
                report.duplicates += answer.duplicate
            elif answer.outcome is Outcome.REJECTED:
                report.refused.append((path, answer.reason))
            else:
                report.stopped, report.unanswered = answer.reason, answer.status is None
                break
    if not report.left:
        _tidy(spool.directory)
    return report


@contextlib.contextmanager
def _client(url: str, timeout_s: float, client: httpx.Client | None) -> Iterator[httpx.Client]:
    if client is not None:
        yield client
        return
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s) as own:
        yield own


def _contents(directory: Path, batches: list[str]) -> SpoolContents:
    files = tuple(directory / n for n in batches)
    size = 0
    for f in files:
        with contextlib.suppress(OSError):
            size += f.stat().st_size
    run = read_registration(directory)
    return SpoolContents(directory, files, size, run, run.run_id if run is not None else _run_id_of(files[0]))


def _run_id_of(path: Path) -> str:
    try:
        run_id = json.loads(gzip.decompress(path.read_bytes())).get("run_id")
    except Exception:  # unreadable: the flush will say so
        return "?"
    return run_id if isinstance(run_id, str) else "?"


def _tidy(directory: Path) -> None:
    """An emptied spool: drop its registration and the folder (only if nothing else is in it)."""
    with contextlib.suppress(OSError):
        if not any(SPOOL_NAME_RE.match(p.name) for p in directory.iterdir()):
            (directory / REGISTRATION_FILE).unlink(missing_ok=True)
            directory.rmdir()
