"""Tests of the DelayedScaling FP8 emulation of nn.Linear."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("torch")

import torch
import torch.nn.functional as F
from torch import nn

try:
    from fp8guard.agent.emulation import EmulationConfig, Fp8EmulatedLinear, Fp8Emulation, emulate_fp8
    from fp8guard.agent.fp8 import Fp8Format, count_overflow_underflow, qdq
except ModuleNotFoundError:  # source checkout without `pip install -e .`
    from agent.emulation import (  # type: ignore[no-redef, unused-ignore]
        EmulationConfig,
        Fp8EmulatedLinear,
        Fp8Emulation,
        emulate_fp8,
    )
    from agent.fp8 import Fp8Format, count_overflow_underflow, qdq  # type: ignore[no-redef, unused-ignore]

E4M3, E5M2 = Fp8Format.E4M3, Fp8Format.E5M2
U_E4M3 = 2.0**-4  # unit roundoff of E4M3 (3 mantissa bits)


def mlp(seed: int = 0, bias: bool = True) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 32, bias=bias), nn.ReLU(), nn.Linear(32, 32, bias=bias), nn.ReLU(), nn.Linear(32, 1)
    )


def toy_data(n: int = 128, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = torch.sin(x[:, :1]) + 0.5 * x[:, 1:2] * x[:, 2:3]
    return x, y


def step(model: nn.Module, emu: Fp8Emulation, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    torch.autograd.backward(loss)
    emu.update()
    return loss.detach()


def emulated(emu: Fp8Emulation, name: str) -> Fp8EmulatedLinear:
    return dict(emu.modules())[name]


def only_module(emu: Fp8Emulation) -> Fp8EmulatedLinear:
    ((_, mod),) = emu.modules()
    return mod


# -- config ---------------------------------------------------------------------------------------


def test_config_defaults_and_validation() -> None:
    cfg = EmulationConfig()
    assert (cfg.margin, cfg.amax_history_len, cfg.amax_compute_algo, cfg.fp8_format) == (
        0,
        1024,
        "max",
        "hybrid",
    )
    assert cfg.fwd_format is E4M3 and cfg.bwd_format is E5M2
    assert EmulationConfig(fp8_format="e4m3").bwd_format is E4M3
    with pytest.raises(ValueError, match="amax_history_len must be an int >= 1"):
        EmulationConfig(amax_history_len=0)
    with pytest.raises(ValueError, match="margin"):
        EmulationConfig(margin=1.5)  # type: ignore[arg-type, unused-ignore]
    with pytest.raises(ValueError, match="amax_compute_algo"):
        EmulationConfig(amax_compute_algo="mean")  # type: ignore[arg-type, unused-ignore]
    with pytest.raises(ValueError, match="E5M2"):
        EmulationConfig(fp8_format="e5m2")  # type: ignore[arg-type, unused-ignore]
    with pytest.raises(ValueError, match="module_filter"):
        EmulationConfig(module_filter=3)  # type: ignore[arg-type, unused-ignore]
    with pytest.raises(TypeError):
        EmulationConfig(0)  # type: ignore[misc, unused-ignore]


# -- conversion -----------------------------------------------------------------------------------


def test_apply_swaps_and_reuses_parameters() -> None:
    model = mlp()
    before = dict(model.named_parameters())
    keys_before = set(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before the swap
    emu = Fp8Emulation.apply(model, EmulationConfig(amax_history_len=4))
    names = [n for n, _ in emu.modules()]
    assert names == ["0", "2", "4"]
    assert all(model[int(n)] is m for n, m in emu.modules())
    after = dict(model.named_parameters())
    assert before.keys() == after.keys() and all(before[k] is after[k] for k in before)
    sd = model.state_dict()
    buffers = ("fp8_scale_fwd", "fp8_amax_history_fwd", "fp8_scale_bwd", "fp8_amax_history_bwd")
    fp8_keys = {f"{n}.{b}" for n in names for b in buffers}
    assert set(sd) == keys_before | fp8_keys  # counts and last-amax copies are not persistent
    mod = emulated(emu, "0")
    assert mod.fp8_scale_fwd.shape == (3,) and mod.fp8_amax_history_fwd.shape == (4, 3)
    assert mod.fp8_scale_bwd.shape == (2,) and mod.fp8_amax_history_bwd.shape == (4, 2)
    assert mod.amax_history_fwd is mod.fp8_amax_history_fwd and mod.scale_bwd is mod.fp8_scale_bwd
    # The pre-existing optimizer still drives the emulated layers.
    w0 = mod.weight.detach().clone()
    x, y = toy_data()
    step(model, emu, x, y)
    opt.step()
    assert not torch.equal(w0, mod.weight)


def test_state_dict_round_trips() -> None:
    plain_sd = copy.deepcopy(mlp().state_dict())
    model = mlp(seed=2)
    emu = emulate_fp8(model, EmulationConfig(amax_history_len=4))
    x, y = toy_data()
    step(model, emu, x, y)
    mod = emulated(emu, "0")
    # A plain nn.Linear checkpoint loads strictly; the FP8 metadata is left as it was.
    scale = mod.fp8_scale_fwd.clone()
    model.load_state_dict(plain_sd)
    assert torch.equal(mod.weight, plain_sd["0.weight"])
    assert torch.equal(mod.fp8_scale_fwd, scale)
    # An emulated checkpoint restores the FP8 metadata.
    other = mlp(seed=5)
    emulate_fp8(other, EmulationConfig(amax_history_len=4))
    other.load_state_dict(model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k


def test_apply_filter_and_errors() -> None:
    model = mlp()
    seen: list[str] = []

    def only_hidden(name: str, mod: nn.Linear) -> bool:
        seen.append(name)
        return mod.out_features == 32

    emu = emulate_fp8(model, EmulationConfig(module_filter=only_hidden))
    assert seen == ["0", "2", "4"]
    assert [n for n, _ in emu.modules()] == ["0", "2"]
    assert type(model[4]) is nn.Linear
    with pytest.raises(ValueError, match="module_filter"):
        emulate_fp8(mlp(), EmulationConfig(module_filter=lambda n, m: False))
    with pytest.raises(ValueError, match="has none"):
        emulate_fp8(nn.Sequential(nn.ReLU()))
    with pytest.raises(ValueError, match="wrap it in a container"):
        emulate_fp8(nn.Linear(2, 2))
    # Re-applying does not double-wrap: the emulated layers are no longer plain nn.Linear.
    assert [n for n, _ in emulate_fp8(model).modules()] == ["4"]


def test_shared_linear_is_replaced_everywhere_and_mha_out_proj_skipped() -> None:
    shared = nn.Linear(4, 4)
    a, b = nn.Sequential(shared), nn.Sequential(shared)
    emu = emulate_fp8(nn.ModuleDict({"a": a, "b": b}))
    mod = only_module(emu)
    assert a[0] is mod and b[0] is mod
    emu2 = emulate_fp8(nn.Sequential(nn.MultiheadAttention(4, 1), nn.Linear(4, 4)))
    assert [n for n, _ in emu2.modules()] == ["1"]  # out_proj's forward is never called by MHA


# -- numerics -------------------------------------------------------------------------------------


def test_forward_backward_match_reference() -> None:
    torch.manual_seed(3)
    emu = emulate_fp8(nn.Sequential(nn.Linear(16, 8)), EmulationConfig(amax_history_len=2))
    mod = only_module(emu)
    with torch.no_grad():
        mod.fp8_scale_fwd.copy_(torch.tensor([8.0, 300.0, 1.0]))  # non-trivial, not powers of two
        mod.fp8_scale_bwd.copy_(torch.tensor([50.0, 1.0]))
    x = (torch.randn(3, 5, 16) * 4).requires_grad_()
    out = mod(x)
    g = torch.randn_like(out)
    torch.autograd.backward(out, g)

    assert mod.bias is not None and mod.bias.grad is not None and mod.weight.grad is not None
    s = mod.fp8_scale_fwd
    xq, wq = qdq(x.detach(), s[0], E4M3), qdq(mod.weight.detach(), s[1], E4M3)
    assert torch.equal(out.detach(), F.linear(xq, wq) + mod.bias.detach())
    gq = qdq(g, mod.fp8_scale_bwd[0], E5M2)
    torch.testing.assert_close(x.grad, gq @ wq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        mod.weight.grad, gq.reshape(-1, 8).t() @ xq.reshape(-1, 16), rtol=1e-5, atol=1e-5
    )
    # The bias gradient uses the unquantized grad_output.
    torch.testing.assert_close(mod.bias.grad, g.reshape(-1, 8).sum(0))


def test_amax_recording_and_update() -> None:
    torch.manual_seed(4)
    emu = emulate_fp8(nn.Sequential(nn.Linear(6, 5)), EmulationConfig(amax_history_len=3, margin=1))
    mod = only_module(emu)
    zero = torch.tensor(0.0)
    x1 = torch.randn(4, 6)
    x2 = torch.randn(4, 6) * 3
    x2[0, 0] = float("nan")  # ignored by amax, like TE's fmaxf reduction
    mod(x1)
    out = mod(x2)  # second forward in the same step: max-accumulated
    amax_w = mod.weight.detach().abs().max()
    amax_x = torch.maximum(x1.abs().max(), x2.nan_to_num(0.0).abs().max())
    assert torch.equal(mod.amax_history_fwd[0], torch.stack([amax_x, amax_w, zero]))
    g = torch.randn_like(out) * 1e-3
    torch.autograd.backward(out, g)
    amax_g = g.abs().max()
    assert torch.equal(mod.amax_history_bwd[0], torch.stack([amax_g, zero]))
    emu.update()
    assert torch.equal(mod.last_amax_fwd, torch.stack([amax_x, amax_w, zero]))
    assert torch.equal(mod.last_amax_bwd, torch.stack([amax_g, zero]))
    assert torch.equal(mod.amax_history_fwd[0], torch.zeros(3))
    one = torch.tensor(1.0)
    torch.testing.assert_close(mod.scale_fwd, torch.stack([448.0 / amax_x / 2, 448.0 / amax_w / 2, one]))
    torch.testing.assert_close(mod.scale_bwd, torch.stack([57344.0 / amax_g / 2, one]))
    # Unused slots (output, grad_input) keep a zero history and scale 1.
    assert torch.equal(mod.amax_history_fwd[:, 2], torch.zeros(3))
    assert torch.equal(mod.amax_history_bwd[:, 1], torch.zeros(3))


def test_e4m3_format_most_recent_and_single_row_history() -> None:
    torch.manual_seed(5)
    cfg = EmulationConfig(fp8_format="e4m3", amax_history_len=1, amax_compute_algo="most_recent")
    emu = emulate_fp8(nn.Sequential(nn.Linear(4, 4)), cfg)
    mod = only_module(emu)
    assert mod.bwd_format is E4M3
    torch.autograd.backward(mod(torch.full((2, 4), 10.0)).sum())
    emu.update()
    torch.autograd.backward(mod(torch.full((2, 4), 0.5)).sum())
    emu.update()
    # The scale follows the last step only, and L == 1 still exposes the last amax.
    assert mod.last_amax_fwd[0].item() == 0.5
    assert mod.scale_fwd[0].item() == 448.0 / 0.5
    assert mod.scale_bwd[0].item() == 448.0 / mod.last_amax_bwd[0].item()  # E4M3 max in backward
    assert torch.equal(mod.amax_history_fwd, torch.zeros(1, 3))


def test_single_layer_error_within_e4m3_bound() -> None:
    # |y_fp8 - y| <= sum_i (ex_i |w_i| + |x_i| ew_i + ex_i ew_i), with the per-element FP8 error
    # ex_i <= max(u |x_i|, smallest_subnormal / 2 / scale) (u = 2**-4 for E4M3).
    torch.manual_seed(6)
    lin = nn.Linear(64, 16)
    ref = copy.deepcopy(lin)
    emu = emulate_fp8(nn.Sequential(lin))
    mod = only_module(emu)
    x = torch.randn(32, 64)
    mod(x)
    emu.update()  # calibrate the scales from the first step
    with torch.no_grad():
        y, y_ref, w = mod(x), ref(x), ref.weight.abs()
    s = mod.scale_fwd
    half_sub = E4M3.smallest_subnormal / 2
    ex = torch.maximum(U_E4M3 * x.abs(), half_sub / s[0])
    ew = torch.maximum(U_E4M3 * w, half_sub / s[1])
    bound = ex @ w.t() + x.abs() @ ew.t() + ex @ ew.t()
    assert ((y - y_ref).abs() <= bound * (1 + 1e-5) + 1e-6).all()
    rel = ((y - y_ref).norm() / y_ref.norm()).item()
    assert 0 < rel < U_E4M3


def test_mlp_trains_and_tracks_fp32() -> None:
    model = mlp()
    ref = copy.deepcopy(model)
    emu = emulate_fp8(model, EmulationConfig(amax_history_len=16))
    x, y = toy_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    losses: list[float] = []
    ref_losses: list[float] = []
    for _ in range(50):
        opt.zero_grad()
        losses.append(step(model, emu, x, y).item())
        opt.step()
        opt_ref.zero_grad()
        loss_ref = F.mse_loss(ref(x), y)
        torch.autograd.backward(loss_ref)
        opt_ref.step()
        ref_losses.append(loss_ref.item())
    assert losses[-1] < 0.5 * losses[0]
    assert losses[-1] < 2.0 * ref_losses[-1] + 1e-3
    with torch.no_grad():
        out, out_ref = model(x), ref(x)
    # Three E4M3 layers after 50 diverging steps: a few percent, under 2u per layer.
    assert ((out - out_ref).norm() / out_ref.norm()).item() < 3 * 2 * U_E4M3


def test_autocast_bf16() -> None:
    torch.manual_seed(7)
    emu = emulate_fp8(nn.Sequential(nn.Linear(8, 4)))
    mod = only_module(emu)
    x = torch.randn(3, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mod(x)
    assert out.dtype == torch.bfloat16
    torch.autograd.backward(out.float().sum())
    emu.update()
    assert x.grad is not None and x.grad.dtype == torch.float32
    assert mod.weight.grad is not None and mod.weight.grad.dtype == torch.float32


# -- fallback, reset, counts ----------------------------------------------------------------------


def test_bf16_fallback_is_plain_linear() -> None:
    model = mlp()
    emu = emulate_fp8(model, EmulationConfig(amax_history_len=4))
    x, y = toy_data()
    step(model, emu, x, y)
    emu.set_fp8(None, False)
    mods = [m for _, m in emu.modules()]
    hist = [m.amax_history_fwd.clone() for m in mods]
    scales = [m.scale_fwd.clone() for m in mods]
    model.to(torch.bfloat16)
    # FP8 metadata stays float32 whatever the parameter dtype (as in TE).
    assert all(m.scale_fwd.dtype == torch.float32 and m.amax_history_bwd.dtype == torch.float32 for m in mods)
    assert all(m.fp8_counts_fwd.dtype == torch.int64 for m in mods)
    xb = x.to(torch.bfloat16)
    out = model(xb)
    ref = xb
    for i, m in enumerate(mods):
        ref = F.linear(ref, m.weight, m.bias)
        ref = F.relu(ref) if i < 2 else ref
    assert torch.equal(out, ref)
    torch.autograd.backward(out.float().sum())
    emu.update()  # disabled modules are skipped: their state is frozen
    for m, h, s in zip(mods, hist, scales, strict=True):
        assert torch.equal(m.amax_history_fwd, h) and torch.equal(m.scale_fwd, s)
        assert not m.fp8_enabled
    # Partial re-promotion by name.
    emu.set_fp8(["2"], True)
    assert [m.fp8_enabled for m in mods] == [False, True, False]
    with pytest.raises(ValueError, match="unknown emulated module"):
        emu.set_fp8(["nope"], True)
    with pytest.raises(ValueError, match="single string"):
        emu.set_fp8("2", True)


def test_reset_fp8_state() -> None:
    model = mlp()
    emu = emulate_fp8(model, EmulationConfig(amax_history_len=4))
    x, y = toy_data()
    for _ in range(3):
        step(model, emu, x, y)
    assert all(not torch.equal(m.scale_fwd, torch.ones(3)) for _, m in emu.modules())
    emu.reset_fp8_state(["0"])
    m0 = emulated(emu, "0")
    assert torch.equal(m0.scale_fwd, torch.ones(3)) and torch.equal(m0.scale_bwd, torch.ones(2))
    assert torch.equal(m0.amax_history_fwd, torch.zeros(4, 3))
    assert torch.equal(m0.amax_history_bwd, torch.zeros(4, 2))
    assert not torch.equal(emulated(emu, "2").scale_fwd, torch.ones(3))
    emu.reset_fp8_state()
    assert all(torch.equal(m.scale_fwd, torch.ones(3)) for _, m in emu.modules())


def test_counts_are_exact_and_accumulate() -> None:
    torch.manual_seed(8)
    emu = emulate_fp8(nn.Sequential(nn.Linear(16, 8)))
    mod = only_module(emu)
    x = torch.randn(10, 16) * 50  # |x| up to ~200: overflows E4M3 at scale 4
    with torch.no_grad():
        mod.fp8_scale_fwd.copy_(torch.tensor([4.0, 1e-2, 1.0]))  # small weight scale: underflows
        mod.fp8_scale_bwd.copy_(torch.tensor([1e6, 1.0]))
    mod(x)  # counting is off by default
    assert torch.equal(mod.fp8_counts_fwd, torch.zeros(3, 2, dtype=torch.int64))
    emu.set_collect_counts(True)
    g = torch.randn(10, 8)
    for _ in range(2):
        torch.autograd.backward(mod(x), g)
    s, sb = mod.scale_fwd, mod.scale_bwd
    exp_x = count_overflow_underflow(x, s[0], E4M3) * 2
    exp_w = count_overflow_underflow(mod.weight.detach(), s[1], E4M3) * 2
    exp_g = count_overflow_underflow(g, sb[0], E5M2) * 2
    assert exp_x[0] > 0 and exp_w[1] > 0 and exp_g[0] > 0  # both kinds are exercised
    nothing = torch.zeros(2, dtype=torch.int64)
    assert torch.equal(mod.fp8_counts_fwd, torch.stack([exp_x, exp_w, nothing]))
    assert torch.equal(mod.fp8_counts_bwd, torch.stack([exp_g, nothing]))
    emu.reset_counts()
    assert mod.fp8_counts_fwd.sum().item() == 0 and mod.fp8_counts_bwd.sum().item() == 0


# -- no host sync ---------------------------------------------------------------------------------

SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__float__", "__bool__", "__int__", "__index__")


@pytest.fixture
def forbid_host_sync(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], None]]:
    """Make every tensor -> host conversion raise until the returned ``allow()`` is called."""

    def boom(name: str) -> Callable[..., Any]:
        def raiser(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"host sync: Tensor.{name} called on the per-step path")

        return raiser

    for name in SYNC_METHODS:
        monkeypatch.setattr(torch.Tensor, name, boom(name))
    yield monkeypatch.undo


def test_sync_guard_is_effective(forbid_host_sync: Callable[[], None]) -> None:
    t = torch.ones(())
    with pytest.raises(AssertionError, match="host sync"):
        t.item()
    with pytest.raises(AssertionError, match="host sync"):
        bool(t)
    forbid_host_sync()
    assert t.item() == 1.0


def test_per_step_path_never_syncs(forbid_host_sync: Callable[[], None]) -> None:
    model = mlp()
    emu = emulate_fp8(model, EmulationConfig(amax_history_len=4))
    emu.set_collect_counts(True)
    x, y = toy_data(n=32)
    x[0, 0] = float("nan")  # NaN/inf inputs take no Python branches either
    x[1, 1] = float("inf")
    for _ in range(3):
        loss = F.mse_loss(model(x), y)
        torch.autograd.backward(loss)
        emu.update()
    first = emulated(emu, "0")
    snapshot = [t.clone() for t in (first.last_amax_fwd, first.scale_fwd, first.fp8_counts_fwd)]
    emu.reset_fp8_state()
    emu.reset_counts()
    forbid_host_sync()
    # The step really ran under the guard: the first layer saw the inf input, kept its input scale
    # (amax inf -> old scale, as in TE) and counted the inf as an overflow on every step.
    last_amax, scale, counts = snapshot
    assert last_amax[0].item() == float("inf")
    assert scale[0].item() == 1.0 and scale[1].item() != 1.0
    assert counts[0, 0].item() >= 3
