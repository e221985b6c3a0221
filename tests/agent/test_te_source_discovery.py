"""The Transformer Engine source on a real GPU: what it finds in a model and how it labels it.
Discovery and its errors, the tensors per TE module and role (LayerNormLinear and LayerNormMLP
against TE's own role labels, LayerNormMLP's values against its tensors), the boundary slots option,
GroupedLinear and te.ops.

Needs a CUDA GPU with FP8 (Hopper or newer) and ``transformer_engine`` 2.x; skips otherwise (CI has
neither). The helpers are in te_gpu_helpers.py. See docs/gpu-te-source.md.
"""

from __future__ import annotations

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
    Format,
    batch,
    fresh_te_state,  # noqa: F401 - autouse fixture
    nn,
    read,
    te,
    torch,
    train_step,
    two_linears,
)

pytestmark = TE_GPU_MARKS

from fp8guard.agent.errors import ConfigError  # noqa: E402
from fp8guard.agent.sources import discover_sources  # noqa: E402
from fp8guard.agent.sources import te as te_source  # noqa: E402
from fp8guard.agent.sources.base import AMAX  # noqa: E402

# -- discovery ---------------------------------------------------------------------------------------


def test_no_te_modules_gives_none() -> None:
    assert te_source.discover(nn.Linear(4, 4), required=True) is None


def test_attach_before_first_fp8_forward_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"run one FP8 forward \(inside te.autocast\)"):
        te_source.discover(two_linears(), required=False)


def test_labels_of_layernorm_modules_follow_te_roles() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(te.LayerNormLinear(128, 128, params_dtype=BF16),
                          te.LayerNormMLP(128, 256, params_dtype=BF16)).to(DEV)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=8)
    train_step(model, batch(0), recipe)
    src = te_source.discover(model, required=True, exact_counts="hooks")
    assert src is not None
    got = [(s.module, s.role, s.fp8_format, s.fp8_max) for s in src.tensors()]
    fwd, bwd = ("e4m3", E4M3_MAX), ("e5m2", E5M2_MAX)
    assert got == [
        ("0", "fwd_input", *fwd), ("0", "fwd_weight", *fwd), ("0", "bwd_grad_output", *bwd),
        ("1.fc1", "fwd_input", *fwd), ("1.fc1", "fwd_weight", *fwd), ("1.fc1", "bwd_grad_output", *bwd),
        ("1.fc2", "fwd_input", *fwd), ("1.fc2", "fwd_weight", *fwd), ("1.fc2", "bwd_grad_output", *bwd),
    ]
    # TE's own role labels agree for the slots reported (forward [in, w, out] / backward [dy, dx] per GEMM).
    mlp = model[1]
    fwd_roles = mlp.get_quantizer_roles(fwd=True, num_quantizers=6)
    bwd_roles = mlp.get_quantizer_roles(fwd=False, num_quantizers=4)
    assert [fwd_roles[i].tensor_type for i in (0, 1, 3, 4)] == ["input", "weight", "input", "weight"]
    assert [fwd_roles[i].name.rsplit(".", 1)[-1] for i in (0, 1, 3, 4)] == ["fc1", "fc1", "fc2", "fc2"]
    assert [(bwd_roles[i].tensor_type, bwd_roles[i].name.rsplit(".", 1)[-1]) for i in (0, 2)] == [
        ("grad_output", "fc1"), ("grad_output", "fc2")]
    # the hook-reachable operands are the ones counted
    assert src.counted == (False, True, True, False, True, False, False, True, True)


def test_layernorm_mlp_values_match_its_tensors() -> None:
    torch.manual_seed(0)
    mlp = te.LayerNormMLP(128, 256, params_dtype=BF16).to(DEV)
    model = nn.Sequential(mlp)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
    cap = Capture({"mlp": mlp}, lambda m: [m.fc1_weight, m.fc2_weight])
    cap.new_step()
    train_step(model, batch(0), recipe)
    src = te_source.discover(model, required=True, exact_counts="hooks")
    assert src is not None
    cap.new_step()
    train_step(model, batch(1), recipe)
    out = read(src).cpu()
    col = {s.name: i for i, s in enumerate(src.tensors())}
    assert out[AMAX, col["0.fc1:fwd_weight"]].item() == cap.amax(1, "mlp", "weight0")
    assert out[AMAX, col["0.fc2:fwd_weight"]].item() == cap.amax(1, "mlp", "weight1")
    assert out[AMAX, col["0.fc2:bwd_grad_output"]].item() == cap.amax(1, "mlp", "grad")
    for name in ("0.fc1:fwd_input", "0.fc2:fwd_input", "0.fc1:bwd_grad_output"):
        assert out[AMAX, col[name]].item() > 0, name  # internal operands: TE's own record, nonzero
    cap.close()


def test_boundary_slots_option() -> None:
    model = two_linears()
    train_step(model, batch(0), DelayedScaling())
    auto = te_source.discover(model, required=True, exact_counts="hooks")
    full = te_source.discover(model, required=True, boundary_slots="all")
    assert auto is not None and full is not None
    assert [s.role for s in auto.tensors()][:3] == ["fwd_input", "fwd_weight", "bwd_grad_output"]
    assert [s.role for s in full.tensors()][:5] == [
        "fwd_input", "fwd_weight", "fwd_output", "bwd_grad_output", "bwd_grad_input"]
    out = read(full).cpu()
    assert out[AMAX, 2].item() == 0.0 and out[AMAX, 4].item() == 0.0  # unused without fp8_output/fp8_grad


def test_grouped_linear_and_ops_labels() -> None:
    torch.manual_seed(0)
    grouped = te.GroupedLinear(2, 128, 128, params_dtype=BF16).to(DEV)
    x = batch(0).requires_grad_(False)
    with te.autocast(enabled=True, recipe=DelayedScaling()):
        y = grouped(x, [32, 32])
    y.float().pow(2).mean().backward()
    src = te_source.discover(nn.Sequential(grouped), required=True)
    assert src is not None
    assert [s.name for s in src.tensors()] == [
        f"0.gemm{g}:{r}" for g in (0, 1) for r in ("fwd_input", "fwd_weight", "bwd_grad_output")]
    out = read(src).cpu()
    assert out[AMAX, 1].item() == float(grouped.weight0.float().abs().max())
    assert out[AMAX, 4].item() == float(grouped.weight1.float().abs().max())

    ops = te.ops.Sequential(te.ops.BasicLinear(128, 128, device=DEV, dtype=BF16))
    with te.autocast(enabled=True, recipe=DelayedScaling()):
        y = ops(x)
    y.float().pow(2).mean().backward()
    src = te_source.discover(ops, required=True)
    assert src is not None
    assert [s.role for s in src.tensors()] == ["fwd_input", "fwd_weight", "bwd_grad_output"]
    assert read(src)[AMAX, 0].item() == float(x.float().abs().max())


def test_discover_sources_requires_te_modules() -> None:
    with pytest.raises(ConfigError, match="no te FP8 modules"):
        discover_sources(nn.Linear(4, 4).to(DEV), ["te"])
