"""What every fused kernel shares: whether Triton runs here, and how many programs fill the GPU.

The only place, with the kernel modules beside it, where fp8guard imports Triton (optional: the
agent's dependencies stay torch and httpx). Triton's CPU interpreter (``TRITON_INTERPRET=1``)
runs the kernels on CPU tensors, which is how CI checks them against their torch references.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

BLOCK = 4096
"""Elements per block of the streaming kernels (counting, sum of squares)."""


def interpret() -> bool:
    """Whether Triton's CPU interpreter is on (read per call: Triton reads it when imported)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


@functools.cache
def triton_modules() -> tuple[Any, Any] | None:
    """``(triton, triton.language)``, or None when Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # not installed, or a broken install: every caller has an exact torch path
        return None
    return triton, tl


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernels run for tensors on ``device`` (CUDA, or CPU when interpreting)."""
    if device.type != "cuda" and not (device.type == "cpu" and interpret()):
        return False
    return triton_modules() is not None


def device_index(device: torch.device) -> int:
    """The CUDA device index ``device`` means (its own, else the current one; 0 off CUDA)."""
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" else 0


@functools.cache
def max_programs(device_index: int, per_sm: int = 8) -> int:
    """Enough programs to fill the GPU a few times over; each then loops over its blocks."""
    if interpret():
        return 4
    return per_sm * torch.cuda.get_device_properties(device_index).multi_processor_count


def launch_shape(n: int, device: torch.device, block: int = BLOCK, per_sm: int = 8) -> tuple[int, int]:
    """(programs, blocks per program). Blocks per program is a power of two and a compile-time
    constant (a handful of kernel variants in all, and a loop the compiler can unroll)."""
    blocks = -(-n // block)
    iters = 1
    while blocks > iters * max_programs(device_index(device), per_sm):
        iters *= 2
    return -(-blocks // iters), iters
