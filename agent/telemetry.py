"""Preallocated device buffers for one flush interval, their hand-off to the host, and the
gradient norm the monitor records.

The training thread only enqueues device work here: writes into fixed buffers, and at each
flush one non-blocking copy into host memory plus an event. The host side (waiting on the
event, encoding, shipping) runs on the shipper's thread.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter, is_
from typing import Any, Literal

import torch
from torch import nn

from fp8guard.agent.errors import ConfigError
from fp8guard.agent.grad_buffer import GradBuffer, device_dtype_groups
from fp8guard.agent.kernels import TableSumOfSquares, triton_available
from fp8guard.agent.sources.base import AMAX, COUNT_STATS, SATURATION, SCALE, STATS

__all__ = ["FlushPacket", "GradNorm", "StepRing", "device_grad_norm", "norm_of_grads"]

LOSS, GRAD_NORM, LR, LOSS_FP8, LOSS_BF16, FP8_LOSS_GAP = range(6)
_HARM = ("loss_fp8", "loss_bf16", "fp8_loss_gap")


@dataclass
class FlushPacket:
    """What one flush hands to the background thread: host tensors and host-side lists."""

    steps: list[int]
    times: list[float]
    given: list[tuple[bool, bool, bool, bool]]
    lr_host: list[float | None]
    tokens: list[int | None]
    stats: torch.Tensor
    scalars: torch.Tensor
    count_steps: list[int]
    counts: torch.Tensor | None
    ready: torch.cuda.Event | None = None
    events: list[dict[str, Any]] = field(default_factory=list)

    def wait(self) -> None:
        """Block (the shipper's thread, never the trainer's) until the copies have landed."""
        if self.ready is not None:
            self.ready.synchronize()

    def step_records(self) -> list[dict[str, Any]]:
        scalars = self.scalars.tolist()  # host tensor: no device sync
        out = []
        for i, step in enumerate(self.steps):
            loss_given, norm_given, lr_on_device, probed = self.given[i]
            lr = scalars[i][LR] if lr_on_device else self.lr_host[i]
            rec: dict[str, Any] = {"step": step, "time": self.times[i]}
            if loss_given:
                rec["loss"] = scalars[i][LOSS]
            if norm_given:
                rec["grad_norm"] = scalars[i][GRAD_NORM]
            if lr is not None:
                rec["lr"] = lr
            if self.tokens[i] is not None:
                rec["tokens"] = self.tokens[i]
            if probed:  # the harm probe ran at this step
                rec.update(zip(_HARM, scalars[i][LOSS_FP8:FP8_LOSS_GAP + 1], strict=True))
            out.append(rec)
        return out


def _host_like(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cuda":
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return torch.empty(t.shape, dtype=t.dtype)


class StepRing:
    """Device buffers for up to ``capacity`` steps of ``n_tensors`` operands."""

    def __init__(self, *, n_tensors: int, fp8_max: Sequence[float], capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.device = device
        self.stats = torch.zeros(capacity, len(STATS), n_tensors, device=device)
        self.counts = torch.zeros(capacity, len(COUNT_STATS), n_tensors, device=device)
        self.scalars = torch.zeros(capacity, 6, device=device)
        self.fp8_max = torch.tensor(list(fp8_max), dtype=torch.float32, device=device)
        self._saturation = torch.empty(n_tensors, device=device)
        self._reset()

    def _reset(self) -> None:
        self.steps: list[int] = []
        self.times: list[float] = []
        self.given: list[tuple[bool, bool, bool, bool]] = []
        self.lr_host: list[float | None] = []
        self.tokens: list[int | None] = []
        self.count_steps: list[int] = []

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def full(self) -> bool:
        return len(self.steps) >= self.capacity

    def slot(self) -> int:
        return len(self.steps)

    def commit_step(self, step: int, *, loss_given: bool, norm_given: bool, lr: float | torch.Tensor | None,
                    tokens: int | None, probed: bool = False) -> None:
        i = len(self.steps)
        lr_on_device = isinstance(lr, torch.Tensor)
        if isinstance(lr, torch.Tensor):
            self.scalars[i, LR].copy_(lr.detach().reshape(()), non_blocking=True)
        self.steps.append(step)
        self.times.append(time.time())
        self.given.append((loss_given, norm_given, lr_on_device, probed))
        self.lr_host.append(None if lr is None or isinstance(lr, torch.Tensor) else float(lr))
        self.tokens.append(tokens)

    def saturation(self, i: int) -> torch.Tensor:
        """Slot ``i``'s saturation ratios (``amax x scale / fp8_max``), on the device, in a buffer
        the next call overwrites (the tripwire reads it at once)."""
        torch.mul(self.stats[i, AMAX], self.stats[i, SCALE], out=self._saturation)
        return torch.div(self._saturation, self.fp8_max, out=self._saturation)

    def drain(self) -> FlushPacket:
        """Enqueue the device-to-host copy of what was recorded and start a new interval.

        # sync point (deferred): the copy is non-blocking; the event is waited on by the
        # shipper's thread, so the training thread never waits here.
        """
        k, kc = len(self.steps), len(self.count_steps)
        stats = self.stats[:k]
        stats[:, SATURATION] = stats[:, AMAX] * stats[:, SCALE] / self.fp8_max
        host_stats = _host_like(stats)
        host_stats.copy_(stats, non_blocking=True)
        host_scalars = _host_like(self.scalars[:k])
        host_scalars.copy_(self.scalars[:k], non_blocking=True)
        host_counts = None
        if kc:
            host_counts = _host_like(self.counts[:kc])
            host_counts.copy_(self.counts[:kc], non_blocking=True)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record()
        packet = FlushPacket(steps=self.steps, times=self.times, given=self.given, lr_host=self.lr_host,
                             tokens=self.tokens, stats=host_stats, scalars=host_scalars,
                             count_steps=self.count_steps, counts=host_counts, ready=ready)
        self._reset()
        return packet


_grad = attrgetter("grad")
_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_is_contiguous = torch.Tensor.is_contiguous
_dtype = attrgetter("dtype")
_device_index = torch.Tensor.get_device


class GradNorm:
    """The global L2 norm of the parameters' gradients, on the device, with per-step host work
    that does not grow with the number of layers beyond one C-level walk over the parameters.

    ``backend="foreach"``: one ``torch._foreach_norm`` (a multi-tensor kernel) per (device, dtype)
    group of parameters, grouped once at construction, then one stack and one norm. Per-tensor
    norms are float32 (bf16 norms would carry bf16 rounding). The result is the same value, bit
    for bit, as ``vector_norm(stack(_foreach_norm(grads)))`` over the gradients in parameter
    order: with several groups their norms are put back in that order on the device (one index
    select). No host sync.

    ``backend="table"``: one Triton launch per dtype group over device tables built once
    (:class:`~fp8guard.agent.kernels.TableSumOfSquares`), a sum and a square root. Per call the
    host reads every gradient's address at C speed (``map``, no Python loop) and compares the
    list with the one the tables point at; only when it differs are the tables re-pointed (the
    new gradients checked for contiguity, dtype and size, the addresses uploaded without a host
    sync). Why every call and not every N calls: after ``zero_grad(set_to_none=True)`` autograd
    allocates new gradients each step, at new addresses (on the H200 the tables were re-pointed
    at every step of every run: ``grad_norm_repointed`` in docs/gpu-results/gpu_host_cost.*.json),
    and a table pointing at freed memory would read
    another tensor's values or, after ``torch.cuda.empty_cache()``, unmapped memory (a CUDA
    error that ends the run). Holding the old gradients to keep the memory valid would double
    the gradients' memory. So the addresses are compared each call (about 0.1-0.3 us per
    parameter on a CPU) and, under ``set_to_none``, uploaded every step: that upload is the
    per-step host work that still grows with the model. The checks of new gradients are C-level
    maps too (they were a Python loop per gradient): on the H200's host each map over 1,152
    gradients took 56-93 us (``grad_walk_us`` in docs/gpu-results/gpu_host_cost.sweep.2026-12-02f.json).
    With gradients kept between steps (``set_to_none=False``) the tables are pointed once.

    ``buffer``: the gradients are views of a :class:`~fp8guard.agent.grad_buffer.GradBuffer`;
    while it holds them, the norm is one launch per buffer and the host reads no gradient (its
    version counter says whether the views are still the gradients); once it ends, the paths above.
    """

    def __init__(self, params: Iterable[nn.Parameter], *,
                 backend: Literal["auto", "foreach", "table"] = "auto", buffer: GradBuffer | None = None) -> None:
        """``backend="table"`` needs CUDA with Triton, or Triton's CPU interpreter. Its value
        differs from the foreach path in the float32 summation order (both within 1.1e-7 of a
        float64 norm on the H200); a call it cannot serve (a parameter without a gradient, a
        non-contiguous gradient, the host ``_STAGING_SLOTS`` re-pointings ahead of the device)
        takes the foreach path. ``"auto"`` (the default): the table where every parameter is
        on a CUDA device with Triton, else foreach. Calibration (H200, TE, bf16 gradients,
        ``docs/gpu.md``): the table norm took 0.35-2.4 ms of GPU time against foreach's
        0.83-6.3 ms for 151M-1.2B parameters, and the 604M model's monitored step 1.0029x the
        plain one against 1.0070x with foreach, side by side."""
        self._params = [p for p in params if p.requires_grad]
        self.buffer = buffer
        """The gradient buffer the norm reads while it holds the gradients (None: no buffer)."""
        groups = device_dtype_groups(self._params)
        self._groups = list(groups.values())
        self._tables: list[TableSumOfSquares] = []
        self._numels = [p.numel() for p in self._params]
        self._dtypes = [p.dtype for p in self._params]
        self._device_indices = [p.get_device() for p in self._params]
        self._pointed: array[int] | None = None
        """The gradient addresses the tables point at (None: not pointed yet)."""
        self.repointed = 0
        """How many calls re-pointed the tables (new gradient addresses)."""
        if backend == "auto":
            backend = "table" if groups and all(d.type == "cuda" and triton_available(d) for d, _ in groups) \
                else "foreach"
        if backend == "table":
            for (device, dtype), members in groups.items():
                if not triton_available(device):
                    raise ConfigError(f"grad norm backend 'table' needs Triton for {device} tensors")
                self._tables.append(TableSumOfSquares([self._numels[i] for i in members], dtype, device))
        elif backend != "foreach":
            raise ConfigError(f"grad norm backend must be 'auto', 'foreach' or 'table', got {backend!r}")
        self.backend: Literal["foreach", "table"] = backend
        order = [i for members in self._groups for i in members]
        self._inverse: torch.Tensor | None = None
        if len(self._groups) > 1:
            inverse = [0] * len(order)
            for at, i in enumerate(order):
                inverse[i] = at
            self._inverse = torch.tensor(inverse, dtype=torch.long, device=self._params[0].device)

    def __call__(self) -> torch.Tensor | None:
        """The norm as a 0-d float32 device tensor; None when no parameter has a gradient."""
        if self.buffer is not None and self.buffer.intact():
            return self.buffer.norm()
        if self._tables:
            grads: list[Any] = list(map(_grad, self._params))
            try:  # C-level walk; a parameter without a gradient raises here (None has no data_ptr)
                ptrs: array[int] | None = array("q", map(_data_ptr, grads))
            except (TypeError, RuntimeError):  # None, or a gradient without storage
                ptrs = None
            if ptrs is not None and (ptrs == self._pointed or self._repoint(grads, ptrs)):
                return self._table_norm()
        return self._foreach()

    def _repoint(self, grads: list[Any], ptrs: array[int]) -> bool:
        """The gradients moved (or this is the first call): check them and re-point the tables.

        Every check is a C-level map, compared with what the tables were built for: PyTorch
        already refuses a ``.grad`` of another dtype, device or size than its parameter, but a
        parameter itself may have changed since attach (``p.data = ...``, ``model.to(...)``)."""
        if not all(map(_is_contiguous, grads)) or list(map(_numel, grads)) != self._numels \
                or list(map(_dtype, grads)) != self._dtypes or list(map(_device_index, grads)) != self._device_indices:
            return False
        for table, members in zip(self._tables, self._groups, strict=True):
            if not table.point(ptrs if len(members) == len(ptrs) else list(map(ptrs.__getitem__, members))):
                self._pointed = None  # some tables may point at the new gradients: re-point all next call
                return False
        self._pointed = ptrs
        self.repointed += 1
        return True

    def _table_norm(self) -> torch.Tensor:
        sums = [table() for table in self._tables]
        present = [x for x in sums if x is not None]
        if not present:  # every gradient is empty
            return torch.zeros((), dtype=torch.float32, device=self._tables[0].device)
        first = present[0]
        squares = first if len(present) == 1 else torch.stack([x.to(first.device) for x in present]).sum()
        return squares.sqrt()

    def _foreach(self) -> torch.Tensor | None:
        grads: list[Any] = list(map(_grad, self._params))
        if not grads:
            return None
        if any(map(is_, grads, repeat(None))):
            return _ordered_norm([g for g in grads if g is not None])
        if self._inverse is None:  # one group: one device
            total: torch.Tensor = torch.linalg.vector_norm(torch.stack(_foreach_norms(grads)))
            return total
        first = grads[0].device
        stacked = [torch.stack(_foreach_norms([grads[i] for i in members])).to(first)
                   for members in self._groups]
        return torch.linalg.vector_norm(torch.cat(stacked).index_select(0, self._inverse))  # type: ignore[no-any-return]


def _foreach_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's L2 norm as float32 (bf16 norms would carry bf16 rounding). float64
    gradients (a model moved to double after attach) refuse a float32 norm: they are normed in
    their own precision, then converted (a norm beyond float32's range is inf: data)."""
    try:
        return list(torch._foreach_norm(grads, 2, dtype=torch.float32))
    except RuntimeError:
        return [n.float() for n in torch._foreach_norm(grads, 2)]


def _norm_of(norms: Sequence[torch.Tensor]) -> torch.Tensor:
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
    return total


def norm_of_grads(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The global L2 norm of ``grads`` in one ``torch._foreach_norm`` (multi-tensor kernels where
    the tensors share a dtype and device), one stack and one norm; None for no tensors."""
    return _norm_of(_foreach_norms(grads)) if grads else None


def _ordered_norm(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """Some parameters have no gradient this step: group what is there, in parameter order."""
    keys = {(g.device, g.dtype) for g in grads}
    if len(keys) <= 1:
        return norm_of_grads(grads)
    norms: list[Any] = [None] * len(grads)
    for key in keys:
        at = [i for i, g in enumerate(grads) if (g.device, g.dtype) == key]
        for i, n in zip(at, _foreach_norms([grads[i] for i in at]), strict=True):
            norms[i] = n
    return _norm_of(norms)


def device_grad_norm(params: Iterable[nn.Parameter]) -> torch.Tensor | None:
    """Global L2 norm of the gradients, computed on the device (no host sync); None without grads.

    One ``torch._foreach_norm`` over every gradient (multi-tensor kernels where they share a
    dtype and device), then one stack and one norm: for a one-off. A loop calling this every step
    should build a :class:`GradNorm` once and call it instead (the Monitor does,
    :meth:`~fp8guard.agent.Monitor.grad_norm`): it groups the parameters once and, on CUDA with
    Triton, builds its device tables once."""
    return norm_of_grads([p.grad for p in params if p.grad is not None])
