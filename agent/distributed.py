"""Rank awareness: who am I, and one run identity shared by every rank."""

from __future__ import annotations

import os
import secrets
import time

import torch.distributed as dist

__all__ = ["rank_and_world", "shared_run_id"]


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
