"""The plug point between FP8 libraries and the monitor.

A source finds the FP8 operands of one library on a model and, once per step, writes their
state into rows of a preallocated device tensor with device operations only (no host sync).
Rows of ``out`` (shape ``[len(STATS), n]``, one column per operand of this source):

- ``amax``: the latest *completed* amax (the one the last scale update consumed);
- ``scale``: the scale that was in use when that amax was measured;
- ``saturation``: written by the monitor, ``amax * scale / fp8_max`` (> 1 means values were
  clipped to the FP8 maximum);
- ``amax_history_max``: the maximum over the amax history window (NaN-free, inf kept).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = ["AMAX", "COUNT_STATS", "HISTORY_MAX", "SATURATION", "SCALE", "STATS", "ProbeableSource", "Source",
           "SwitchableSource", "TensorSpec"]

STATS: tuple[str, ...] = ("amax", "scale", "saturation", "amax_history_max")
AMAX, SCALE, SATURATION, HISTORY_MAX = range(4)
COUNT_STATS: tuple[str, ...] = ("overflows", "underflows")
"""Exact counts per operand: values clipped at the FP8 maximum; nonzero values flushed to zero."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One FP8 operand, labelled the way TE labels quantizer roles."""

    module: str
    """Qualified module name in the model, e.g. ``blocks.0.mlp.fc1``."""
    role: str
    """``fwd_input``, ``fwd_weight``, ``fwd_output``, ``bwd_grad_output`` or ``bwd_grad_input``."""
    fp8_format: str
    """``e4m3`` or ``e5m2``."""
    fp8_max: float

    @property
    def name(self) -> str:
        return f"{self.module}:{self.role}"


@runtime_checkable
class Source(Protocol):
    """What the monitor needs from an FP8 library adapter."""

    kind: str
    """Short name: ``emulation``, ``te``, ``torchao``."""

    def tensors(self) -> Sequence[TensorSpec]:
        """The operands, in column order; fixed after construction."""
        ...

    def read(self, out: torch.Tensor) -> None:
        """Write rows AMAX, SCALE and HISTORY_MAX of ``out`` (``[len(STATS), n]``); device ops only."""
        ...

    @property
    def supports_counts(self) -> bool:
        """Whether exact overflow/underflow counts are available."""
        ...

    def arm_counts(self, enabled: bool) -> None:
        """Count during the following forward/backward passes (until disarmed)."""
        ...

    def read_counts(self, out: torch.Tensor) -> None:
        """Write counts accumulated since the last call into ``out`` (``[2, n]``) and reset them."""
        ...


@runtime_checkable
class SwitchableSource(Protocol):
    """What the remediator needs to fall modules back to high precision and promote them again.

    Each library switches its modules its own way (TE: a nested autocast; torchao: the plain
    GEMM; the emulation: a flag), so the switch lives with the source that knows the library
    and the remediator stays library-agnostic. Re-promotion must leave no stale FP8 state
    behind (a history that still holds the incident would pin the scale)."""

    kind: str

    def tensors(self) -> Sequence[TensorSpec]:
        """The operands; the remediator switches the modules they name."""
        ...

    def set_fp8(self, modules: Sequence[str] | None, enabled: bool) -> None:
        """Switch the named modules (None: all of this source's) to FP8 (``enabled``) or to
        high precision; idempotent."""
        ...


@runtime_checkable
class ProbeableSource(SwitchableSource, Protocol):
    """What the harm probe (:mod:`fp8guard.agent.harm`) needs: a module's precision in training,
    and a temporary one for a no-grad probe forward that leaves no trace."""

    def precision(self) -> dict[str, bool]:
        """Each switchable module of this source: True while it computes in FP8 in training."""
        ...

    def probe(self, fp8: Mapping[str, bool]) -> AbstractContextManager[None]:
        """For the forwards inside: the named modules in FP8 (True) or high precision (False),
        the others as in training. A module that training holds in high precision and the probe
        puts in FP8 (a promotion trial) starts from fresh FP8 state, as a re-promotion would. On
        exit every module's precision, its FP8 state (amax histories, scales, counts) and this
        source's own telemetry are as they were: the probe changes nothing that training or the
        next ``read`` sees. Host work only, no sync."""
        ...

    def settle(self, modules: Collection[str]) -> None:
        """Inside ``probe``: update the named modules' FP8 scales from the amaxes the last probe
        forward recorded, as training's step would (delayed scaling), so a trial's next forward
        runs at the scale its own values set; a no-op where scales are dynamic or the library
        updates them itself."""
        ...
