"""Which of Transformer Engine's casts fp8guard counts at which step, and their counting: the
counter behind the ``Fp8GuardCounts`` feature of TE's tensor-inspection API
(:mod:`fp8guard.agent.sources.te_inspect` registers the feature and runs the debug session; this
module never imports ``nvdlfw_inspect``).

For each cast TE hands over, :class:`InspectCounts` enqueues a fused counting kernel (several
casts to a launch by default: ``Launches`` below) that adds the exact overflow and underflow counts
(TE's ``LogFp8TensorStats`` definitions) into the source's device buffer. No host sync, none of
TE's stats buffers (which sync on every feed).

Which kernel variant (:attr:`InspectCounts.variant`): the FP8-bytes one by default, the
fastest exact one measured. It reads the cast's own bytes (1 byte per element) and fetches the
high-precision value only for rows holding a 0 or maximum byte, so it needs no scale and cannot
read a stale one. On the H200 (2026-12-02, ``bench/gpu_counts.py kernels``/``time``,
docs/gpu.md) it counted the 604M model's 144 operands in 9.7 ms of GPU time against 13.4 ms for
the high-precision variant, whose float32 values and TE threshold are now formed from bits (so no
flush-to-zero path decides a subnormal: exact, but compute-heavier than its earlier 5.4 ms form).
Both agreed with TE on every operand. The high-precision variant (``x * quantizer.scale``, exact
because it is enqueued right after the cast, before TE updates the scale in place) is used where
the cast exposes no element-for-element bytes.

Cost model: on the iterations it counts, TE runs its debug path for the layer (unfused
LayerNorm+cast and activation+cast, as for any inspection feature); on the others
``inspect_tensor_enabled`` tells TE when counting comes next, so the layers take TE's normal
fused path and nothing is even constructed (TE: "the layer runs at normal speed").

Launches: up to ``count_batch.OPERANDS_PER_LAUNCH`` (8) operands of one format a launch
(:class:`~fp8guard.agent.kernels.count_batch.CountBatch`; :meth:`InspectCounts.use_batch` says when
the held operands are counted), about 42 launches a counted step of the 604M model instead of 144;
with it set to 0, one launch per operand as TE hands it over.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fp8guard.agent.fp8 import Fp8Format
from fp8guard.agent.kernels import count_batch, count_cast_into
from fp8guard.agent.source_steps import first_whole_window_end

__all__ = ["InspectCounts"]

log = logging.getLogger("fp8guard.agent")

_FORWARD_TENSORS = frozenset({"activation", "weight"})
"""The tensors a step casts in its forward: one TE hands over again inside a backward (an
activation recomputed under checkpointing, Linear's ``save_original_input``, a weight
re-quantized for FSDP) is the same cast again, not another one."""


@dataclass(frozen=True, slots=True)
class _Target:
    index: int
    fmt: Fp8Format


class InspectCounts:
    """Routes TE's ``inspect_tensor`` calls into a ``[n, 2]`` int64 device count buffer.

    ``targets`` maps (TE layer name, TE tensor name) to the column. The schedule is plain state:
    :meth:`enabled` answers TE's routing question for an iteration from ``armed``, ``every``
    and whether fp8guard owns the iteration numbering.
    """

    def __init__(self, targets: Mapping[tuple[str, str], tuple[int, Fp8Format]], counts: torch.Tensor) -> None:
        self.targets = {k: _Target(i, f) for k, (i, f) in targets.items()}
        self.counts = counts
        self.armed = False
        self.every = 0
        """Count every this many steps (0: never): lets TE skip its debug path in between."""
        self.owning = False
        """Whether fp8guard opened the debug session and sets its iteration to the step."""
        self.active = True
        self.calls = 0
        """inspect_tensor calls that counted something (a host-side tally, for tests and benches)."""
        self.repeats = 0
        """Forward casts handed over again inside a backward, not counted (see :meth:`inspect`)."""
        self.high_precision: frozenset[str] = frozenset()
        """TE layer names whose module runs in high precision (fp8guard's BF16 fallback, or a
        probe's plan): never counted, so TE keeps them off its debug path. There is nothing to
        count (no FP8 cast), and TE 2.20.2's debug path does not cast a high-precision GEMM's
        input to torch autocast's dtype: on the H200 cuBLAS refused a BF16 weight with a float32
        input (``Input matrices types mismatch``) at the first counted step after a fallback."""
        self.variant = "auto"
        """``auto``: the FP8-bytes kernel where the cast has element-for-element bytes, else the
        high-precision kernel; ``hp`` or ``bytes`` force one (a forced variant that lacks its input
        falls back to the other)."""
        self._rows: list[torch.Tensor] = []
        self._rows_of: torch.Tensor | None = None
        self.stagger_from: int | None = None
        """Staggered counting (``MonitorConfig.count_stagger``; fp8guard owns the iteration
        numbering): the step the schedule started from. Each TE module is then counted once in
        every window of ``every`` steps that ends at a multiple of ``every`` (where the Monitor
        reads the counts), at its own step: ``module index mod every`` steps before the window's
        end, so a counted window's debug-path work is spread over its steps instead of falling on
        one. Only whole windows after ``stagger_from`` count. None: every module at the multiples."""
        self.held = False
        """Counting paused (a probe's forwards inside a step are not the step's casts): staggered
        counting's schedule does not read ``armed``, so the probe holds it with this."""
        self.module_of: dict[str, int] = {}
        """TE layer name -> the index of the TE module it belongs to (a LayerNormMLP's two GEMMs
        share one: TE takes its debug path per module)."""
        self.modules: list[torch.nn.Module] = []
        """The TE modules counted (the source sets them): with a batch, each one's forward end
        counts what its forward handed over (:meth:`use_batch`)."""
        self.batch: count_batch.CountBatch | None = None
        """Operands counted several to a launch (:meth:`use_batch`), or None: one launch each."""
        self._flushes_at: int | None = None
        """The autograd graph task whose end flushes the batch (one callback per backward)."""
        self.step: int | None = None
        """The step about to run (the source sets it before each step; TE's debug iteration when
        fp8guard owns the session): which modules the staggered schedule counts, hence hooks."""
        self._module_hooks: dict[int, Any] = {}
        """Module index -> its forward hook's handle, on the modules whose casts this step counts."""

    def use_batch(self, batch: count_batch.CountBatch | None) -> None:
        """Count operands several to a launch with ``batch`` (None: one launch each, no hooks).

        What the batch holds is counted at the latest at: the end of the forward of the module
        that handed it over (a forward hook on each of :attr:`modules`: TE drops a forward cast's
        FP8 bytes there, FSDP may free a gathered weight right after, and an optimizer may change
        a weight in place once the backward is done), the end of the backward that handed over a
        gradient (an autograd engine callback; gradients are fresh tensors nobody writes), and
        whenever the source reads the counts or a step starts (:meth:`flush`). The hooks are on
        the modules this step counts alone (:meth:`sync_hooks`), so no other forward runs any
        per-module code."""
        self.flush()
        self.batch = batch
        self.sync_hooks()

    def sync_hooks(self) -> None:
        """Forward hooks on exactly the modules whose casts the step about to run counts (with a
        batch; none without): all of them while counting is armed, under staggered counting
        those due at :attr:`step`. Call when the step, the schedule or ``armed`` changes."""
        due = range(0)
        if self.batch is not None and self.active:
            if self.staggered and self.step is not None:
                # the modules whose phase (index mod every) counts at this step, as _due answers
                # for each: phase == -step mod every, once the first whole window has begun
                assert self.stagger_from is not None
                every, step = self.every, self.step
                phase = -step % every
                if step + phase >= first_whole_window_end(self.stagger_from, every):
                    due = range(phase, len(self.modules), every)
            elif self.armed:
                due = range(len(self.modules))
        keep = set(due)
        for i in [i for i in self._module_hooks if i not in keep]:
            self._module_hooks.pop(i).remove()
        for i in keep:
            if i not in self._module_hooks:
                # first among the module's forward hooks: FSDP2 frees a gathered weight's storage
                # in place (resize to 0) in a forward hook registered when the model was wrapped,
                # which holding a reference does not stop; the batch must count it before that
                self._module_hooks[i] = self.modules[i].register_forward_hook(self._module_done, always_call=True,
                                                                               prepend=True)

    def _module_done(self, module: Any, args: Any, output: Any) -> None:
        if self.batch is not None and len(self.batch):
            self.flush()

    def enabled(self, iteration: int, layer_name: str, tensor_name: str) -> tuple[bool, int | None]:
        """(count on this iteration, next iteration TE must ask again; None: never)."""
        if not self.active or (layer_name, tensor_name) not in self.targets:
            return False, None
        if not self.owning:
            nxt: int | None = iteration + 1
        elif self.every <= 0:
            nxt = (iteration + 1) if self.armed else None
        elif self.staggered:
            due, nxt = self._staggered(iteration, layer_name)
            return due and not self.held and layer_name not in self.high_precision, nxt
        else:
            nxt = (iteration // self.every + 1) * self.every
        return self.armed and layer_name not in self.high_precision, nxt

    @property
    def staggered(self) -> bool:
        return self.stagger_from is not None and self.owning and self.every > 1

    def _staggered(self, iteration: int, layer_name: str) -> tuple[bool, int]:
        """(this layer counts at ``iteration``, the next iteration it counts at)."""
        return self._due(iteration, self.module_of.get(layer_name, 0) % self.every)

    def _due(self, iteration: int, phase: int) -> tuple[bool, int]:
        """(a module of this phase counts at ``iteration``, the next iteration it counts at)."""
        assert self.stagger_from is not None
        every = self.every
        first = first_whole_window_end(self.stagger_from, every)
        due = (iteration + phase) % every == 0 and iteration + phase >= first
        nxt = iteration + 1 + (-(iteration + 1 + phase)) % every
        return due, max(nxt, first - phase)

    def inspect(self, layer_name: str, tensor_name: str, tensor: torch.Tensor | None, quantized: Any,
                quantizer: Any, iteration: int | None = None) -> None:
        """Count one cast; skips what it cannot count exactly (FP8 primary weights, block scaling)."""
        if not self.active or tensor is None:
            return  # tensor is None for FP8 primary weights: no high-precision values exist
        if self.staggered:
            if self.held or iteration is None or not self._staggered(iteration, layer_name)[0]:
                return
        elif not self.armed:
            return
        target = self.targets.get((layer_name, tensor_name))
        if target is None:
            return
        task = torch._C._current_graph_task_id()
        if tensor_name in _FORWARD_TENSORS and task != -1:
            # A forward cast inside the autograd engine: activation checkpointing's recompute
            # (TE's, torch's, LayerNormMLP(checkpoint=True)), Linear's save_original_input cast
            # for wgrad, a weight re-quantized in backward. TE passes no marker (the same
            # iteration, the same arguments); the forward already counted these values.
            if not self.repeats:
                log.info("fp8guard: TE handed forward casts over again inside a backward (activation "
                         "recompute, save_original_input): not counted twice")
            self.repeats += 1
            return
        scale_inv = getattr(quantized, "_scale_inv", None)
        if not isinstance(scale_inv, torch.Tensor):
            return  # not a per-tensor FP8 cast (high-precision GEMM, block scaling)
        data = getattr(quantized, "_data", None)
        if not isinstance(data, torch.Tensor) or data.numel() != tensor.numel():
            data = None  # not the element-for-element rowwise bytes: count from the values instead
        scale = getattr(quantizer, "scale", None)
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
            scale = None
        if data is None and scale is None:
            # Neither the cast's bytes nor its scale: 1/scale_inv is not always the scale (one
            # rounding each way), so a count from it would not be exact. Not counted.
            return
        use_bytes = data is not None and (scale is None or self.variant != "hp")
        fmt = _format_of(quantized, target.fmt, quantizer)
        if self.batch is not None and use_bytes and data is not None:
            if task != -1 and task != self._flushes_at:
                self._flush_at_backward_end(task)
            self.batch.add(self._row(target.index), tensor.detach(), scale=scale if scale is not None else scale_inv,
                           scale_inv=scale_inv, fmt=fmt, fp8_bytes=data)
        else:
            count_cast_into(self._row(target.index), tensor.detach(),
                            scale=scale if scale is not None else scale_inv, scale_inv=scale_inv,
                            fmt=fmt, fp8_bytes=data if use_bytes else None)
        self.calls += 1

    def flush(self) -> None:
        """Enqueue the counting of every operand the batch holds (nothing without a batch)."""
        if self.batch is None or not len(self.batch):
            return
        try:
            self.batch.flush()
        except Exception:  # monitoring never takes training down
            self.active = False
            self.batch.drop()
            log.exception("fp8guard: exact counting failed and is now off; training continues")

    def drop(self) -> None:
        """Forget the operands the batch holds, uncounted (their window was abandoned)."""
        if self.batch is not None:
            self.batch.drop()

    def _flush_at_backward_end(self, task: int) -> None:
        """A backward's first held gradient: count what the batch holds when that backward ends."""
        self._flushes_at = task
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        except RuntimeError:  # not inside the engine after all: the next flush point counts them
            self._flushes_at = None

    def _backward_done(self) -> None:
        self._flushes_at = None
        self.flush()

    def _row(self, index: int) -> torch.Tensor:
        """``counts[index]``: the views are made once per count buffer (a step indexes the buffer
        once per operand: 144 views per counted step of the 604M model)."""
        if self._rows_of is not self.counts:
            self._rows = list(self.counts.unbind(0))
            self._rows_of = self.counts
        return self._rows[index]


def _format_of(quantized: Any, default: Fp8Format, quantizer: Any = None) -> Fp8Format:
    """The format the cast used: the quantizer's ``dtype`` (TE's ``tex.DType``), else the cast
    tensor's ``_fp8_dtype``, else ``default``: the layout's format for the operand (E5M2 for
    HYBRID's gradients). On the H200 with TE 2.20.2 (2026-12-02) neither attribute named E5M2 on
    the backward gradients as read here: ``bench/gpu_counts.py verify``, defaulting to E4M3, counted
    their E5M2 bytes against E4M3's range, while this feature, defaulting to the layout's E5M2,
    equalled TE on every operand. The layout's default is what makes it right there."""
    for name in (str(getattr(quantizer, "dtype", "")), str(getattr(quantized, "_fp8_dtype", ""))):
        if "E4M3" in name:
            return Fp8Format.E4M3
        if "E5M2" in name:
            return Fp8Format.E5M2
    return default
