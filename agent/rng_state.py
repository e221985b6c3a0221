"""The process's random generators, captured into a checkpoint and restored from one, so a
rollback replays the same dropout masks and data order as the run it rewinds."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["capture_rng_state", "restore_rng_state"]


def _numpy() -> Any:
    """NumPy if importable (optional: only to save and restore its global generator), else None."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def capture_rng_state() -> dict[str, Any]:
    """The process's generators as tensors and plain numbers (``torch.load(weights_only=True)``
    reads them back): torch's CPU generator, every CUDA device's when CUDA is initialised, Python's
    ``random`` and NumPy's global generator when NumPy is importable."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "cuda": None, "python": random.getstate(),
                             "numpy": None}
    # Only when CUDA is in use: asking would otherwise initialise CUDA in a CPU-only process.
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        # As a tensor and plain numbers, so weights_only loading accepts it.
        state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what :func:`capture_rng_state` returned (CUDA devices this process lacks are
    skipped; NumPy's part only when NumPy is importable here)."""
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        n = min(len(cuda), torch.cuda.device_count())
        for i in range(n):
            torch.cuda.set_rng_state(cuda[i], i)
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    saved = state.get("numpy")
    np = _numpy()
    if saved is not None and np is not None:
        np.random.set_state((saved["kind"], saved["keys"].numpy().astype(np.uint32), saved["pos"],
                             saved["has_gauss"], saved["cached_gaussian"]))
