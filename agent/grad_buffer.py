"""Gradients kept as views of one flat buffer per (device, dtype): ``MonitorConfig(grad_buffer=True)``.

Why. Under ``zero_grad(set_to_none=True)`` autograd gives every gradient a new tensor at a new
address each step, so a monitor that computes the gradient norm must read every parameter's
``.grad`` each step: on the H200 that walk was the one part of ``monitor.step``'s host time
that grew with depth (79 us at 12 layers, 385 us at 96; docs/gpu.md). With the gradients as
views of a buffer that the loop keeps (``optimizer.zero_grad(set_to_none=False)`` zeroes them in
place), the norm is one ``vector_norm`` launch over the buffer and the step reads no gradient.
The same layout as DDP's ``gradient_as_bucket_view`` and Megatron's gradient buffers.

How it stays right without reading the gradients. A view shares its base's version counter, and
every in-place write to a gradient (the backward's accumulation, ``zero_grad``'s zeroing,
clipping, AMP's unscaling) bumps it. A training loop bumps it by the same amount every step; a
step whose bump differs from the previous step's is checked in full (each
parameter's ``.grad`` is still its view: one C-level walk); the first and the last parameter's
are checked every step. A gradient found replaced ends the buffer: the norm reads each gradient
again, exactly as without it, and a warning says why. The one case seen a step late: some
gradients (not the first or last) replaced by new tensors after the step's last in-place write
and before ``monitor.step``; that step's norm counts them as the backward left them, and the next
step's bump finds them.

Gradients set to None. ``zero_grad(set_to_none=True)`` (PyTorch's default) drops the views, and so
does fp8guard's own rollback, which needs the optimizer to skip the abandoned step. A hook before
the model's forward puts them back, zeroed, when every gradient is None. A loop that drops them
again before one step went by on the cheap check (it sets them to None every step) ends the
buffer: re-assigning every ``.grad`` each step would cost more host time than it saves.

What changes for the loop: every parameter that requires a gradient has one from ``attach`` on
(zeros until its first backward), so an optimizer steps a parameter that got no gradient with a
zero one (weight decay and momentum still apply), as under DDP's bucket views. Gradients present
at ``attach`` are copied into the buffer (for that moment the gradients' memory is held twice).
Sparse gradients become dense. One process only: under ``torch.distributed`` DDP or FSDP own the
gradients' layout.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from itertools import repeat
from operator import attrgetter, is_
from typing import Any

import torch
from torch import nn

__all__ = ["GradBuffer"]

log = logging.getLogger("fp8guard.agent")

_ALIGN_BYTES = 256
"""Each gradient's view starts on this boundary, as a fresh allocation of PyTorch's caching
allocator would (vectorized kernels, fused optimizers, check their operands' alignment)."""

_grad = attrgetter("grad")


def _disable_compile(fn: Any) -> Any:
    """Keep torch.compile from tracing the hook (it reads ``.grad`` and may assign it)."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


class GradBuffer:
    """The gradients of ``params`` (those that require one) as views of flat device buffers."""

    def __init__(self, model: nn.Module, params: Iterable[nn.Parameter]) -> None:
        self._params = [p for p in params if p.requires_grad]
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, p in enumerate(self._params):
            groups.setdefault((p.device, p.dtype), []).append(i)
        self._first: nn.Parameter | None = self._params[0] if self._params else None
        self._last: nn.Parameter | None = self._params[-1] if self._params else None
        self.buffers: list[torch.Tensor] = []
        self._views: list[Any] = [None] * len(self._params)
        for (device, dtype), members in groups.items():
            align = max(1, _ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
            offsets, size = [], 0
            for i in members:
                offsets.append(size)
                size += -(-self._params[i].numel() // align) * align
            buf = torch.zeros(size, dtype=dtype, device=device)
            for i, at in zip(members, offsets, strict=True):
                p = self._params[i]
                self._views[i] = buf[at:at + p.numel()].view(p.shape)
            self.buffers.append(buf)
        self.state = "adopted"
        """``adopted`` (the norm reads the buffers) or ``ended: <why>`` (it reads each gradient)."""
        self.full_checks = 0
        """Steps that walked every gradient (the first, and those whose version bump changed)."""
        self.readopted = 0
        """Times the views were put back after every gradient had been set to None."""
        self._bump = -1
        self._version = 0
        self._settled = self._passed = False
        self._assign(copy=True)
        self._hook = model.register_forward_pre_hook(_disable_compile(self._before_forward))

    @property
    def adopted(self) -> bool:
        return self.state == "adopted"

    def intact(self) -> bool:
        """Whether every gradient is still its view (read the buffers); ends the buffer if not."""
        if not self.adopted or self._first is None or self._last is None:
            return False
        version = self._version_now()
        bump = version - self._version
        self._version = version
        if self._first.grad is self._views[0] and self._last.grad is self._views[-1]:
            if bump == 0 and self._passed:
                return True  # nothing written since a check that passed (the norm asked twice in a step)
            if bump == self._bump and bump > 0:
                self._settled = self._passed = True
                return True
        self.full_checks += 1
        if all(map(is_, map(_grad, self._params), self._views)):
            self._passed = True
            if bump > 0:
                self._bump = bump
            return True
        self.end("a gradient is no longer the buffer's view (replaced or set to None outside the "
                 "model's forward)")
        return False

    def norm(self) -> torch.Tensor:
        """The L2 norm of every gradient, as a 0-d float32 tensor on the first buffer's device."""
        norms: list[torch.Tensor] = [torch.linalg.vector_norm(b, dtype=torch.float32) for b in self.buffers]
        if len(norms) == 1:
            return norms[0]
        first = norms[0].device
        total: torch.Tensor = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]))
        return total

    def end(self, why: str) -> None:
        """Stop using the buffers (gradients still pointing into them keep their values)."""
        if not self.adopted:
            return
        self.state = f"ended: {why}"
        self._hook.remove()
        self.buffers = []
        self._views = []
        log.warning("fp8guard: gradient buffer given up: %s; the grad norm reads each gradient again, so "
                    "monitor.step's host time grows with depth. Keep gradients in place with "
                    "optimizer.zero_grad(set_to_none=False)", why)

    def close(self) -> None:
        """Detach the hook; the gradients stay as they are (views, holding the buffers)."""
        if self.adopted:
            self._hook.remove()
            self.state = "ended: closed"
            self.buffers = []
            self._views = []

    # -- internals -------------------------------------------------------------------------------

    def _version_now(self) -> int:
        return sum(b._version for b in self.buffers)

    def _assign(self, *, copy: bool) -> None:
        with torch.no_grad():
            for p, view in zip(self._params, self._views, strict=True):
                if copy and p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
        self._version = self._version_now()
        self._bump = -1
        self._settled = self._passed = False

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if not self._params or self._params[0].grad is not None:
            return
        if not all(map(is_, map(_grad, self._params), repeat(None))):
            return  # only some gradients are None: the step's full check decides
        if self.readopted and not self._settled:
            self.end("the gradients are set to None every step (zero_grad's default set_to_none=True)")
            return
        for buf in self.buffers:
            buf.zero_()
        self._assign(copy=False)
        self.readopted += 1
