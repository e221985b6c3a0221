"""The Transformer Engine source on a real GPU: values against a reference recomputation.

Needs a CUDA GPU with FP8 (Hopper or newer) and ``transformer_engine`` 2.x; skips otherwise
(CI has neither). Each test hooks the TE modules itself to capture the tensors TE quantizes
(inputs, weights, output gradients), recomputes amax, scale and counts from them with TE's
formulas, and compares with what the source reports. See docs/gpu-te-source.md.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.te,
    pytest.mark.gpu,
    # TE and its torch integration warn about deprecations and experimental features.
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import transformer_engine.pytorch as te
        import transformer_engine_torch as tex
        from transformer_engine.common.recipe import (
            DelayedScaling,
            Float8BlockScaling,
            Float8CurrentScaling,
            Format,
        )
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
except Exception as exc:  # not installed, or its extension does not load
    pytest.skip(f"needs transformer_engine (import failed: {exc})", allow_module_level=True)
_fp8_ok, _fp8_reason = te.is_fp8_available(return_reason=True)
if not _fp8_ok:
    pytest.skip(f"the GPU cannot run TE FP8: {_fp8_reason}", allow_module_level=True)

from torch import nn  # noqa: E402

from fp8guard.agent.config import MonitorConfig  # noqa: E402
from fp8guard.agent.errors import ConfigError  # noqa: E402
from fp8guard.agent.fp8 import Fp8Format, count_overflow_underflow  # noqa: E402
from fp8guard.agent.monitor import Monitor  # noqa: E402
from fp8guard.agent.sources import discover_sources  # noqa: E402
from fp8guard.agent.sources import te as te_source  # noqa: E402
from fp8guard.agent.sources.base import AMAX, HISTORY_MAX, SCALE, STATS  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
E4M3_MAX, E5M2_MAX = 448.0, 57344.0
FLT_MAX = float(torch.finfo(torch.float32).max)


# -- helpers ----------------------------------------------------------------------------------------


class Capture:
    """Records, per TE module and step, what TE quantizes: input, weight(s), output gradient."""

    def __init__(self, modules: dict[str, nn.Module], weights: Callable[[nn.Module], list[torch.Tensor]]) -> None:
        self.steps: list[dict[tuple[str, str], torch.Tensor]] = []
        self._weights = weights
        self._handles: list[Any] = []
        for name, m in modules.items():
            self._handles.append(m.register_forward_pre_hook(self._pre(name)))
            self._handles.append(m.register_forward_hook(self._post(name)))

    def new_step(self) -> None:
        self.steps.append({})

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...]) -> None:
            if self.steps:
                self.steps[-1][(name, "input")] = args[0].detach().clone()
                for i, w in enumerate(self._weights(m)):
                    self.steps[-1][(name, f"weight{i}")] = w.detach().clone()
        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            y = out[0] if isinstance(out, tuple) else out
            if self.steps and y.requires_grad:
                step = self.steps[-1]
                y.register_hook(lambda g: step.__setitem__((name, "grad"), g.detach().clone()))
        return hook

    def amax(self, step: int, name: str, what: str) -> float:
        return float(self.steps[step][(name, what)].float().abs().max())

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def _linear_weights(m: nn.Module) -> list[torch.Tensor]:
    return [getattr(m, n) for n in m.weight_names]


def train_step(model: nn.Module, x: torch.Tensor, recipe: Any, opt: torch.optim.Optimizer | None = None) -> torch.Tensor:
    with te.autocast(enabled=True, recipe=recipe):
        y = model(x)
    y = y[0] if isinstance(y, tuple) else y
    loss = y.float().pow(2).mean()
    loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.detach()


def two_linears() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(te.Linear(128, 256, params_dtype=BF16), te.Linear(256, 128, params_dtype=BF16)).to(DEV)


def batch(step: int, rows: int = 64, cols: int = 128) -> torch.Tensor:
    # A different magnitude every step, so the scale and its history really move.
    g = torch.Generator(device=DEV).manual_seed(1000 + step)
    return (torch.randn(rows, cols, device=DEV, generator=g) * (2.0 ** (step % 4 - 1))).to(BF16)


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


def read(src: Any) -> torch.Tensor:
    out = torch.zeros(len(STATS), len(src.tensors()), device=DEV)
    src.read(out)
    return out


def te_underflows(x: torch.Tensor, scale: torch.Tensor, fp8: Any) -> int:
    """Underflows as TE's own cast produces them: nonzero inputs whose FP8 byte is +/-0."""
    q = te.Float8Quantizer(scale.detach().clone().reshape(1), torch.zeros(1, device=DEV), fp8)(x)
    data = q._data.view(torch.uint8)
    return int(((x != 0) & ((data == 0) | (data == 0x80))).sum())


@pytest.fixture(autouse=True)
def _fresh_state() -> Iterator[None]:
    # TE's registry of delayed-scaling tensors is global: start every test with a clean one.
    FP8GlobalStateManager.reset()
    yield
    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


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


# -- no host sync -------------------------------------------------------------------------------------


SYNC_RECIPES = ["delayed", "delayed_l1", "current"]


def _sync_setup(recipe_name: str) -> tuple[Any, nn.Module, Any, Any, torch.Tensor, torch.Tensor]:
    recipe = {"delayed": DelayedScaling(amax_history_len=16), "delayed_l1": DelayedScaling(amax_history_len=1),
              "current": Float8CurrentScaling()}[recipe_name]
    model = two_linears()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    train_step(model, batch(0), recipe, opt)
    src = te_source.discover(model, required=True, exact_counts="hooks")
    assert src is not None
    out = torch.zeros(len(STATS), len(src.tensors()), device=DEV)
    counts = torch.zeros(2, len(src.tensors()), device=DEV)
    src.arm_counts(True)
    for t in range(1, 3):  # warm: allocator, TE workspaces
        train_step(model, batch(t), recipe, opt)
        src.read(out)
        src.read_counts(counts)
    torch.cuda.synchronize()
    return recipe, model, opt, src, out, counts


@pytest.mark.parametrize("recipe_name", SYNC_RECIPES)
def test_read_is_sync_free(recipe_name: str) -> None:
    _, _, _, src, out, counts = _sync_setup(recipe_name)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            src.read(out)
            src.read_counts(counts)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("recipe_name", SYNC_RECIPES)
def test_training_steps_with_source_are_sync_free(recipe_name: str) -> None:
    recipe, model, opt, src, out, counts = _sync_setup(recipe_name)
    # only meaningful if TE's own step does not sync: check a model without the source first
    plain = two_linears()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-3)
    for t in range(2):
        train_step(plain, batch(t), recipe, plain_opt)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        train_step(plain, batch(3), recipe, plain_opt)
    except RuntimeError as exc:
        torch.cuda.set_sync_debug_mode(0)
        pytest.skip(f"TE's own training step syncs, so whole steps cannot be checked: {exc}")
    try:
        for t in range(4, 7):
            train_step(model, batch(t), recipe, opt)  # counting hooks armed
            src.read(out)
            src.read_counts(counts)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(out).all()


# -- the Monitor, end to end ------------------------------------------------------------------------


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_monitor_with_te_source(recipe_name: str) -> None:
    torch.manual_seed(0)
    recipe = DelayedScaling(amax_history_len=16) if recipe_name == "delayed" else Float8CurrentScaling()
    model = nn.ModuleList([
        te.TransformerLayer(128, 256, 4, params_dtype=BF16, hidden_dropout=0.0, attention_dropout=0.0,
                            layer_number=i + 1) for i in range(2)]).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 2, 128, device=DEV, dtype=BF16)

    def step() -> torch.Tensor:
        with te.autocast(enabled=True, recipe=recipe):
            h = x
            for layer in model:
                h = layer(h)
        loss = h.float().pow(2).mean()
        loss.backward()
        return loss.detach()

    step()
    opt.zero_grad(set_to_none=True)
    monitor = Monitor(MonitorConfig(url=None, sources=["te"], count_interval_steps=2, flush_interval_steps=4))
    monitor.attach(model, opt)
    try:
        names = [s.name for s in monitor._specs]
        assert any(n.startswith("0.layernorm_mlp.fc2:") for n in names), names
        assert any(n.startswith("1.self_attention.proj:") for n in names), names
        for _ in range(6):
            loss = step()
            monitor.step(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
        monitor.flush()
        assert not monitor._broken
    finally:
        monitor.close()


def test_discover_sources_requires_te_modules() -> None:
    with pytest.raises(ConfigError, match="no te FP8 modules"):
        discover_sources(nn.Linear(4, 4).to(DEV), ["te"])


def test_bf16_fallback_and_repromotion_with_fresh_state() -> None:
    """set_fp8(False) runs the module in BF16 inside an FP8 autocast; set_fp8(True) brings FP8
    back with TE's meta tensors reset (scale 1, empty history)."""
    torch.manual_seed(0)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=8)
    model = nn.Sequential(te.Linear(256, 256, params_dtype=torch.bfloat16),
                          te.Linear(256, 256, params_dtype=torch.bfloat16)).cuda()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)

    def run(fp8: bool = True) -> torch.Tensor:
        with te.autocast(enabled=fp8, recipe=recipe):
            out = model(x)
        out.float().sum().backward()
        return out.detach()

    for _ in range(3):
        run()
    source = te_source.discover(model, required=True, exact_counts="hooks")
    assert source is not None
    first = model[0]
    fp8_out = run()
    source.set_fp8(["0"], enabled=False)
    bf16_out = run()
    # in BF16 the module measures nothing: no stale amax from its old history rows is reported
    out = torch.zeros(len(STATS), len(source.tensors()), device=DEV)
    source.read(out)
    cols = [i for i, spec in enumerate(source.tensors()) if spec.module == "0"]
    assert cols and torch.all(out[AMAX, cols] == 0) and torch.all(out[HISTORY_MAX, cols] == 0)
    with te.autocast(enabled=False):
        reference = first(x)
    # the fallen-back layer computes exactly as without FP8, inside an FP8 autocast
    with te.autocast(enabled=True, recipe=recipe):
        inside = first(x).detach()
    torch.testing.assert_close(inside, reference.detach(), rtol=0, atol=0)
    assert not torch.equal(fp8_out, bf16_out)
    source.set_fp8(["0"], enabled=True)
    meta = first.fp8_meta["scaling_fwd"]
    assert torch.all(meta.scale == 1) and torch.all(meta.amax_history == 0)
    with te.autocast(enabled=True, recipe=recipe):
        again = first(x).detach()
    assert not torch.equal(again, reference.detach())  # FP8 casts are back
    source.close()


def test_harm_probe_on_te_leaves_no_trace_and_measures_the_gap() -> None:
    """The harm probe's TE switch: a BF16 plan computes as without FP8, inside the loop's own FP8
    autocast; TE's amax histories and scales, the modules' precision and the RNG are as before;
    a trial (a module held in BF16 tried in FP8) starts fresh and leaves the held state alone."""
    from fp8guard.agent.harm import HarmProbe

    torch.manual_seed(0)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=8)
    model = nn.Sequential(te.Linear(256, 256, params_dtype=torch.bfloat16),
                          te.Linear(256, 256, params_dtype=torch.bfloat16)).cuda()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)

    def loss_fn() -> torch.Tensor:
        with te.autocast(enabled=True, recipe=recipe):
            return model(x).float().pow(2).mean()

    for _ in range(3):
        loss_fn().backward()
    source = te_source.discover(model, required=True, exact_counts="hooks")
    assert source is not None
    probe = HarmProbe([source], interval_steps=1, band_z=4, min_gap=0.005, warmup_probes=3, device=DEV)
    hists, scales = source._live_state()
    before = [t.clone() for t in (*hists, *scales)]
    rng = torch.cuda.get_rng_state()
    loss_fp8, loss_bf16, gap = probe.measure(5, loss_fn).tolist()
    with torch.no_grad(), te.autocast(enabled=False):
        plain = model(x).float().pow(2).mean()
    assert loss_bf16 == float(plain)
    assert gap == pytest.approx((loss_fp8 - loss_bf16) / loss_bf16, rel=1e-5) and loss_fp8 != loss_bf16
    assert all(torch.equal(a, b) for a, b in zip(before, (*hists, *scales), strict=True))
    assert torch.equal(rng, torch.cuda.get_rng_state())
    assert source.precision() == {"0": True, "1": True}
    source.set_fp8(["1"], enabled=False)
    held = [t.clone() for t in (*hists, *scales)]
    trial = probe.trial(6, loss_fn, ["1"])
    assert trial.gap == trial.gap and not trial.harmful  # a healthy layer back in FP8: within the warm-up band
    assert source.precision() == {"0": True, "1": False}
    assert all(torch.equal(a, b) for a, b in zip(held, (*hists, *scales), strict=True))
    source.close()


def three_te_modules() -> tuple[nn.Sequential, Any]:
    """A LayerNormLinear, a LayerNormMLP (two GEMMs, one TE module) and a Linear, named, after one
    training step under delayed scaling; and the recipe."""
    torch.manual_seed(0)
    model = nn.Sequential(te.LayerNormLinear(128, 128, params_dtype=BF16, name="ln_linear"),
                          te.LayerNormMLP(128, 256, params_dtype=BF16, name="ln_mlp"),
                          te.Linear(128, 128, params_dtype=BF16, name="linear")).to(DEV)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
    train_step(model, batch(0), recipe)
    return model, recipe


def test_inspect_counts_every_operand_and_agree_with_the_hooks() -> None:
    """exact_counts="inspect": TE's tensor-inspection API hands over every operand (LayerNorm
    outputs and MLP internals included); where module hooks also reach an operand, both paths
    count the same. (bench/gpu_counts.py verify checks the 604M model against TE's own stats.)"""
    model, recipe = three_te_modules()
    hooks = te_source.discover(model, required=True, exact_counts="hooks")
    inspect = te_source.discover(model, required=True, exact_counts="inspect")
    assert inspect is not None and hooks is not None and all(inspect.counted)
    inspect.prepare_step(1, 1)
    hooks.arm_counts(True)
    inspect.arm_counts(True)
    x = batch(1) * 8.0  # a jump over the recorded amax: overflows as well as underflows
    train_step(model, x, recipe)
    n = len(inspect.tensors())
    got_i = torch.zeros(2, n, dtype=torch.int64, device=DEV)
    got_h = torch.zeros(2, n, dtype=torch.int64, device=DEV)
    inspect.read_counts(got_i)
    hooks.read_counts(got_h)
    both = torch.tensor(hooks.counted, device=DEV)
    assert torch.equal(got_i[:, both], got_h[:, both])
    assert int(got_i[1].sum()) > 0 and int(got_i[0].sum()) > 0
    assert int(got_i[:, ~both].sum()) > 0  # operands only the inspection path reaches were counted
    inspect.close()
    hooks.close()


def test_staggered_counting_counts_each_module_once_per_window_at_its_own_step() -> None:
    """MonitorConfig(count_stagger=True) on TE: with an interval of 3 and three TE modules, each
    module runs its debug path at its own step of each window (the others stay on TE's fused
    path), every operand is counted once per window, and the Monitor reads the counts at the
    windows' ends, the first whole one after attach included, not at step 0."""
    model, recipe = three_te_modules()
    model.zero_grad(set_to_none=True)
    monitor = Monitor(MonitorConfig(url=None, sources=["te"], count_interval_steps=3, count_stagger=True,
                                    flush_interval_steps=100, flush_interval_s=1e6, harm_interval_steps=0,
                                    tripwire=False))
    monitor.attach(model)
    try:
        counter = monitor.sources[0]._inspect  # type: ignore[attr-defined]
        assert counter is not None and counter.module_of["ln_mlp.fc1"] == counter.module_of["ln_mlp.fc2"]
        seen: dict[int, set[str]] = {}
        real = counter.inspect

        def spying(layer: str, tensor: str, *args: Any) -> None:
            before = counter.calls
            real(layer, tensor, *args)
            if counter.calls > before:
                seen.setdefault(monitor.next_step, set()).add(layer.split(".")[0])

        counter.inspect = spying
        for step in range(7):
            loss = train_step(model, batch(step) * 8.0, recipe)
            monitor.step(loss)
            model.zero_grad(set_to_none=True)
        assert seen == {1: {"linear"}, 2: {"ln_mlp"}, 3: {"ln_linear"}, 4: {"linear"}, 5: {"ln_mlp"},
                        6: {"ln_linear"}}, seen
        assert monitor._ring is not None and monitor._ring.count_steps == [3, 6]
        assert not monitor._broken
    finally:
        monitor.close()


def test_counted_steps_keep_modules_in_bf16_off_the_debug_path() -> None:
    """Float32 parameters under torch autocast, counting every step through TE's inspection API:
    a module fallen back to BF16 (and one a probe's plan puts in BF16 mid-iteration) runs TE's
    normal path and is not counted. TE 2.20.2's debug path does not cast such a GEMM's input to
    autocast's dtype: before the fix cuBLAS refused it (``Input matrices types mismatch``, the
    heal bench's guarded run at the first counted step after its fallback)."""
    torch.manual_seed(0)
    model = nn.Sequential(te.Linear(128, 128, name="first"), te.Linear(128, 128, name="second")).to(DEV)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16), te.autocast(enabled=True, recipe=recipe):
            return model(x).float().pow(2).mean()

    x = torch.randn(64, 128, device=DEV)
    forward(x).backward()
    source = te_source.discover(model, required=True, exact_counts="inspect")
    assert source is not None and all(source.counted)
    source.set_fp8(["0"], False)
    n = len(source.tensors())
    for step in (1, 2):
        source.prepare_step(step, 1)
        source.arm_counts(True)
        forward(x * 8.0).backward()
        with torch.no_grad(), source.probe({"1": False}):  # a probe's plan, within the counted iteration
            forward(x)
    got = torch.zeros(2, n, dtype=torch.int64, device=DEV)
    source.read_counts(got)
    first = torch.tensor([s.module == "0" for s in source.tensors()], device=DEV)
    assert int(got[:, first].sum()) == 0  # in BF16: no FP8 cast, nothing counted
    assert int(got[:, ~first].sum()) > 0  # the FP8 module was counted on its training steps
    source.set_fp8(["0"], True)  # promoted: counted again
    source.prepare_step(3, 1)
    source.arm_counts(True)
    forward(x * 8.0).backward()
    source.read_counts(got)
    assert int(got[:, first].sum()) > 0
    source.close()
