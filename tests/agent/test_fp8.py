"""Tests of the pure FP8 functions against torch's float8 casts and TE's formulas."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")

import torch

try:
    from fp8guard.agent.fp8 import (
        Fp8Format,
        compute_scale,
        count_overflow_underflow,
        dequantize,
        nan_ignoring_amax,
        qdq,
        quantize,
        update_amax_history,
    )
except ModuleNotFoundError:  # source checkout without `pip install -e .`
    from agent.fp8 import (  # type: ignore[no-redef, unused-ignore]
        Fp8Format,
        compute_scale,
        count_overflow_underflow,
        dequantize,
        nan_ignoring_amax,
        qdq,
        quantize,
        update_amax_history,
    )

FORMATS = [Fp8Format.E4M3, Fp8Format.E5M2]
INF = math.inf
NAN = math.nan


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a float8 tensor: compares NaN and signed zero exactly."""
    return t.view(torch.uint8)


def wide_values(n: int = 4000, lo: int = -30, hi: int = 30, seed: int = 0) -> torch.Tensor:
    """Random signed values spanning 2**lo .. 2**hi, so subnormal, normal and overflow ranges all occur."""
    g = torch.Generator().manual_seed(seed)
    mant = torch.rand(n, generator=g) + 0.5
    exp = torch.randint(lo, hi, (n,), generator=g).float()
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return sign * mant * torch.exp2(exp)


def test_format_constants() -> None:
    assert Fp8Format("e4m3") is Fp8Format.E4M3 and Fp8Format.E5M2 == "e5m2"
    assert Fp8Format.E4M3.dtype is torch.float8_e4m3fn
    assert Fp8Format.E5M2.dtype is torch.float8_e5m2
    assert Fp8Format.E4M3.fp8_max == 448.0 == torch.finfo(torch.float8_e4m3fn).max
    assert Fp8Format.E5M2.fp8_max == 57344.0 == torch.finfo(torch.float8_e5m2).max
    assert Fp8Format.E4M3.smallest_subnormal == 2.0**-9
    assert Fp8Format.E5M2.smallest_subnormal == 2.0**-16
    for f in FORMATS:
        ss = f.smallest_subnormal
        # The smallest subnormal is representable; half of it is the round-to-even tie to zero.
        assert torch.tensor([ss]).to(f.dtype).float().tolist() == [ss]
        assert torch.tensor([ss / 2]).to(f.dtype).float().tolist() == [0.0]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 0.375, 64.0, 3.0e-3])
def test_quantize_matches_torch_cast(fmt: Fp8Format, scale: float) -> None:
    x = wide_values()
    q = quantize(x, torch.tensor(scale), fmt)
    assert q.dtype == fmt.dtype and q.shape == x.shape
    xs = x * torch.tensor(scale, dtype=torch.float32)
    in_range = xs.abs() <= fmt.fp8_max
    assert in_range.any() and (~in_range).any()  # both branches exercised
    # In range: bit-identical to torch's own float32 -> float8 cast (round to nearest even).
    assert torch.equal(bits(q[in_range]), bits(xs[in_range].to(fmt.dtype)))
    # Out of range: saturated to the signed max.
    expected = torch.sign(xs[~in_range]) * fmt.fp8_max
    assert torch.equal(q[~in_range].float(), expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_low_precision_input_computes_in_float32(fmt: Fp8Format) -> None:
    x = wide_values(lo=-12, hi=12).to(torch.bfloat16)
    s = torch.tensor(1.7)
    assert torch.equal(bits(quantize(x, s, fmt)), bits(quantize(x.float(), s, fmt)))


def test_saturation_edges() -> None:
    e4, e5 = Fp8Format.E4M3, Fp8Format.E5M2
    assert quantize(torch.tensor([70000.0, -70000.0]), 1.0, e5).float().tolist() == [57344.0, -57344.0]
    assert quantize(torch.tensor([1000.0, -1000.0]), 1.0, e4).float().tolist() == [448.0, -448.0]
    # Overflow caused by the scale, not by the value itself.
    assert quantize(torch.tensor([2.0]), 1e5, e5).float().tolist() == [57344.0]
    # Just above the max still rounds (not saturates) to max: 464 is the E4M3 rounding boundary.
    assert quantize(torch.tensor([460.0]), 1.0, e4).float().tolist() == [448.0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_inf_saturates_and_nan_stays_nan(fmt: Fp8Format) -> None:
    # Decision (matches TE's __NV_SATFINITE cast): +/-inf -> +/-fp8_max, NaN -> NaN.
    q = quantize(torch.tensor([INF, -INF, NAN, 0.0, -0.0]), 1.0, fmt).float()
    assert q[:2].tolist() == [fmt.fp8_max, -fmt.fp8_max]
    assert math.isnan(q[2].tolist())
    assert q[3].tolist() == 0.0 and math.copysign(1.0, q[4].tolist()) == -1.0
    # NaN survives the round trip too; inf comes back as the saturated finite value.
    r = qdq(torch.tensor([NAN, INF]), 2.0, fmt)
    assert math.isnan(r[0].tolist()) and r[1].tolist() == fmt.fp8_max / 2.0


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_and_qdq(fmt: Fp8Format) -> None:
    x = wide_values(lo=-8, hi=4)
    s = torch.tensor(3.0)
    q = quantize(x, s, fmt)
    # TE multiplies by scale_inv = 1/scale (one rounding), it does not divide by scale.
    expected = q.float() * torch.reciprocal(s)
    assert torch.equal(dequantize(q, s), expected)
    assert dequantize(q, s, dtype=torch.bfloat16).dtype == torch.bfloat16
    xb = x.to(torch.bfloat16)
    out = qdq(xb, s, fmt)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (quantize(xb, s, fmt).float() * torch.reciprocal(s)).to(torch.bfloat16))
    # Values already on the FP8 grid (power-of-two scale) round-trip exactly.
    grid = quantize(x, 1.0, fmt).float()
    assert torch.equal(qdq(grid, torch.tensor(8.0), fmt), grid)


def test_nan_ignoring_amax() -> None:
    assert nan_ignoring_amax(torch.tensor([1.0, NAN, -3.0])).tolist() == 3.0
    assert nan_ignoring_amax(torch.tensor([NAN, -INF, 2.0])).tolist() == INF
    assert nan_ignoring_amax(torch.tensor([NAN])).tolist() == 0.0
    empty = nan_ignoring_amax(torch.zeros(0, 4))
    assert empty.tolist() == 0.0 and empty.dtype == torch.float32
    assert nan_ignoring_amax(torch.tensor([-2.5], dtype=torch.bfloat16)).dtype == torch.float32


def te_default_sf_compute(
    amax: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int
) -> torch.Tensor:
    """TE's quantization.py _default_sf_compute, verbatim."""
    sf = (fp8_max / amax) / (2**margin)
    sf = torch.where(amax > 0.0, sf, scale)
    sf = torch.where(torch.isfinite(amax), sf, scale)
    sf = torch.where(torch.isinf(sf), torch.full_like(sf, torch.finfo(torch.float32).max), sf)
    return sf


@pytest.mark.parametrize("margin", [0, 1, 3])
@pytest.mark.parametrize("fmt", FORMATS)
def test_compute_scale_matches_te(margin: int, fmt: Fp8Format) -> None:
    tiny = 1e-45  # float32 subnormal: fp8_max / tiny overflows float32
    amax = torch.tensor([1.0, 0.0, INF, NAN, tiny, 448.0 * 4, 3.3e-3, 1e30], dtype=torch.float32)
    old = torch.tensor([2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    old_copy = old.clone()
    got = compute_scale(amax, old, fmt.fp8_max, margin)
    assert torch.equal(got, te_default_sf_compute(amax, old, fmt.fp8_max, margin))
    assert torch.equal(old, old_copy)  # not modified in place
    assert got[0].tolist() == fmt.fp8_max / 2**margin
    assert got[1:4].tolist() == [3.0, 4.0, 5.0]  # amax 0 / inf / NaN keep the old scale
    assert got[4].tolist() == torch.finfo(torch.float32).max
    assert got.dtype == torch.float32


def test_compute_scale_per_slot_max() -> None:
    amax = torch.tensor([2.0, 2.0])
    fp8_max = torch.tensor([448.0, 57344.0])
    got = compute_scale(amax, torch.ones(2), fp8_max, 1)
    assert got.tolist() == [448.0 / 2 / 2, 57344.0 / 2 / 2]


def test_update_amax_history_roll_semantics() -> None:
    steps = [
        torch.tensor([1.0, 10.0]),
        torch.tensor([5.0, 2.0]),
        torch.tensor([3.0, 4.0]),
        torch.tensor([0.5, 0.25]),
    ]
    for algo in ("max", "most_recent"):
        hist = torch.zeros(3, 2)
        seen: list[torch.Tensor] = []
        for v in steps:
            hist[0] = torch.maximum(hist[0], v)  # what the casts do during a step
            pre = hist.clone()
            amax = update_amax_history(hist, algo)
            seen.append(v)
            if algo == "max":
                assert torch.equal(amax, pre.amax(0))
            else:
                assert torch.equal(amax, v)
            assert torch.equal(hist, torch.cat([pre[1:], pre[:1]]).index_fill(0, torch.tensor([0]), 0.0))
            assert torch.equal(hist[-1], v)  # latest completed amax
            assert torch.equal(hist[0], torch.zeros(2))  # staging row cleared
        # After 4 steps with L=3 the window holds steps 3 and 4 (row 0 is the fresh staging row).
        assert torch.equal(hist[1:], torch.stack(seen[-2:]))
    # L=2: "max" sees this step and the previous one; step 1's 10.0 is gone by step 3.
    hist = torch.zeros(2, 2)
    out = []
    for v in steps:
        hist[0] = v
        out.append(update_amax_history(hist, "max").tolist())
    assert out == [[1.0, 10.0], [5.0, 10.0], [5.0, 4.0], [3.0, 4.0]]


def test_update_amax_history_single_row_and_errors() -> None:
    hist = torch.tensor([[2.0, 7.0]])
    assert update_amax_history(hist, "max").tolist() == [2.0, 7.0]
    assert hist.tolist() == [[0.0, 0.0]]
    with pytest.raises(ValueError, match="amax_compute_algo"):
        update_amax_history(torch.zeros(2, 2), "mean")  # type: ignore[arg-type, unused-ignore]
    with pytest.raises(ValueError, match="2-D"):
        update_amax_history(torch.zeros(4), "max")


def brute_force_counts(x: torch.Tensor, scale: float, fmt: Fp8Format) -> tuple[int, int]:
    """Element by element, with the product rounded to float32 and torch's unclamped float8 cast.

    Overflow as TE's LogFp8TensorStats defines it: ``|x| > fp8_max * scale_inv`` in float32."""
    scale_inv = torch.reciprocal(torch.tensor(scale, dtype=torch.float32))
    threshold = float(scale_inv * fmt.fp8_max)
    cast = (x.float() * torch.tensor(scale, dtype=torch.float32)).to(fmt.dtype).float().tolist()
    over = under = 0
    for v, c in zip(x.float().tolist(), cast, strict=True):
        if not math.isnan(v) and abs(v) > threshold:
            over += 1
        if math.isfinite(v) and v != 0.0 and c == 0.0:
            under += 1
    return over, under


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 0.3, 1024.0, 2.0**-12])
def test_count_overflow_underflow_exact(fmt: Fp8Format, scale: float) -> None:
    half = fmt.smallest_subnormal / 2
    edges = [
        0.0,
        -0.0,
        INF,
        -INF,
        NAN,
        fmt.fp8_max,
        -fmt.fp8_max,
        fmt.fp8_max * (1 + 2**-20),
        math.nextafter(fmt.fp8_max, INF),
        half,
        -half,
        math.nextafter(half, INF),
        math.nextafter(half, 0.0),
        1e-40,
        3e38,
    ]
    x = torch.cat([wide_values(n=3000, lo=-40, hi=40, seed=1), torch.tensor(edges) / scale])
    got = count_overflow_underflow(x, torch.tensor(scale), fmt)
    assert got.dtype == torch.int64 and got.shape == (2,)
    assert tuple(got.tolist()) == brute_force_counts(x, scale, fmt)
    # And consistent with the saturating quantize itself.
    q = quantize(x, scale, fmt).float()
    nonzero_finite = torch.isfinite(x) & (x != 0)
    assert got[1].tolist() == int(((q == 0) & nonzero_finite).sum())


def test_count_bf16_and_specials() -> None:
    x = torch.tensor([INF, -INF, NAN, 0.0, 1e-30, 500.0, 1.0], dtype=torch.float32)
    assert count_overflow_underflow(x, 1.0, "e4m3").tolist() == [3, 1]
    assert count_overflow_underflow(x.to(torch.bfloat16), 1.0, Fp8Format.E4M3).tolist() == [3, 1]
    assert count_overflow_underflow(x, 1.0, "e5m2").tolist() == [2, 1]


def test_unknown_format_is_value_error() -> None:
    with pytest.raises(ValueError, match="e4m3"):
        quantize(torch.ones(2), 1.0, "e3m4")
