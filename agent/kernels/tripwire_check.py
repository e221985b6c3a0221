"""The tripwire's per-step check (:class:`fp8guard.agent.tripwire.Tripwire`) in one Triton launch.

The torch path of the check is some forty ops on a 2-vector (loss, gradient norm) and four for
the saturation ratios, each a kernel launch on a GPU: about 1 ms of host time per step on the
H200's host (bench/gpu_host_cost.py), whatever the model. This kernel does the same arithmetic
in one program: it reads the loss and the gradient norm (either may be missing), the saturation
ratios (or none), updates the state in place (checks counted into the baseline, the baseline
averages, the early references, the early runs) and writes the verdict word. Every float
operation is the torch path's, in the same order and in float32, with fused multiply-adds off
(``enable_fp_fusion=False``: torch rounds every product), so the state and the verdict are the
torch path's bit for bit; tests/agent/test_tripwire_kernel.py holds it to that under Triton's
CPU interpreter, the GPU test on CUDA.

Layouts (float32, built by the tripwire once): ``state`` is ``[4, 2]`` (rows: checks counted,
baseline, early reference, early run; columns: loss, gradient norm) and ``params`` is
:data:`PARAMS` long.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fp8guard.agent.kernels._launch import (
    CompiledLaunch,
    device_index,
    interpret,
    specialization_key,
    triton_modules,
)

__all__ = ["INPUT_DTYPES", "PARAMS", "TripwireCheck"]

PARAMS = ("loss_factor", "grad_factor", "early_mul_loss", "early_grad_factor", "early_loss_rise",
          "early_abs_grad", "warmup_steps", "early_steps", "ema", "saturation")
"""The float32 constants the kernel reads, in order (the torch path's 2-vectors are views of
the first six: factors, early multipliers, early absolute terms)."""
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Loss and gradient-norm dtypes the kernel reads (exactly converted to float32, as the torch
path's copy does); the saturation ratios must be float32 (the torch path compares in their dtype)."""
_SAT_BLOCK = 1024
"""Saturation ratios per loop iteration of the single program."""


@functools.cache
def _kernel() -> Any:
    """The compiled check kernel, or None when Triton cannot be imported."""
    if triton_modules() is None:
        return None
    import triton
    import triton.language as tl

    # Addresses and the ratio count are not specialised on: one compiled variant per combination
    # of inputs present (and their dtypes) and loop length, whichever ring slot the loss sits in.
    @triton.jit(do_not_specialize=["n_sat"],  # type: ignore[untyped-decorator, unused-ignore]
                do_not_specialize_on_alignment=["loss_ptr", "norm_ptr", "sat_ptr", "state_ptr", "params_ptr",
                                                "bits_ptr"])
    def tripwire_check_kernel(loss_ptr, norm_ptr, sat_ptr, state_ptr, params_ptr, bits_ptr, n_sat,  # type: ignore[no-untyped-def]
                              HAS_LOSS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_SAT: tl.constexpr,
                              LOSS_BF16: tl.constexpr, NORM_BF16: tl.constexpr,
                              LOCAL: tl.constexpr, SHARED: tl.constexpr, SAT_BLOCK: tl.constexpr,
                              SAT_ITERS: tl.constexpr):
        # Lane 0 is the loss, lane 1 the gradient norm; the comments name the torch path's ops.
        lane = tl.arange(0, 2)
        bits = tl.full([], 0, tl.int32)
        if HAS_LOSS or HAS_NORM:
            # a missing quantity is NaN: it changes nothing, trips nothing
            # BF16 is the top half of a float32: widened by an integer shift, so no conversion
            # instruction (nor the interpreter's emulation of one) can flush a subnormal to zero
            if HAS_LOSS:
                xl = (tl.load(loss_ptr.to(tl.pointer_type(tl.int16))).to(tl.int32) << 16).to(tl.float32, bitcast=True) \
                    if LOSS_BF16 else tl.load(loss_ptr).to(tl.float32)
            else:
                xl = float("nan")
            if HAS_NORM:
                xn = (tl.load(norm_ptr.to(tl.pointer_type(tl.int16))).to(tl.int32) << 16).to(tl.float32, bitcast=True) \
                    if NORM_BF16 else tl.load(norm_ptr).to(tl.float32)
            else:
                xn = float("nan")
            x = tl.where(lane == 0, xl, xn)
            seen = tl.load(state_ptr + lane)
            base = tl.load(state_ptr + 2 + lane)
            ref = tl.load(state_ptr + 4 + lane)
            run = tl.load(state_ptr + 6 + lane)
            factor = tl.load(params_ptr + lane)
            bound_mul = tl.load(params_ptr + 2 + lane)
            bound_abs = tl.load(params_ptr + 4 + lane)
            warmup = tl.load(params_ptr + 6)
            early_steps = tl.load(params_ptr + 7)
            ema = tl.load(params_ptr + 8)
            finite = tl.abs(x) < float("inf")  # x - x == 0: false for NaN and +/-inf
            warm = seen >= warmup
            cold = seen < warmup
            first = seen == 0.0
            later = seen != 0.0
            jump = (x > factor * base) & warm
            bound = ref * bound_mul + tl.abs(ref) * bound_abs  # [ref0 + rise * |ref0|, factor * ref1]
            over = (x > bound) & finite & cold & later
            run = (run + 1.0) * over.to(tl.float32)  # grows while over, else 0
            early = run >= early_steps
            lower = (x < ref) & (lane == 1)  # only the gradient norm's reference follows a lower value
            take = (first | lower) & finite
            ok = (jump == 0) & finite
            average = tl.where(first, x, base + (x - base) * ema)
            tl.store(state_ptr + lane, seen + ok.to(tl.float32))
            tl.store(state_ptr + 2 + lane, tl.where(ok, average, base))
            tl.store(state_ptr + 4 + lane, tl.where(take, x, ref))
            tl.store(state_ptr + 6 + lane, run)
            tripped = (finite == 0) | jump | early
            if not HAS_LOSS:
                tripped = tripped & (lane != 0)
            if not HAS_NORM:
                tripped = tripped & (lane != 1)
            bits = tl.sum(tl.where(tripped, tl.where(lane == 0, LOCAL, SHARED), 0), axis=0)
        if HAS_SAT:
            threshold = tl.load(params_ptr + 9)
            hit = tl.zeros([SAT_BLOCK], dtype=tl.int32)
            for i in range(SAT_ITERS):  # ceil(n_sat / SAT_BLOCK): one variant per model
                offs = i * SAT_BLOCK + tl.arange(0, SAT_BLOCK)
                ratio = tl.load(sat_ptr + offs, mask=offs < n_sat, other=0.0)
                hit = tl.maximum(hit, (ratio > threshold).to(tl.int32))  # NaN compares false
            bits = bits | (tl.max(hit, axis=0) * LOCAL)
        tl.store(bits_ptr, bits)

    return tripwire_check_kernel


class TripwireCheck:
    """Launches the check kernel for one tripwire's buffers (one launch per :meth:`__call__`).

    After the first launch of each variant the compiled kernel's own handle is reused: Triton's
    JIT dispatch binds and specialises every argument in Python on each call, the handle's C
    launcher reads the addresses alone. The kernel is compiled without specialising on addresses
    or the ratio count, so the handle fits every later call of the same variant; any failure of
    the handle path goes back to the JIT for good (same result).
    """

    def __init__(self, state: torch.Tensor, params: torch.Tensor, bits: torch.Tensor, *, local: int,
                 shared: int) -> None:
        if _kernel() is None:
            raise RuntimeError("TripwireCheck needs Triton")
        if state.dtype != torch.float32 or state.shape != (4, 2) or not state.is_contiguous():
            raise ValueError("TripwireCheck: state must be a contiguous float32 [4, 2] tensor")
        if params.dtype != torch.float32 or params.shape != (len(PARAMS),) or not params.is_contiguous():
            raise ValueError(f"TripwireCheck: params must be a contiguous float32 [{len(PARAMS)}] tensor")
        if bits.dtype != torch.int32 or bits.numel() != 1:
            raise ValueError("TripwireCheck: bits must be one int32")
        self.state, self.params, self.bits = state, params, bits
        self.local, self.shared = int(local), int(shared)
        self.launches = 0
        """Kernel launches so far (one per call)."""
        self._launch = CompiledLaunch()
        self._launch.fast = state.device.type == "cuda" and not interpret()

    def accepts(self, value: torch.Tensor | None, *, saturation: bool = False) -> bool:
        """Whether the kernel reads ``value`` as the torch path would (on the state's device, of
        one element of a float dtype, or for the saturation ratios a contiguous float32 vector)."""
        if value is None:
            return True
        if value.device != self.state.device:
            return False
        if saturation:
            return value.dtype == torch.float32 and value.dim() == 1 and value.is_contiguous()
        return value.dtype in INPUT_DTYPES and value.numel() == 1

    def __call__(self, loss: torch.Tensor | None, grad_norm: torch.Tensor | None,
                 saturation: torch.Tensor | None) -> torch.Tensor:
        """Enqueue the check; returns the bits word (an int32 device tensor, updated in place)."""
        dummy = self.state
        loss_t = loss if loss is not None else dummy  # (the kernel reads the address alone: no detach)
        norm_t = grad_norm if grad_norm is not None else dummy
        has_sat = saturation is not None and saturation.numel() > 0
        sat_t = saturation if saturation is not None and has_sat else dummy
        n_sat = sat_t.numel() if has_sat else 0
        consts = (loss is not None, grad_norm is not None, has_sat, loss_t.dtype == torch.bfloat16,
                  norm_t.dtype == torch.bfloat16, self.local, self.shared, _SAT_BLOCK, -(-n_sat // _SAT_BLOCK))
        self.launches += 1
        args = (loss_t, norm_t, sat_t, self.state, self.params, self.bits, n_sat)
        self._launch(1, args, consts, lambda: self._jit(args, consts),
                     key=(*consts, device_index(self.state.device), *specialization_key(args)))
        return self.bits

    def _jit(self, args: tuple[Any, ...], consts: tuple[Any, ...]) -> Any:
        has_loss, has_norm, has_sat, loss_bf16, norm_bf16, local, shared, sat_block, sat_iters = consts
        return _kernel()[(1,)](*args, HAS_LOSS=has_loss, HAS_NORM=has_norm, HAS_SAT=has_sat, LOSS_BF16=loss_bf16,
                               NORM_BF16=norm_bf16, LOCAL=local,
                               SHARED=shared, SAT_BLOCK=sat_block, SAT_ITERS=sat_iters, num_warps=1,
                               enable_fp_fusion=False)
