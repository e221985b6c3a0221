"""Gradients kept as views of one flat buffer per (device, dtype): ``MonitorConfig(grad_buffer=True)``.

Why. Under ``zero_grad(set_to_none=True)`` autograd gives every gradient a new tensor at a new
address each step, so a monitor that computes the gradient norm must read every parameter's
``.grad`` each step: on the H200 that walk was the one part of ``monitor.step``'s host time
that grew with depth (79 us at 12 layers, 385 us at 96; docs/gpu.md). With the gradients as
views of a buffer that the loop keeps (``optimizer.zero_grad(set_to_none=False)`` zeroes them in
place), the norm is one ``vector_norm`` launch over the buffer and the step reads no gradient.
The same layout as DDP's ``gradient_as_bucket_view`` and Megatron's gradient buffers: each view
has its parameter's strides (a channels_last or transposed parameter's gradient is laid out as
the parameter, which fused optimizers rely on) and starts on a 256-byte boundary.

How it stays right without reading the gradients. A view shares its base's version counter, and
the in-place writes a loop makes to its gradients (the backward's accumulation, ``zero_grad``'s
zeroing, clipping) bump it. A training loop bumps it by the same amount every step. Each step
the monitor reads the counter and checks the first and the last parameter's gradient (the same
object, at the same address: ``model.to(...)`` and ``.data =`` keep the object and move its
memory); a step whose bump differs from the previous one is checked in full (every gradient
its view, at its address: two C-level walks). A gradient found replaced or moved ends the
buffer: the norm reads each gradient again, exactly as without it, and a warning says why. The
one case seen a step late: gradients other than the first and last replaced after the step's
last in-place write and before ``monitor.step``; that step's norm counts them as the backward
left them, and the next step's bump finds them. A loop whose bump varies (a varying number of
micro-batches, parameters used only on some steps) is checked in full on those steps: correct,
at the cost of the walk.

Gradients set to None. ``zero_grad(set_to_none=True)`` (PyTorch's default) drops the views, and so
does fp8guard's own rollback, which needs the optimizer to skip the abandoned step. A hook before
the model's forward (``model(x)``; a loop that calls ``model.forward`` or submodules directly
never runs it) puts them back, zeroed, when every gradient is None. Gradients set to None at two
steps in a row (a loop that does it every step) end the buffer: re-assigning every ``.grad``
each step would cost more host time than the buffer saves.

What changes for the loop: every parameter that requires a gradient has one from ``attach`` on
(zeros until its first backward), so an optimizer steps a parameter that got no gradient with a
zero one (weight decay and momentum still apply), as under DDP's bucket views. Gradients present
at ``attach`` are copied into the buffer (for that moment the gradients' memory is held twice).
Not used (the norm reads each gradient, with a warning) for a model with sparse gradients
(``nn.Embedding(sparse=True)``) or a parameter whose layout has gaps or overlaps. One process
only: under ``torch.distributed`` DDP or FSDP own the gradients' layout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from itertools import repeat
from operator import attrgetter, is_
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = ["GradBuffer", "device_dtype_groups"]

log = logging.getLogger("fp8guard.agent")

_ALIGN_BYTES = 256
"""Each gradient's view starts on this boundary, as a fresh allocation of PyTorch's caching
allocator would (vectorized kernels, fused optimizers, check their operands' alignment)."""

_grad = attrgetter("grad")
_data_ptr = torch.Tensor.data_ptr

F = TypeVar("F", bound=Callable[..., Any])


def _disable_compile(fn: F) -> F:
    """Keep torch.compile from tracing the hook (it reads ``.grad`` and may assign it)."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


def device_dtype_groups(tensors: Iterable[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """The tensors' indices grouped by (device, dtype), in first-seen order: what one buffer, one
    table or one multi-tensor kernel can take together."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


def _dense(p: torch.Tensor) -> bool:
    """Whether ``p``'s strides lay its elements out without gaps or overlaps (in any dimension
    order), so a span of ``numel`` elements can hold a gradient with the parameter's strides."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(p.shape, p.stride(), strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _refusal(model: nn.Module, params: list[nn.Parameter]) -> str | None:
    """Why the buffer cannot hold these gradients, or None."""
    if any(getattr(m, "sparse", False) is True for m in model.modules()):
        return "the model has sparse gradients (a module with sparse=True); a buffer would make them dense"
    if any(p.grad is not None and (p.grad.is_sparse or p.grad.layout != torch.strided) for p in params):
        return "a gradient is not a dense strided tensor"
    odd = next((p for p in params if not _dense(p)), None)
    if odd is not None:
        return f"a parameter of shape {tuple(odd.shape)} has strides {odd.stride()} with gaps or overlaps"
    return None


class GradBuffer:
    """The gradients of ``params`` (those that require one) as views of flat device buffers."""

    def __init__(self, model: nn.Module, params: Iterable[nn.Parameter]) -> None:
        self._params = [p for p in params if p.requires_grad]
        self.buffers: list[torch.Tensor] = []
        self._views: list[torch.Tensor] = []
        self._ptrs: list[int] = []
        self.state = "adopted"
        """``adopted`` (the norm reads the buffers) or ``ended: <why>`` (it reads each gradient)."""
        self.full_checks = 0
        """Steps that walked every gradient (the first, and those whose version bump changed)."""
        self.readopted = 0
        """Times the views were put back after every gradient had been set to None."""
        self._bump = -1
        self._version = 0
        self._passed = False
        self._steps_since_readopt = 2
        self._hook: Any = None
        refusal = _refusal(model, self._params) if self._params else "the model has no parameter that needs a gradient"
        if refusal is not None:
            self._end(refusal)
            return
        self._build()
        self._assign(copy=True)
        self._hook = model.register_forward_pre_hook(_disable_compile(self._before_forward))

    @property
    def adopted(self) -> bool:
        return self.state == "adopted"

    def intact(self) -> bool:
        """Whether every gradient is still its view (read the buffers); ends the buffer if not."""
        if not self.adopted:
            return False
        version = self._version_now()
        bump = version - self._version
        self._version = version
        if bump > 0:  # something was written since the last check: a new step (not the norm asked twice)
            self._steps_since_readopt += 1
        first, last = self._params[0], self._params[-1]
        g0, g1 = first.grad, last.grad
        if g0 is self._views[0] and g1 is self._views[-1] and g0 is not None and g1 is not None \
                and g0.data_ptr() == self._ptrs[0] and g1.data_ptr() == self._ptrs[-1]:
            if bump == 0 and self._passed:
                return True  # nothing written since a check that passed (the norm asked twice in a step)
            if bump == self._bump:  # the loop's usual writes (never 0: only a bump > 0 is learned)
                return True
        self.full_checks += 1
        grads = list(map(_grad, self._params))
        if all(map(is_, grads, self._views)) and list(map(_data_ptr, grads)) == self._ptrs:
            self._passed = True
            if bump > 0:
                self._bump = bump
            return True
        self._end("a gradient is no longer the buffer's view (replaced, moved by .data = or model.to(), or set to "
                 "None outside the model's forward)")
        return False

    def norm(self) -> torch.Tensor:
        """The L2 norm of every gradient, as a 0-d float32 tensor on the first buffer's device."""
        norms: list[torch.Tensor] = [torch.linalg.vector_norm(b, dtype=torch.float32) for b in self.buffers]
        if len(norms) == 1:
            return norms[0]
        first = norms[0].device
        total: torch.Tensor = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]))
        return total

    def close(self) -> None:
        """Detach the hook; the gradients stay as they are (views, holding the buffers)."""
        if self.adopted:
            self._release("ended: closed")

    # -- internals -------------------------------------------------------------------------------

    def _end(self, why: str) -> None:
        """Stop using the buffers (gradients still pointing into them keep their values)."""
        self._release(f"ended: {why}")
        log.warning("fp8guard: gradient buffer given up: %s; the grad norm reads each gradient again, so "
                    "monitor.step's host time grows with depth", why)

    def _release(self, state: str) -> None:
        self.state = state
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.buffers, self._views, self._ptrs = [], [], []

    def _build(self) -> None:
        views: list[Any] = [None] * len(self._params)
        for (device, dtype), members in device_dtype_groups(self._params).items():
            align = max(1, _ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
            offsets, size = [], 0
            for i in members:
                offsets.append(size)
                size += -(-self._params[i].numel() // align) * align
            buf = torch.zeros(size, dtype=dtype, device=device)
            for i, at in zip(members, offsets, strict=True):
                p = self._params[i]
                views[i] = buf.as_strided(p.shape, p.stride(), at)
            self.buffers.append(buf)
        self._views = views
        self._ptrs = [v.data_ptr() for v in views]

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
        self._passed = False

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if self._params[0].grad is not None:
            return
        if not all(map(is_, map(_grad, self._params), repeat(None))):
            return  # only some gradients are None: the step's full check decides
        if self._steps_since_readopt <= 1:
            self._end("the gradients were set to None at two steps in a row (a loop that calls zero_grad() "
                     "with its default set_to_none=True); keep them with optimizer.zero_grad(set_to_none=False)")
            return
        for buf in self.buffers:
            buf.zero_()
        self._assign(copy=False)
        self.readopted += 1
        self._steps_since_readopt = 0
