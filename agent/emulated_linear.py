"""The emulated linear: :class:`Fp8EmulatedLinear` (a drop-in ``nn.Linear`` running TE's
DelayedScaling FP8 GEMMs on any device), its autograd function, and :func:`update_fp8_state`, the
batched scaling update that closes a step. :mod:`fp8guard.agent.emulation` swaps them into a model.

Numerics per emulated linear (same slot layout as TE):

* forward slots ``[input, weight, output]``, backward slots ``[grad_output, grad_input]``.
* forward: amax(input), amax(weight) are max-accumulated into history row 0, input and weight are
  cast to FP8 (E4M3) with the *current* scale, the GEMM runs on the dequantized values in float32
  and the bias is added in float32 (TE's GEMM accumulates in fp32 and adds bias in the epilogue).
* backward: amax(grad_output) is recorded, grad_output is cast (E5M2 for "hybrid", E4M3 for
  "e4m3"), dgrad/wgrad use the FP8 operands, the bias gradient uses the unquantized grad_output.
* the output and grad_input slots stay unused (TE without FP8 outputs): their history stays zero
  and their scale stays 1.

Nothing on the per-step path syncs with the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .fp8 import (
    AmaxComputeAlgo,
    Fp8Format,
    compute_scale,
    count_overflow_underflow,
    dequantize,
    nan_ignoring_amax,
    quantize,
    update_amax_history,
)

__all__ = ["BWD_SLOTS", "FWD_SLOTS", "Fp8EmulatedLinear", "update_fp8_state"]

FWD_SLOTS: tuple[str, ...] = ("input", "weight", "output")
"""Forward slot names, in buffer order (TE: GEMM1_INPUT, GEMM1_WEIGHT, GEMM1_OUTPUT)."""
BWD_SLOTS: tuple[str, ...] = ("grad_output", "grad_input")
"""Backward slot names, in buffer order (TE: GRAD_OUTPUT1, GRAD_INPUT1)."""

_FP8_BUFFERS = ("fp8_scale_fwd", "fp8_amax_history_fwd", "fp8_scale_bwd", "fp8_amax_history_bwd")


class _Fp8LinearFn(torch.autograd.Function):
    """Emulated FP8 GEMMs of one linear; the module carries the FP8 metadata buffers."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        module: Fp8EmulatedLinear,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        fmt = module.fwd_format
        # Copies, not views: the backward must dequantize with the scales used here even if
        # update() runs in between (TE saves scale_inv with the FP8 tensors for the same reason).
        s_x = module.fp8_scale_fwd[0].clone()
        s_w = module.fp8_scale_fwd[1].clone()
        with torch.no_grad():
            row0 = module.fp8_amax_history_fwd[0, :2]
            amax = torch.stack((nan_ignoring_amax(x), nan_ignoring_amax(weight)))
            # Max-accumulate like TE's atomicMax, so repeated forwards within a step (gradient
            # checkpointing, several micro-batches) keep the largest value.
            row0.copy_(torch.maximum(row0, amax))
            if module.collect_counts:
                counts = torch.stack(
                    (count_overflow_underflow(x, s_x, fmt), count_overflow_underflow(weight, s_w, fmt))
                )
                module.fp8_counts_fwd[:2].add_(counts)
            xq = quantize(x, s_x, fmt)
            wq = quantize(weight, s_w, fmt)
        with torch.autocast(x.device.type, enabled=False):
            out = F.linear(dequantize(xq, s_x), dequantize(wq, s_w))
            if bias is not None:
                out = out + bias.to(torch.float32)
        # Keep the FP8 operands (1 byte/elem) like TE, not the dequantized float32 copies.
        ctx.save_for_backward(xq, wq, s_x, s_w)
        ctx.module = module
        ctx.x_dtype = x.dtype
        ctx.has_bias = bias is not None
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xq, wq, s_x, s_w = ctx.saved_tensors
        module: Fp8EmulatedLinear = ctx.module
        fmt = module.bwd_format
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        with torch.no_grad(), torch.autocast(grad_out.device.type, enabled=False):
            s_g = module.fp8_scale_bwd[0].clone()
            slot = module.fp8_amax_history_bwd[0, :1]
            slot.copy_(torch.maximum(slot, nan_ignoring_amax(grad_out).reshape(1)))
            if module.collect_counts:
                module.fp8_counts_bwd[0].add_(count_overflow_underflow(grad_out, s_g, fmt))
            g = dequantize(quantize(grad_out, s_g, fmt), s_g)
            grad_x = grad_w = grad_b = None
            if need_x:
                grad_x = (g @ dequantize(wq, s_w)).to(ctx.x_dtype)
            if need_w:
                g2 = g.reshape(-1, g.shape[-1])
                x2 = dequantize(xq, s_x).reshape(-1, xq.shape[-1])
                grad_w = (g2.t() @ x2).to(module.weight.dtype)
            if need_b and ctx.has_bias:
                # TE computes the bias gradient from the high-precision grad_output.
                gb = grad_out.to(torch.float32).reshape(-1, grad_out.shape[-1]).sum(0)
                grad_b = gb.to(cast(torch.Tensor, module.bias).dtype)
        return grad_x, grad_w, grad_b, None, None


class Fp8EmulatedLinear(nn.Module):
    """Drop-in replacement for an ``nn.Linear`` that emulates TE's DelayedScaling FP8 GEMMs.

    The wrapped linear's ``weight``/``bias`` Parameter objects are reused, so optimizers built
    before the swap keep working and ``state_dict`` keeps the keys ``weight`` and ``bias``, plus the
    FP8 metadata buffers ``fp8_scale_fwd`` [3], ``fp8_amax_history_fwd`` [L, 3], ``fp8_scale_bwd``
    [2], ``fp8_amax_history_bwd`` [L, 2]. Loading a state_dict without the FP8 buffers (e.g. a
    plain nn.Linear checkpoint) leaves the current FP8 state untouched instead of failing.

    Attributes ``fp8_enabled`` (False: plain high-precision ``F.linear``, no casts, no amax) and
    ``collect_counts`` (True: accumulate exact overflow/underflow counts per slot into the
    non-persistent int64 buffers ``fp8_counts_fwd`` [3, 2] and ``fp8_counts_bwd`` [2, 2], columns
    ``[overflow, underflow]``) are plain Python bools, read without touching the device.
    """

    fp8_scale_fwd: torch.Tensor
    fp8_amax_history_fwd: torch.Tensor
    fp8_scale_bwd: torch.Tensor
    fp8_amax_history_bwd: torch.Tensor
    fp8_counts_fwd: torch.Tensor
    fp8_counts_bwd: torch.Tensor
    _fp8_last_amax_fwd: torch.Tensor
    _fp8_last_amax_bwd: torch.Tensor
    bias: nn.Parameter | None

    def __init__(
        self,
        linear: nn.Linear,
        *,
        amax_history_len: int = 1024,
        fwd_format: Fp8Format = Fp8Format.E4M3,
        bwd_format: Fp8Format = Fp8Format.E5M2,
        margin: int = 0,
        amax_compute_algo: AmaxComputeAlgo = "max",
    ) -> None:
        super().__init__()
        if amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {amax_history_len}")
        self.margin = margin
        self.amax_compute_algo: AmaxComputeAlgo = amax_compute_algo
        self.fp8_forwards = 0
        """Training forwards in FP8 since the last scale update (a host counter, no device work):
        nonzero means this step is still open (:func:`update_fp8_state` closes it)."""
        self.fp8_forwards_total = 0
        """Training forwards in FP8 since construction (telemetry's "does it run at all" check)."""
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # Same Parameter objects, not copies: optimizer param groups and tied weights stay valid.
        self.weight = linear.weight
        self.bias = linear.bias
        self.fwd_format = Fp8Format(fwd_format)
        self.bwd_format = Fp8Format(bwd_format)
        self.fp8_enabled = True
        self.collect_counts = False
        kw: dict[str, Any] = {"device": linear.weight.device, "dtype": torch.float32}
        nf, nb = len(FWD_SLOTS), len(BWD_SLOTS)
        self.register_buffer("fp8_scale_fwd", torch.ones(nf, **kw))
        self.register_buffer("fp8_amax_history_fwd", torch.zeros(amax_history_len, nf, **kw))
        self.register_buffer("fp8_scale_bwd", torch.ones(nb, **kw))
        self.register_buffer("fp8_amax_history_bwd", torch.zeros(amax_history_len, nb, **kw))
        ckw: dict[str, Any] = {"device": linear.weight.device, "dtype": torch.int64}
        # Telemetry accumulators and the L == 1 last-amax copy are not model state: non-persistent.
        self.register_buffer("fp8_counts_fwd", torch.zeros(nf, 2, **ckw), persistent=False)
        self.register_buffer("fp8_counts_bwd", torch.zeros(nb, 2, **ckw), persistent=False)
        self.register_buffer("_fp8_last_amax_fwd", torch.zeros(nf, **kw), persistent=False)
        self.register_buffer("_fp8_last_amax_bwd", torch.zeros(nb, **kw), persistent=False)

    # -- accessors used by telemetry -------------------------------------------------------------
    @property
    def amax_history_fwd(self) -> torch.Tensor:
        """Forward amax history buffer [L, 3]; row 0 is this step's staging row."""
        return self.fp8_amax_history_fwd

    @property
    def amax_history_bwd(self) -> torch.Tensor:
        """Backward amax history buffer [L, 2]; row 0 is this step's staging row."""
        return self.fp8_amax_history_bwd

    @property
    def scale_fwd(self) -> torch.Tensor:
        """Forward scales [3] (input, weight, output)."""
        return self.fp8_scale_fwd

    @property
    def scale_bwd(self) -> torch.Tensor:
        """Backward scales [2] (grad_output, grad_input)."""
        return self.fp8_scale_bwd

    @property
    def last_amax_fwd(self) -> torch.Tensor:
        """Amax of the latest completed step [3]: history row -1 after the roll."""
        # With L == 1 the roll zeroes the only row, so update() keeps a copy aside.
        h = self.fp8_amax_history_fwd
        return h[-1] if h.shape[0] > 1 else self._fp8_last_amax_fwd

    @property
    def last_amax_bwd(self) -> torch.Tensor:
        """Amax of the latest completed step [2]: history row -1 after the roll."""
        h = self.fp8_amax_history_bwd
        return h[-1] if h.shape[0] > 1 else self._fp8_last_amax_bwd

    # -- state management ------------------------------------------------------------------------
    @torch.no_grad()
    def reset_fp8_state(self) -> None:
        """Zero the amax histories and set all scales to 1 (TE's initial state)."""
        self.fp8_amax_history_fwd.zero_()
        self.fp8_amax_history_bwd.zero_()
        self.fp8_scale_fwd.fill_(1.0)
        self.fp8_scale_bwd.fill_(1.0)
        self._fp8_last_amax_fwd.zero_()
        self._fp8_last_amax_bwd.zero_()

    @torch.no_grad()
    def reset_counts(self) -> None:
        """Zero the overflow/underflow accumulators."""
        self.fp8_counts_fwd.zero_()
        self.fp8_counts_bwd.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled:
            return F.linear(x, self.weight, self.bias)
        if torch.is_grad_enabled():  # a training forward (not a no-grad probe or evaluation)
            self.fp8_forwards += 1
            self.fp8_forwards_total += 1
        out_dtype = x.dtype
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            # Mirror nn.Linear under autocast: the activation runs in the autocast dtype.
            out_dtype = torch.get_autocast_dtype(dev)
            x = x.to(out_dtype)
        out = _Fp8LinearFn.apply(x, self.weight, self.bias, self, out_dtype)  # type: ignore[no-untyped-call]
        return cast(torch.Tensor, out)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Fp8EmulatedLinear:
        # model.to(torch.bfloat16) / .half() would also cast the FP8 metadata; TE keeps it in float32
        # whatever the parameter dtype. Keep the exact float32 values and only follow device moves.
        keep = {n: b for n, b in self._buffers.items() if b is not None and b.dtype == torch.float32}
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        for name, old in keep.items():
            new = self._buffers[name]
            if new is not None and new.dtype != torch.float32:
                self._buffers[name] = old.to(device=new.device)
        return self

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        # A checkpoint of the un-emulated model has no FP8 metadata; keep ours rather than fail.
        absent = {prefix + name for name in _FP8_BUFFERS} - state_dict.keys()
        missing_keys[:] = [k for k in missing_keys if k not in absent]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, fwd={self.fwd_format.value}, bwd={self.bwd_format.value}, "
            f"history={self.fp8_amax_history_fwd.shape[0]}, fp8_enabled={self.fp8_enabled}"
        )


@torch.no_grad()
def update_fp8_state(modules: Iterable[Fp8EmulatedLinear]) -> None:
    """:meth:`Fp8Emulation.update` for any emulated linears (each with its own formats, margin
    and amax algorithm): reduce histories, recompute scales, roll; modules in high precision are
    skipped. Resets each module's ``fp8_forwards``. Device work only, batched per group."""
    groups: dict[tuple[Any, ...], list[Fp8EmulatedLinear]] = {}
    for m in modules:
        if not m.fp8_enabled:
            continue
        m.fp8_forwards = 0
        key = (m.fp8_scale_fwd.device, m.fp8_amax_history_fwd.shape[0], m.fwd_format, m.bwd_format,
               m.amax_compute_algo, m.margin)
        groups.setdefault(key, []).append(m)
    for mods in groups.values():
        first = mods[0]
        _update_group(mods, "fwd", first.fwd_format.fp8_max, first.amax_compute_algo, first.margin)
        _update_group(mods, "bwd", first.bwd_format.fp8_max, first.amax_compute_algo, first.margin)


def _update_group(mods: list[Fp8EmulatedLinear], direction: str, fp8_max: float, algo: AmaxComputeAlgo,
                  margin: int) -> None:
    hists = [cast(torch.Tensor, getattr(m, f"fp8_amax_history_{direction}")) for m in mods]
    scales = [cast(torch.Tensor, getattr(m, f"fp8_scale_{direction}")) for m in mods]
    # One [L, sum(slots)] history for the whole group: a handful of kernels instead of a handful
    # per module; the results are scattered back with one copy per buffer.
    history = torch.cat(hists, dim=1)
    amax = update_amax_history(history, algo)
    new_scale = compute_scale(amax, torch.cat(scales), fp8_max, margin)
    widths = [s.numel() for s in scales]
    single_row = history.shape[0] == 1
    for m, h, s, h_new, s_new, a in zip(
        mods,
        hists,
        scales,
        torch.split(history, widths, dim=1),
        torch.split(new_scale, widths),
        torch.split(amax, widths),
        strict=True,
    ):
        h.copy_(h_new)
        s.copy_(s_new)
        if single_row:
            # With one row the roll zeroes it; "max" and "most_recent" both equal that row.
            cast(torch.Tensor, getattr(m, f"_fp8_last_amax_{direction}")).copy_(a)
