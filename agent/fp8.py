"""FP8 formats and pure tensor functions mirroring Transformer Engine's DelayedScaling numerics.

Everything here is stateless and host-sync free: no ``.item()``, ``.tolist()``, ``.cpu()``,
``float(tensor)``, ``bool(tensor)`` or Python ``if`` on tensor values, so these functions can run
every step on an accelerator without stalling the stream.

Conventions (same as TE):

* ``scale`` multiplies before the cast: ``q = cast_fp8(float32(x) * scale)``.
* Dequantization multiplies by ``scale_inv = 1 / scale`` (TE keeps ``scale_inv`` and feeds it to
  the GEMM), not by dividing by ``scale``; the two differ by one rounding for non power-of-two scales.
* The cast saturates (CUDA ``__NV_SATFINITE``): any magnitude above the format max, +/-inf
  included, becomes +/-max; NaN stays NaN.
"""

from __future__ import annotations

import enum
from typing import Literal

import torch

__all__ = [
    "AmaxComputeAlgo",
    "Fp8Format",
    "compute_scale",
    "count_from_cast",
    "count_overflow_underflow",
    "dequantize",
    "nan_ignoring_amax",
    "qdq",
    "quantize",
    "update_amax_history",
]

AmaxComputeAlgo = Literal["max", "most_recent"]

_FP32_MAX = torch.finfo(torch.float32).max


class Fp8Format(enum.StrEnum):
    """An FP8 encoding: E4M3 (OCP "fn" variant, no inf) or E5M2 (IEEE-like, has inf)."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype holding this format."""
        return torch.float8_e4m3fn if self is Fp8Format.E4M3 else torch.float8_e5m2

    @property
    def fp8_max(self) -> float:
        """Largest finite magnitude: 448 for E4M3, 57344 for E5M2."""
        return 448.0 if self is Fp8Format.E4M3 else 57344.0

    @property
    def smallest_subnormal(self) -> float:
        """Smallest positive (subnormal) magnitude: 2**-9 for E4M3, 2**-16 for E5M2."""
        return 2.0**-9 if self is Fp8Format.E4M3 else 2.0**-16


def _as_format(fmt: Fp8Format | str) -> Fp8Format:
    try:
        return Fp8Format(fmt)
    except ValueError:
        raise ValueError(f"unknown FP8 format {fmt!r}; use one of {[f.value for f in Fp8Format]}") from None


def _scaled(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    # TE's cast kernels convert the input to float32 and multiply there, whatever the input dtype,
    # so the product is rounded once to float32 before the FP8 rounding.
    return x.to(torch.float32) * scale


def nan_ignoring_amax(x: torch.Tensor) -> torch.Tensor:
    """``max(|x|)`` as a 0-d float32 tensor, skipping NaN but keeping inf (TE reduces with fmaxf).

    An empty tensor gives 0 (TE's amax of no elements is the initial 0).
    """
    if x.numel() == 0:  # shape check, not a value check: no host sync
        return torch.zeros((), dtype=torch.float32, device=x.device)
    # nan_to_num would also map inf to float max by default; keep inf so it reaches the history.
    a = torch.nan_to_num(x.detach().abs(), nan=0.0, posinf=float("inf"))
    return a.amax().to(torch.float32)


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: Fp8Format | str) -> torch.Tensor:
    """Cast ``x * scale`` to FP8 the way TE does; returns the float8 tensor.

    Edges (TE casts with CUDA's ``__NV_SATFINITE``):

    * finite overflow saturates to +/-fp8_max. torch's CPU cast alone would give inf for E5M2
      (70000 -> inf), hence the explicit clamp.
    * +/-inf also saturates to +/-fp8_max: satfinite treats inf as "larger than max". The inf is
      still visible to the monitor through the amax history and the overflow count.
    * NaN stays NaN: ``clamp`` propagates NaN and both float8 dtypes have a NaN encoding.
    * magnitudes <= smallest_subnormal / 2 flush to (signed) zero (round to nearest even).
    """
    f = _as_format(fmt)
    xs = _scaled(x, scale).clamp(-f.fp8_max, f.fp8_max)
    return xs.to(f.dtype)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor | float, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Map an FP8 tensor back to ``dtype``: ``float32(q) * (1 / scale)`` as TE's scale_inv does."""
    scale_inv = torch.reciprocal(torch.as_tensor(scale, dtype=torch.float32, device=q.device))
    return (q.to(torch.float32) * scale_inv).to(dtype)


def qdq(x: torch.Tensor, scale: torch.Tensor | float, fmt: Fp8Format | str) -> torch.Tensor:
    """Quantize then dequantize, returning a tensor of ``x.dtype`` carrying the FP8 rounding."""
    return dequantize(quantize(x, scale, fmt), scale, dtype=x.dtype)


def count_overflow_underflow(
    x: torch.Tensor,
    scale: torch.Tensor | float,
    fmt: Fp8Format | str,
    *,
    scale_inv: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Exact ``[overflows, underflows]`` (int64, on ``x.device``) for casting ``x * scale`` to FP8.

    The definitions are Transformer Engine's ``LogFp8TensorStats`` (``overflows%``,
    ``underflows%``), so the counts equal TE's own statistics on the same tensor:

    * overflow: ``|x| > fp8_max * scale_inv`` in float32 (the value gets clipped); +/-inf count,
      NaN does not. ``scale_inv`` defaults to the float32 ``1 / scale``, which is what TE's cast
      kernels store as the FP8 tensor's ``_scale_inv``.
    * underflow: nonzero ``x`` whose FP8 value is zero (TE: ``count_nonzero(x)`` minus the
      nonzero FP8 bytes). With round-to-nearest-even that is precisely ``|x * scale| <=
      smallest_subnormal / 2`` (the tie rounds to even, i.e. 0), the threshold CUDA's converter
      uses, so no cast is needed to count. NaN and inf never round to zero.
    """
    f = _as_format(fmt)
    xf = x.detach().to(torch.float32)
    if scale_inv is None:
        scale_inv = torch.reciprocal(torch.as_tensor(scale, dtype=torch.float32, device=x.device))
    threshold = torch.as_tensor(scale_inv, dtype=torch.float32, device=x.device) * f.fp8_max
    overflow = (xf.abs() > threshold).sum()
    mag = (xf * scale).abs()  # the float32 product TE's cast rounds (see _scaled)
    underflow = ((mag <= f.smallest_subnormal / 2) & (xf != 0)).sum()
    return torch.stack((overflow, underflow)).to(torch.int64)


_FP8_ZERO_BYTES = (0x00, 0x80)
"""+0 and -0 in both FP8 encodings (TE's ``count_nonzero_fp8`` treats both as zero)."""


def count_from_cast(
    x: torch.Tensor, fp8_bytes: torch.Tensor, scale_inv: torch.Tensor | float, fmt: Fp8Format | str
) -> torch.Tensor:
    """``[overflows, underflows]`` (int64) of a cast already made, by TE's own formulas.

    The reference the kernels are held to when the FP8 bytes exist: Transformer Engine's
    ``compute_fp8_delayed_scaling_overflows_num`` (``x > fp8_max * scale_inv`` or
    ``x < -fp8_max * scale_inv``, compared in float32) and its underflow statistic
    ``count_nonzero(x) - count_nonzero_fp8(bytes)``, where both 0x00 and 0x80 (-0) are zero bytes.
    The underflow is an aggregate difference, not an element test; it equals "nonzero ``x``
    whose byte is +/-0" because a zero ``x`` always casts to a +/-0 byte (for any finite scale)
    and a NaN ``x`` to a NaN byte. No scale is involved: whatever rounding, saturation or scale
    the cast used is already in the bytes.
    """
    f = _as_format(fmt)
    xf = x.detach().reshape(-1).to(torch.float32)
    thr = torch.as_tensor(scale_inv, dtype=torch.float32, device=x.device).reshape(()) * f.fp8_max
    overflow = ((xf > thr) | (xf < -thr)).sum()
    q = fp8_bytes.reshape(-1).view(torch.uint8)
    zero_bytes = ((q == _FP8_ZERO_BYTES[0]) | (q == _FP8_ZERO_BYTES[1])).sum()
    nonzero_bytes = q.numel() - zero_bytes
    underflow = torch.count_nonzero(xf if x.dtype == torch.float32 else x.detach().reshape(-1)) - nonzero_bytes
    return torch.stack((overflow, underflow)).to(torch.int64)


def compute_scale(
    amax: torch.Tensor,
    old_scale: torch.Tensor,
    fp8_max: torch.Tensor | float,
    margin: int = 0,
) -> torch.Tensor:
    """TE's ``_default_sf_compute``: ``scale = fp8_max / amax / 2**margin``, elementwise over slots.

    * amax == 0, inf or NaN: keep ``old_scale`` (nothing sensible to derive).
    * tiny amax making the scale inf in float32: use float32 max.

    ``fp8_max`` may be a float or a tensor broadcastable to ``amax`` (per-slot maxima).
    Returns a new float32 tensor; ``old_scale`` is not modified.
    """
    amax = amax.to(torch.float32)
    old_scale = old_scale.to(torch.float32)
    sf = (fp8_max / amax) / (2.0**margin)
    sf = torch.where(amax > 0.0, sf, old_scale)
    sf = torch.where(torch.isfinite(amax), sf, old_scale)
    return torch.where(torch.isinf(sf), torch.full_like(sf, _FP32_MAX), sf)


def update_amax_history(history: torch.Tensor, amax_compute_algo: AmaxComputeAlgo) -> torch.Tensor:
    """Reduce then roll an ``[L, N]`` amax history in place (TE's ``_compute_amax_and_update_history``).

    Row 0 is the staging row the casts max into. The amax is taken from the pre-roll history
    ("max": column max over all rows; "most_recent": row 0), then the history rolls by -1 so the
    staging row lands in row -1 (the latest completed amax) and row 0 is zeroed for the next step.
    Returns the ``[N]`` amax.
    """
    if history.dim() != 2:
        raise ValueError(f"amax history must be 2-D [history_len, slots], got shape {tuple(history.shape)}")
    if amax_compute_algo == "max":
        amax = history.amax(dim=0)
    elif amax_compute_algo == "most_recent":
        amax = history[0].clone()
    else:
        raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {amax_compute_algo!r}")
    if history.shape[0] > 1:
        history.copy_(torch.roll(history, -1, 0))
    history[0].zero_()
    return amax
