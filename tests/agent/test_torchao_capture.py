"""The torchao source reading back torchao's own amaxes (emulate=True on the CPU): the values of
the hooks it replaces and of a recomputation from the same tensors, bit for bit, over
micro-batches and NaN; no op in forward or backward, the same ops in ``read`` whatever the
number of casts; no host sync; the hooks fallback and the count hooks only while counting."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
torchao_float8 = pytest.importorskip("torchao.float8", reason="torchao not installed (pip install 'fp8guard[torchao]')")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torchao.float8.float8_utils import amax_to_scale  # noqa: E402

from fp8guard.agent.sources import torchao as tsrc  # noqa: E402
from fp8guard.agent.sources import torchao_capture as capture  # noqa: E402
from fp8guard.agent.sources.base import AMAX, HISTORY_MAX, SCALE, STATS  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
RECIPES = ["tensorwise", "rowwise"]


def _model(recipe: str, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for i in range(layers):
        mods += [torch.nn.Linear(32, 32), torch.nn.ReLU()] if i < layers - 1 else [torch.nn.Linear(32, 16)]
    cfg = torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
    cfg = type(cfg)(**{**cfg.__dict__, "emulate": True})
    return torchao_float8.convert_to_float8_training(torch.nn.Sequential(*mods), config=cfg)


def _source(model: torch.nn.Module, **kw: Any) -> tsrc.TorchaoSource:
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, tsrc.Float8Linear)]
    return tsrc.TorchaoSource(found, **kw)


def _read(source: tsrc.TorchaoSource) -> torch.Tensor:
    out = torch.zeros(len(STATS), len(source.tensors()))
    source.read(out)
    return out


def _step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).pow(2).sum().backward()


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def sources() -> Iterator[list[tsrc.TorchaoSource]]:
    made: list[tsrc.TorchaoSource] = []
    yield made
    for s in made:
        s.close()


@pytest.mark.parametrize("recipe", RECIPES)
def test_torchao_amaxes_equal_the_hooks_and_a_recomputation(recipe: str, sources: list[Any]) -> None:
    model = _model(recipe)
    read_back, hooks = _source(model), _source(model, capture=False)
    sources += [read_back, hooks]
    assert (read_back.measure, read_back.capture_unavailable, hooks.measure) == ("torchao", None, "hooks")
    seen: dict[str, list[torch.Tensor]] = {"x": [], "g": []}
    last = model[2]
    last.register_forward_pre_hook(lambda m, a: seen["x"].append(a[0].detach().clone()))
    last.register_full_backward_pre_hook(lambda m, g: seen["g"].append(g[0].detach().clone()))
    # two micro-batches of different size: the step's amax is the larger one
    for scale in (3.0, 40.0):
        _step(model, torch.randn(8, 32) * scale)
    ours, theirs = _read(read_back), _read(hooks)
    assert torch.equal(ours, theirs)
    expected = [max(t.abs().max() for t in seen["x"]), last.weight.detach().abs().max(),
                max(t.abs().max() for t in seen["g"])]
    cfg = last.config
    casts = (cfg.cast_config_input, cfg.cast_config_weight, cfg.cast_config_grad_output)
    for role, amax in enumerate(expected):
        col = 3 + role
        assert ours[AMAX, col] == amax.float() and ours[HISTORY_MAX, col] == amax.float()
        assert ours[SCALE, col] == amax_to_scale(amax, casts[role].target_dtype, cfg.round_scales_to_power_of_2)
    assert read_back._sink.captures == 2 * 2 * 6  # every cast of 2 modules in 2 micro-batches, read back
    assert _read(read_back)[AMAX].abs().sum() == 0  # read() folds and resets


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("where", ["input", "grad"])
def test_nan_stays_visible(recipe: str, where: str, sources: list[Any]) -> None:
    model = _model(recipe)
    source = _source(model)
    sources.append(source)
    x = torch.randn(4, 32)
    if where == "input":
        x[1, 1] = float("nan")
        _step(model, x)
    else:
        out = model(x)
        grad = torch.ones_like(out)
        grad[2, 3] = float("nan")
        out.backward(grad)
    out = _read(source)
    col = 0 if where == "input" else 5  # module 0's input, module 2's grad_output
    assert torch.isnan(out[AMAX, col]) and torch.isnan(out[SCALE, col])
    if where == "grad":
        assert not torch.isnan(out[AMAX, :2]).any()  # the forward of module 0 saw no NaN


def test_no_op_in_forward_and_backward_and_the_same_ops_in_read(sources: list[Any]) -> None:
    model = _model("rowwise", layers=3)
    x = torch.randn(8, 32)

    def counted(fn: Any) -> list[str]:
        with OpCount() as mode:
            fn()
        return mode.ops

    _step(model, x)  # gradients exist from here on: later steps accumulate the same way
    plain = counted(lambda: _step(model, x))
    hooks = _source(model, capture=False)
    assert len(counted(lambda: _step(model, x))) > len(plain)  # the counter sees hook work
    hooks.close()
    source = _source(model)
    sources.append(source)
    assert counted(lambda: _step(model, x)) == plain  # torchao's ops alone
    _read(source)
    reads = []
    for micro in (4, 1, 4, 1):  # warm from the third: the buffer grown, each gather table built once
        for _ in range(micro):
            _step(model, x)
        reads.append(counted(lambda: _read(source)))
    assert reads[2] == reads[3]  # 18 casts or 72: the same launches


@pytest.mark.parametrize("recipe", RECIPES)
def test_early_fold_keeps_the_values(recipe: str, sources: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(recipe)
    folding, once = _source(model), _source(model, capture=False)
    sources += [folding, once]
    monkeypatch.setattr(capture, "_FOLD_AT", 5)
    for scale in (1.0, 7.0, 2.0):
        _step(model, torch.randn(8, 32) * scale)
        assert folding._sink.held < 5
    assert torch.equal(_read(folding), _read(once))


def test_probe_forwards_are_not_telemetry(sources: list[Any]) -> None:
    model = _model("tensorwise")
    source = _source(model)
    sources.append(source)
    with source.probe({"0": False}), torch.no_grad():
        model(torch.randn(4, 32) * 100)
    assert source._sink.captures == 0 and _read(source)[AMAX].abs().sum() == 0
    assert tsrc.in_fp8(model[0])  # back in FP8 after the probe


def test_no_host_sync_on_the_per_step_path(sources: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model("rowwise")
    source = _source(model)
    sources.append(source)
    x = torch.randn(8, 32)
    x[0, 0] = float("nan")

    def raiser(*a: Any, **k: Any) -> Any:
        raise AssertionError("host sync on the per-step path")

    for name in ("item", "tolist", "cpu", "numpy", "__float__", "__bool__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, raiser)
    with pytest.raises(AssertionError, match="host sync"):
        bool(torch.ones(()))
    for _ in range(2):
        _step(model, x)
        out = _read(source)
    monkeypatch.undo()
    assert torch.isnan(out[AMAX, 0]) and source._sink.captures == 2 * 2 * 6


def test_count_hooks_only_while_counting(sources: list[Any]) -> None:
    model = _model("tensorwise")
    source = _source(model)
    sources.append(source)
    assert not model[0]._forward_pre_hooks and not model[0]._backward_pre_hooks
    source.arm_counts(True)
    assert model[0]._forward_pre_hooks and model[0]._backward_pre_hooks
    x = torch.randn(8, 32) * 3
    x[0, 0] = 1e-9  # underflows in E4M3
    _step(model, x)
    counts = torch.zeros(2, len(source.tensors()))
    source.read_counts(counts)
    assert counts[1, 0] >= 1
    source.arm_counts(False)
    assert not model[0]._forward_pre_hooks and not model[0]._backward_pre_hooks
    assert source._sink.captures == 12 and source._forwards == 2  # amaxes still torchao's; hooks counted


def test_shared_mm_config_falls_back_to_hooks(sources: list[Any]) -> None:
    model = _model("tensorwise")
    model[2].linear_mm_config = model[0].linear_mm_config
    source = _source(model)
    sources.append(source)
    assert source.measure == "hooks" and "share a linear_mm_config" in (source.capture_unavailable or "")
    _step(model, torch.randn(4, 32))
    assert bool((_read(source)[AMAX] > 0).all())


def test_stale_reason_close_and_unwrapped(sources: list[Any]) -> None:
    model = _model("tensorwise")
    source = _source(model)
    sources.append(source)
    assert "no torchao Float8Linear has cast" in (source.stale_reason() or "")
    source._sink.add(0, torch.nn.Parameter(torch.ones(())))  # not a plain tensor (as a traced cast's)
    assert source._sink.captures == 0 and "1 casts were not plain tensors" in (source.stale_reason() or "")
    with capture.unwrapped():
        _step(model, torch.randn(4, 32))
    assert source._sink.captures == 0
    _step(model, torch.randn(4, 32))
    assert source._sink.captures == 12 and source.stale_reason() is None
    source.close()
    _step(model, torch.randn(4, 32))
    assert source._sink.captures == 12 and not source._sink.held


def test_fold_of_mixed_dtypes_shapes_and_nan_equals_a_loop() -> None:
    """bf16 and float32 amaxes (autocast: bf16 activations, float32 weights), 0-d (tensorwise) and
    per-row/per-column (rowwise), a NaN, columns without a cast and micro-batches: the fold
    equals a running max per column computed one tensor at a time."""
    torch.manual_seed(1)
    amax = torch.zeros(9)
    sink = capture.AmaxSink(amax)
    ref = torch.zeros(9)
    shapes = [(), (5, 1), (1, 7), ()]
    for micro in range(3):
        for i in range(12):
            slot = (3 * i + micro) % 8  # column 8 never cast
            dtype = torch.bfloat16 if i % 3 else torch.float32
            t = (torch.rand(shapes[i % 4]) * 10 ** (i % 5)).to(dtype)
            if micro == 1 and i == 7:
                t.view(-1)[0] = float("nan")
            sink.add(slot, t)
            m = t.max().float()
            ref[slot] = m if torch.isnan(m) else torch.maximum(ref[slot], m)
        sink.fold()
    assert torch.equal(amax.nan_to_num(-1.0), ref.nan_to_num(-1.0)) and bool(torch.isnan(amax).any())
    assert amax[8] == 0 and sink.held == 0


def test_two_sources_and_a_foreign_wrapper_on_top(sources: list[Any]) -> None:
    """A wrapper installed over fp8guard's (another tool's, as the bench's TorchaoCasts) and a source
    created after it: no recursion, every source gets each cast once, closing one leaves the other."""
    import torchao.float8.float8_linear as fl

    model = _model("tensorwise")
    first = _source(model)
    sources.append(first)
    ours = fl.hp_tensor_to_float8_dynamic
    calls: list[int] = []

    def foreign(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return ours(*a, **k)

    fl.hp_tensor_to_float8_dynamic = foreign
    try:
        second = _source(model)  # wraps the foreign wrapper, which calls fp8guard's first wrapper
        sources.append(second)
        _step(model, torch.randn(4, 32))
        assert len(calls) == 12 and first._sink.captures == second._sink.captures == 12
        assert torch.equal(_read(first), _read(second))
        first.close()
        _step(model, torch.randn(4, 32))
        assert first._sink.captures == 12 and second._sink.captures == 24
    finally:
        fl.hp_tensor_to_float8_dynamic = ours
