"""Rank awareness: who am I, one run identity shared by every rank, and which ranks report."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Sequence

import torch.distributed as dist

__all__ = ["command_rank", "rank_and_world", "reports", "shared_run_id"]


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) from torch.distributed, else torchrun's environment, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def shared_run_id(run_id: str | None) -> str:
    """The configured id, or one made up by rank 0 and broadcast (a one-time sync at attach)."""
    if run_id is not None:
        return run_id
    made = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box: list[str | None] = [made if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        made = str(box[0])
    return made


def reports(report_ranks: str | Sequence[int], rank: int, source_kinds: Sequence[str]) -> bool:
    """Whether ``rank`` sends telemetry under ``MonitorConfig.report_ranks``. ``auto``: every
    rank, except that under Transformer Engine (which all-reduces amaxes over the data-parallel
    group, so replicas would send identical data) only rank 0."""
    if report_ranks == "all":
        return True
    if report_ranks == "zero":
        return rank == 0
    if report_ranks == "auto":
        return rank == 0 or "te" not in source_kinds
    return rank in set(report_ranks)


def command_rank(report_ranks: str | Sequence[int], world_size: int) -> int:
    """The lowest reporting rank, the same on every rank (``report_ranks`` is per-run config;
    ``auto`` reports from rank 0, or from every rank): a list without rank 0 (say the last
    pipeline stage, which holds the loss) makes commands travel from its lowest rank."""
    if isinstance(report_ranks, str):
        return 0
    ranks = [r for r in report_ranks if r < world_size]
    return min(ranks) if ranks else 0
