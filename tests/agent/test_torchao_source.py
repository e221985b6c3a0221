"""torchao float8 (convert_to_float8_training, emulate=True on the CPU): the source's amax,
scale and counts equal torchao's own (its amax_to_scale on the same amax) and a recomputation
from the same tensors; the BF16 fallback the source owns, through the remediator."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
torchao_float8 = pytest.importorskip("torchao.float8", reason="torchao not installed (pip install 'fp8guard[torchao]')")

from torchao.float8.float8_utils import amax_to_scale  # noqa: E402

from fp8guard.agent import Monitor, MonitorConfig, NullTransport  # noqa: E402
from fp8guard.agent.commands import parse_command  # noqa: E402
from fp8guard.agent.fp8 import Fp8Format, count_overflow_underflow  # noqa: E402
from fp8guard.agent.remediation import Remediator  # noqa: E402
from fp8guard.agent.sources.base import AMAX, HISTORY_MAX, SCALE, STATS  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def _model(recipe: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    cfg = torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
    cfg = type(cfg)(**{**cfg.__dict__, "emulate": True})
    return torchao_float8.convert_to_float8_training(model, config=cfg)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_amax_scale_and_counts_match_recomputation(recipe: str) -> None:
    model = _model(recipe)
    monitor = Monitor(MonitorConfig(sources=["torchao"], count_interval_steps=1), transport=NullTransport())
    monitor.attach(model)
    source = monitor.sources[0]
    assert [t.name for t in source.tensors()][:3] == ["0:fwd_input", "0:fwd_weight", "0:bwd_grad_output"]
    seen: dict[str, torch.Tensor] = {}
    first = model[0]
    first.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].detach().clone()))
    first.register_full_backward_pre_hook(lambda m, g: seen.__setitem__("g", g[0].detach().clone()))
    x = torch.randn(8, 32) * 3
    x[0, 0] = 1e-9  # underflows in E4M3 at this scale
    model(x).pow(2).sum().backward()
    out = torch.zeros(len(STATS), len(source.tensors()))
    counts = torch.zeros(2, len(source.tensors()))
    source.read_counts(counts)
    source.read(out)
    expected = [seen["x"].abs().max(), first.weight.detach().abs().max(), seen["g"].abs().max()]
    cfg = first.config
    casts = (cfg.cast_config_input, cfg.cast_config_weight, cfg.cast_config_grad_output)
    for slot, amax in enumerate(expected):
        fmt = Fp8Format.E5M2 if casts[slot].target_dtype == torch.float8_e5m2 else Fp8Format.E4M3
        assert source.tensors()[slot].fp8_format == fmt.value
        assert out[AMAX, slot] == amax.float() and out[HISTORY_MAX, slot] == amax.float()
        # torchao's own function, bit for bit (rounds down to a power of two for rowwise)
        scale = amax_to_scale(amax, casts[slot].target_dtype, cfg.round_scales_to_power_of_2)
        assert out[SCALE, slot] == scale
    # exact counts: recompute with the same per-tensor / per-row scales
    xs = seen["x"].float()
    a = xs.abs().amax() if recipe == "tensorwise" else xs.abs().amax(dim=-1, keepdim=True)
    sc = Fp8Format.E4M3.fp8_max / a
    if cfg.round_scales_to_power_of_2:
        sc = torch.exp2(torch.floor(torch.log2(sc)))
    assert counts[:, 0].tolist() == count_overflow_underflow(xs, sc, "e4m3").float().tolist()
    assert counts[1, 0] >= 1
    # read() resets the accumulators: a step without forward reports zeros
    source.read(out)
    assert out[AMAX].abs().sum() == 0
    monitor.close()


def test_nan_input_is_visible_in_amax() -> None:
    model = _model("tensorwise")
    monitor = Monitor(MonitorConfig(sources=["torchao"]), transport=NullTransport()).attach(model)
    x = torch.randn(4, 32)
    x[1, 1] = float("nan")
    model(x).sum().backward()
    out = torch.zeros(len(STATS), len(monitor.tensors))
    monitor.sources[0].read(out)
    assert torch.isnan(out[AMAX, 0])
    monitor.close()


def test_scale_equals_torchao_where_reciprocal_times_max_in_float32_does_not() -> None:
    """torchao divides in float64; a float32 reciprocal-then-multiply is off by an ulp here."""
    from fp8guard.agent.sources.torchao import torchao_scale

    amax = torch.rand(20_000) * 100
    ours = torchao_scale(amax, 448.0, False)
    assert torch.equal(ours, amax_to_scale(amax, torch.float8_e4m3fn))
    assert not torch.equal(torch.reciprocal(amax) * 448.0, ours)  # why float64 matters


@pytest.mark.parametrize("via", ["model", "monitor_sources"])
def test_bf16_fallback_and_promotion_owned_by_the_source(via: str) -> None:
    model = _model("tensorwise")
    monitor = Monitor(MonitorConfig(sources=["torchao"]), transport=NullTransport()).attach(model)
    source = monitor.sources[0]
    remediator = Remediator(model=model) if via == "model" else Remediator(sources=monitor.sources)
    x = torch.randn(8, 32)
    fp8_out = model(x).detach()
    out = torch.zeros(len(STATS), len(source.tensors()))
    source.read(out)
    outcome = remediator.apply(parse_command({"id": 1, "kind": "fallback", "modules": ["0"]}), step=0)
    assert outcome.status == "applied", outcome.error
    plain = torch.nn.functional.linear(x, model[0].weight, model[0].bias)
    assert torch.equal(model[0](x), plain)
    model(x).sum().backward()  # trains in BF16
    source.read(out)
    # module 0 computed in BF16: nothing measured (amax 0, scale 1); module 2 still in FP8
    assert out[AMAX, :3].tolist() == [0.0, 0.0, 0.0] and out[SCALE, :3].tolist() == [1.0, 1.0, 1.0]
    assert bool((out[AMAX, 3:] > 0).all())
    outcome = remediator.apply(parse_command({"id": 2, "kind": "promote"}), step=1)
    assert outcome.status == "applied", outcome.error
    assert torch.equal(model(x), fp8_out)
    model(x).sum().backward()
    source.read(out)
    assert bool((out[AMAX] > 0).all()) and bool((out[SCALE] != 1.0).all())
    monitor.close()
