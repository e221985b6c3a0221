"""Module hooks on Transformer Engine modules: the operands a hook can reach, measured and counted.

Under current and block scaling nothing persists in TE, so the hooks measure the amax of the
operands reachable from module hooks (forward pre-hook: the input of ``te.Linear`` and the
weights of every module; a tensor hook on the module output: the grad_output of its last GEMM)
with TE's own amax kernel into a device buffer, max-accumulated over micro-batches until read.
Under any supported recipe they can also count exact overflows/underflows of those operands
(``exact_counts="hooks"``), with the scale the cast uses (given by the recipe family).

Hooks observe only FP8 forwards with grad enabled (not eval passes, not BF16-fallback regions,
not TE activation-recompute passes). Nothing here syncs with the host.

The same pre-hooks also *watch* (:meth:`HookObserver.watch`): they note the first forward of a
watched module under TE's FP8 autocast (a host bool, no device work), and the watch ends there
(:mod:`~fp8guard.agent.sources.te_stale` asks whether one came). One forward pre-hook per module
serves all three purposes; hooks are present only while one of them wants them (:meth:`sync`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fp8guard.agent.fp8 import count_overflow_underflow, nan_ignoring_amax
from fp8guard.agent.sources.te_access import TEApi
from fp8guard.agent.sources.te_layout import Column, weights_of

__all__ = ["HookObserver"]

_AMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

ScaleOf = Callable[[Column, "torch.Tensor | None"], torch.Tensor]
"""The scale a cast of a column uses, given the amax just measured (None when not measured)."""


class HookObserver:
    """Device buffers filled by module hooks: ``amax`` (``[n]``) and ``counts`` (``[n, 2]``)."""

    def __init__(self, te: TEApi, columns: Sequence[Column], device: torch.device, *, measure: bool,
                 scale_of: ScaleOf) -> None:
        n = len(columns)
        self._te = te
        self._columns = columns
        self._scale_of = scale_of
        self.amax = torch.zeros(n, dtype=torch.float32, device=device)
        self.counts = torch.zeros(n, 2, dtype=torch.int64, device=device)
        self.measure = measure
        """Measure amaxes (current/block scaling); False: hooks only count when armed."""
        self.counting = False
        self.watching = False
        """Watch the modules given to :meth:`watch` for a forward under TE's FP8 autocast."""
        self.fp8_seen = False
        """A watched module ran a forward under TE's FP8 autocast while watched."""
        self._watched: list[nn.Module] = []
        self._installed: tuple[bool, bool] | None = None
        """(observing, watching) the present hooks were registered for."""
        self._seen = [0] * n
        """Per column: the read generation of its last measured cast (``_generation``: this one)."""
        self._generation = 1
        self._handles: list[Any] = []

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def sync(self) -> None:
        """Hooks present exactly while wanted: measuring, counting or watching (idempotent)."""
        plan = (self.measure or self.counting, self.watching)
        if self._installed == plan:
            return
        self.uninstall()
        if any(plan):
            self._install(*plan)

    def watch(self, modules: Sequence[nn.Module]) -> None:
        """Start watching ``modules`` for a forward under TE's FP8 autocast (``fp8_seen``)."""
        self._watched = list(modules)
        self.watching = True
        self.sync()

    def unwatch(self) -> None:
        """Stop watching (the watching hooks go unless measuring or counting needs them)."""
        if self.watching:
            self.watching = False
            self.sync()

    def _install(self, observing: bool, watching: bool) -> None:
        plans: dict[int, tuple[nn.Module, list[Column]]] = {}
        if observing:
            for c in self._columns:
                if c.hooked:
                    plans.setdefault(id(c.module), (c.module, []))[1].append(c)
        watched = {id(m) for m in self._watched} if watching else set()
        for m in self._watched if watching else ():
            plans.setdefault(id(m), (m, []))
        for module, cols in plans.values():
            kind = cols[0].kind if cols else ""
            inp = next((c for c in cols if c.side == "fwd" and c.slot % 3 == 0), None)
            weights = [(c, c.slot // 3) for c in cols if c.side == "fwd" and c.slot % 3 == 1]
            grad = next((c for c in cols if c.side == "bwd"), None)
            if inp is not None or weights or id(module) in watched:
                self._handles.append(module.register_forward_pre_hook(
                    self._pre_hook(kind, inp, weights, watch=id(module) in watched), with_kwargs=True))
            if grad is not None:
                self._handles.append(module.register_forward_hook(self._output_hook(grad)))
        self._installed = (observing, watching)

    def consumed(self) -> None:
        """The amaxes were read: the next cast of every operand starts a new accumulation."""
        self.amax.zero_()
        self._generation += 1  # every column unseen at once, with no walk over them

    def uninstall(self) -> None:
        """Remove the module hooks (a forward then runs no code of this observer)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._installed = None

    def remove(self) -> None:
        self.measure = self.counting = self.watching = False
        self.uninstall()

    # -- hooks (run inside the user's forward/backward) -------------------------------------------

    def _observing(self) -> bool:
        if not (self.measure or self.counting) or not torch.is_grad_enabled():
            return False
        return bool(self._te.fp8_enabled()) and not self._te.recompute_phase()

    def _pre_hook(self, kind: str, inp: Column | None, weights: list[tuple[Column, int]], *,
                  watch: bool) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if watch and self.watching and self._te.fp8_enabled():
                # The watch ends at its first FP8 forward: the hooks are registered again without
                # it (this call goes on; the modules after it run the new ones).
                self.fp8_seen = True
                self.unwatch()
            if not self._observing():
                return
            if inp is not None:
                self._observe(inp, [args[0] if args else kwargs.get("inp")])
            for col, gemm in weights:
                self._observe(col, weights_of(module, kind, gemm))
        return hook

    def _output_hook(self, col: Column) -> Callable[..., None]:
        def grad_hook(grad: torch.Tensor) -> None:
            self._observe(col, [grad])

        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not self._observing():
                return
            out = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(out, torch.Tensor) and out.requires_grad:
                tensor: Any = out  # torch types register_hook loosely
                tensor.register_hook(grad_hook)  # the grad of the module output is its last GEMM's grad_output
        return hook

    def _amax_into(self, x: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst[0] = amax(x)`` with the kernel TE's own casts use (NaN skipped, inf kept)."""
        if self._te.compute_amax is not None and x.is_cuda and x.dtype in _AMAX_DTYPES:
            self._te.compute_amax(x, dst)
        else:
            dst.copy_(nan_ignoring_amax(x).reshape(1))

    def _amax_of(self, xs: list[torch.Tensor]) -> torch.Tensor:
        amax: torch.Tensor | None = None
        for x in xs:
            a = torch.zeros(1, dtype=torch.float32, device=x.device)
            self._amax_into(x, a)
            amax = a if amax is None else torch.maximum(amax, a)
        assert amax is not None
        return amax

    def _observe(self, col: Column, tensors: Sequence[Any]) -> None:
        xs = [t.detach() for t in tensors
              if isinstance(t, torch.Tensor) and not isinstance(t, self._te.quantized) and t.numel() > 0]
        if not xs:
            return
        i = col.index
        amax: torch.Tensor | None = None
        if self.measure:
            acc = self.amax[i:i + 1]
            if len(xs) == 1 and self._seen[i] != self._generation:
                # First cast of this operand since the last read: TE's amax kernel writes straight
                # into the accumulator (zeroed at read), two launches per operand and step.
                self._amax_into(xs[0], acc)
                amax = acc
            else:  # later micro-batches, split weights: max-accumulate
                amax = self._amax_of(xs)
                torch.maximum(acc, amax, out=acc)
            self._seen[i] = self._generation
        if not self.counting:
            return
        scale = self._scale_of(col, amax)
        for x in xs:
            self.counts[i].add_(count_overflow_underflow(x, scale, col.fmt))
