"""The Transformer Engine source on a real GPU, per scaling recipe: values against a reference
recomputation. Each test hooks the TE modules itself to capture the tensors TE quantizes (inputs,
weights, output gradients), recomputes amax, scale and counts from them with TE's formulas, and
compares with what the source reports: DelayedScaling (TE's bookkeeping replayed), Float8CurrentScaling
and Float8BlockScaling.

Needs a CUDA GPU with FP8 (Hopper or newer) and ``transformer_engine`` 2.x; skips otherwise (CI has
neither). The shared helpers are in te_gpu_helpers.py. See docs/gpu-te-source.md.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

# first: skips this module unless a CUDA GPU runs Transformer Engine in FP8
from tests.agent.te_gpu_helpers import (
    BF16,
    DEV,
    E4M3_MAX,
    E5M2_MAX,
    TE_GPU_MARKS,
    Capture,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    batch,
    fresh_te_state,  # noqa: F401 - autouse fixture
    nn,
    read,
    te,
    tex,
    torch,
    train_step,
    two_linears,
)

pytestmark = TE_GPU_MARKS

from fp8guard.agent.fp8 import Fp8Format, count_overflow_underflow  # noqa: E402
from fp8guard.agent.sources import te as te_source  # noqa: E402
from fp8guard.agent.sources.base import AMAX, HISTORY_MAX, SCALE  # noqa: E402

FLT_MAX = float(torch.finfo(torch.float32).max)


# -- helpers ----------------------------------------------------------------------------------------


def _linear_weights(m: nn.Module) -> list[torch.Tensor]:
    return [getattr(m, n) for n in m.weight_names]


def f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def delayed_reference(amaxes: list[float], length: int, fp8_max: float, margin: int) -> list[dict[str, float]]:
    """TE's DelayedScaling bookkeeping replayed in float32 from the true amax of every step.

    Per step: the scale in use, the completed amax, the new scale, and the max of the stored
    history after the roll (the L-1 newest amaxes; row 0 is the zeroed staging row).
    """
    history: list[float] = []
    scale = 1.0
    out = []
    for a in amaxes:
        window = ([*history, a])[-length:]
        m = max(window)
        new = scale
        if m > 0 and math.isfinite(m):
            new = f32(f32(fp8_max / f32(m)) / 2.0**margin)
            new = FLT_MAX if math.isinf(new) else new
        history.append(a)
        stored = max(history[-(length - 1):]) if length > 1 else 0.0
        out.append({"amax": a, "scale_in_use": scale, "new_scale": new, "history_max": stored})
        scale = new
    return out


def current_scale(amax: float, fp8_max: float, pow2: bool = False, eps: float = 0.0) -> float:
    """TE's compute_scale_from_amax, in float32."""
    a = max(amax, eps)
    if a == 0 or not math.isfinite(a):
        return 1.0
    s = f32(fp8_max / f32(a))
    if math.isinf(s):
        s = FLT_MAX
    if pow2:
        s = 2.0 ** math.floor(math.log2(s))
    return s


def te_underflows(x: torch.Tensor, scale: torch.Tensor, fp8: Any) -> int:
    """Underflows as TE's own cast produces them: nonzero inputs whose FP8 byte is +/-0."""
    q = te.Float8Quantizer(scale.detach().clone().reshape(1), torch.zeros(1, device=DEV), fp8)(x)
    data = q._data.view(torch.uint8)
    return int(((x != 0) & ((data == 0) | (data == 0x80))).sum())


# -- DelayedScaling: values against TE's bookkeeping replayed from the captured tensors ---------------


@pytest.mark.parametrize(("length", "margin"), [(1, 0), (4, 0), (16, 1)])
def test_delayed_scaling_values(length: int, margin: int) -> None:
    model = two_linears()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=length, amax_compute_algo="max",
                            margin=margin)
    cap = Capture({"0": model[0], "1": model[1]}, _linear_weights)
    cap.new_step()
    train_step(model, batch(0), recipe, opt)
    src = te_source.discover(model, required=True, exact_counts="hooks")
    assert src is not None and src.recipe_name == "DelayedScaling"
    names = [s.name for s in src.tensors()]
    assert names == [f"{m}:{r}" for m in "01" for r in ("fwd_input", "fwd_weight", "bwd_grad_output")]
    reads = []
    for t in range(1, 8):
        cap.new_step()
        train_step(model, batch(t), recipe, opt)
        reads.append(read(src).cpu())
    what = {"fwd_input": ("input", E4M3_MAX), "fwd_weight": ("weight0", E4M3_MAX),
            "bwd_grad_output": ("grad", E5M2_MAX)}
    for j, spec in enumerate(src.tensors()):
        key, fp8_max = what[spec.role]
        assert spec.fp8_max == fp8_max
        ref = delayed_reference([cap.amax(t, spec.module, key) for t in range(8)], length, fp8_max, margin)
        for t in range(1, 8):
            got, exp = reads[t - 1][:, j], ref[t]
            where = f"{spec.name} step {t}"
            assert got[SCALE].item() == pytest.approx(exp["scale_in_use"], rel=1e-6), where
            if length == 1:  # derived from the new scale
                assert got[AMAX].item() == pytest.approx(exp["amax"], rel=1e-6), where
                assert got[HISTORY_MAX].item() == got[AMAX].item(), where
            else:
                assert got[AMAX].item() == exp["amax"], where
                assert got[HISTORY_MAX].item() == exp["history_max"], where
    # the scale TE will use next is the one the reference derived
    last = model[0].fp8_meta["scaling_fwd"].scale[0].item()
    ref0 = delayed_reference([cap.amax(t, "0", "input") for t in range(8)], length, E4M3_MAX, margin)
    assert last == pytest.approx(ref0[-1]["new_scale"], rel=1e-6)
    cap.close()


def test_delayed_scaling_counts_match_te_cast() -> None:
    torch.manual_seed(0)
    lin = te.Linear(128, 128, params_dtype=BF16).to(DEV)
    model = nn.Sequential(lin)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
    cap = Capture({"0": lin}, _linear_weights)
    cap.new_step()
    train_step(model, batch(0), recipe)
    src = te_source.discover(model, required=True, exact_counts="hooks")
    assert src is not None and src.supports_counts
    read(src)
    scale_in_use = lin.fp8_meta["scaling_fwd"].scale[0:1].clone()
    src.arm_counts(True)
    # wide dynamic range (underflows) and a 4x jump over the last amax (overflows under the old scale)
    g = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(64, 128, device=DEV, generator=g) * torch.exp(
        torch.empty(64, 128, device=DEV).uniform_(-18, 0, generator=g))
    x = (x / x.abs().max() * cap.amax(0, "0", "input") * 4).to(BF16)
    cap.new_step()
    train_step(model, x, recipe)
    counts = torch.zeros(2, len(src.tensors()), device=DEV)
    src.read_counts(counts)
    counts = counts.cpu()
    ref = count_overflow_underflow(x, scale_in_use, Fp8Format.E4M3).cpu()
    assert counts[:, 0].tolist() == ref.tolist()
    assert ref[0] > 0 and ref[1] > 0
    assert counts[1, 0].item() == te_underflows(x, scale_in_use, tex.DType.kFloat8E4M3)
    # read_counts resets; disarmed steps add nothing
    src.arm_counts(False)
    train_step(model, x, recipe)
    src.read_counts(counts)
    assert counts.abs().sum().item() == 0
    cap.close()


# -- Float8CurrentScaling / Float8BlockScaling --------------------------------------------------------


def test_current_scaling_values_match_te_quantizer() -> None:
    model = two_linears()
    recipe = Float8CurrentScaling(fp8_format=Format.HYBRID)
    cap = Capture({"0": model[0], "1": model[1]}, _linear_weights)
    cap.new_step()
    train_step(model, batch(0), recipe)
    src = te_source.discover(model, required=True, exact_counts="hooks")
    assert src is not None and src.recipe_name == "Float8CurrentScaling"
    assert [s.name for s in src.tensors()] == [
        f"{m}:{r}" for m in "01" for r in ("fwd_input", "fwd_weight", "bwd_grad_output")]
    for t in range(1, 4):
        cap.new_step()
        train_step(model, batch(t), recipe)
        out = read(src).cpu()
        for j, spec in enumerate(src.tensors()):
            key = {"fwd_input": "input", "fwd_weight": "weight0", "bwd_grad_output": "grad"}[spec.role]
            a = cap.amax(t, spec.module, key)
            assert out[AMAX, j].item() == a, spec.name
            assert out[HISTORY_MAX, j].item() == a, spec.name
            assert out[SCALE, j].item() == pytest.approx(current_scale(a, spec.fp8_max), rel=1e-6), spec.name
            # TE's own current-scaling cast of the same tensor used the same scale
            fp8 = tex.DType.kFloat8E4M3 if spec.fp8_format == "e4m3" else tex.DType.kFloat8E5M2
            q = te.Float8CurrentScalingQuantizer(fp8, device=DEV)(cap.steps[t][(spec.module, key)])
            assert out[SCALE, j].item() == pytest.approx(1.0 / q._scale_inv.float().item(), rel=1e-6), spec.name
    cap.close()


def test_current_scaling_counts_match_te_cast() -> None:
    torch.manual_seed(0)
    lin = te.Linear(128, 128, params_dtype=BF16).to(DEV)
    model = nn.Sequential(lin)
    recipe = Float8CurrentScaling()
    train_step(model, batch(0), recipe)
    src = te_source.discover(model, required=True, exact_counts="hooks")
    assert src is not None and src.supports_counts
    cap = Capture({"0": lin}, _linear_weights)
    cap.new_step()
    src.arm_counts(True)
    g = torch.Generator(device=DEV).manual_seed(3)
    x = (torch.randn(64, 128, device=DEV, generator=g)
         * torch.exp(torch.empty(64, 128, device=DEV).uniform_(-18, 0, generator=g))).to(BF16)
    train_step(model, x, recipe)
    counts = torch.zeros(2, 3, device=DEV)
    src.read_counts(counts)
    scale = torch.tensor([current_scale(cap.amax(0, "0", "input"), E4M3_MAX)], device=DEV)
    ref = count_overflow_underflow(x, scale, Fp8Format.E4M3).cpu()
    assert counts[:, 0].cpu().tolist() == ref.tolist()
    # Current scaling cannot clip finite inputs; but amax * (448 / amax) can land one float32 ulp
    # above 448, which count_overflow_underflow counts while the cast merely rounds it to 448.
    assert ref[0] <= 1 and ref[1] > 0
    q = te.Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device=DEV)(x)
    data = q._data.view(torch.uint8)
    assert counts[1, 0].item() == int(((x != 0) & ((data == 0) | (data == 0x80))).sum())
    cap.close()


def test_block_scaling_values() -> None:
    ok, reason = te.is_fp8_block_scaling_available(return_reason=True)
    if not ok:
        pytest.skip(f"Float8BlockScaling not available: {reason}")
    model = two_linears()
    recipe = Float8BlockScaling()
    cap = Capture({"0": model[0], "1": model[1]}, _linear_weights)
    cap.new_step()
    train_step(model, batch(0, rows=128), recipe)
    src = te_source.discover(model, required=True, exact_counts="hooks")
    assert src is not None and src.recipe_name == "Float8BlockScaling" and not src.supports_counts
    cap.new_step()
    train_step(model, batch(1, rows=128), recipe)
    out = read(src).cpu()
    pow2 = recipe.fp8_quant_fwd_inp.power_2_scale
    for j, spec in enumerate(src.tensors()):
        key = {"fwd_input": "input", "fwd_weight": "weight0", "bwd_grad_output": "grad"}[spec.role]
        a = cap.amax(1, spec.module, key)
        assert out[AMAX, j].item() == a, spec.name
        assert out[SCALE, j].item() == pytest.approx(current_scale(a, spec.fp8_max, pow2), rel=1e-6), spec.name
    cap.close()
