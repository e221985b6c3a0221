"""The TE source's own logic on the CPU, over a stand-in for Transformer Engine (tests/fake_te.py)
given through the source's one seam (``te_access.substitute``).

What this proves: the column layout, the delayed-scaling reads (latest amax, scale in use, history
maximum, the derived amax at history length 1), the current-scaling reads and scale formula, BF16
switching and re-promotion, and the Monitor over the source, all against TE's documented state
rules as the stand-in implements them. What it does not prove: anything about TE itself or a
GPU (tests/agent/test_te_source_*.py run the same source on a real one and skip here).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from fp8guard.agent import Monitor, MonitorConfig, NullTransport  # noqa: E402
from fp8guard.agent.sources import te, te_access  # noqa: E402
from fp8guard.agent.sources.base import AMAX, HISTORY_MAX, SCALE, STATS  # noqa: E402
from fp8guard.agent.telemetry import GRAD_NORM  # noqa: E402
from tests import fake_te  # noqa: E402

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


@pytest.fixture(autouse=True)
def _fake() -> Iterator[None]:
    fake_te.reset()
    with te_access.substitute(fake_te):
        yield
    fake_te.reset()


def stack(layers: int, hidden: int = 16) -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[fake_te.TransformerLayer(hidden, 2 * hidden, name=f"layer{i}") for i in range(layers)])


def train_step(model: Any, recipe: Any, k: int, opt: Any = None, monitor: Any = None) -> Any:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(k)) * (1 + k % 3)
    with fake_te.autocast(enabled=True, recipe=recipe):
        y = model(x)
    loss = y.pow(2).mean()
    loss.backward()
    if monitor is not None:
        monitor.step(loss)
    if opt is not None:
        opt.step()
        opt.zero_grad()
    return loss


def read(src: Any) -> Any:
    out = torch.full((len(STATS), len(src.tensors())), float("nan"))
    src.read(out)
    return out


def column(src: Any, name: str) -> int:
    return [s.name for s in src.tensors()].index(name)


def test_columns_follow_te_slot_layout() -> None:
    model = stack(1)
    train_step(model, fake_te.DelayedScaling(amax_history_len=4), 0)
    src = te.discover(model, required=True)
    assert src is not None and src.recipe_name == "DelayedScaling"
    names = [s.name for s in src.tensors()]
    # boundary slots (fwd_output, bwd_grad_input) were never used: left out under "auto"
    assert names == [
        "0.self_attention.layernorm_qkv:fwd_input", "0.self_attention.layernorm_qkv:fwd_weight",
        "0.self_attention.layernorm_qkv:bwd_grad_output",
        "0.self_attention.proj:fwd_input", "0.self_attention.proj:fwd_weight", "0.self_attention.proj:bwd_grad_output",
        "0.layernorm_mlp.fc1:fwd_input", "0.layernorm_mlp.fc1:fwd_weight", "0.layernorm_mlp.fc1:bwd_grad_output",
        "0.layernorm_mlp.fc2:fwd_input", "0.layernorm_mlp.fc2:fwd_weight", "0.layernorm_mlp.fc2:bwd_grad_output"]
    assert {(s.role.startswith("fwd"), s.fp8_max, s.fp8_format) for s in src.tensors()} == {
        (True, E4M3_MAX, "e4m3"), (False, E5M2_MAX, "e5m2")}
    assert len(te.discover(model, required=True, boundary_slots="all").tensors()) == 5 + 5 + 10


@pytest.mark.parametrize("length", [4, 1])
def test_delayed_scaling_reads_te_state(length: int) -> None:
    model = stack(2)
    recipe = fake_te.DelayedScaling(amax_history_len=length, margin=1)
    train_step(model, recipe, 0)
    src = te.discover(model, required=True)
    assert src is not None
    proj = model[1].self_attention.proj
    fwd, bwd = proj.fp8_meta["scaling_fwd"], proj.fp8_meta["scaling_bwd"]
    w, g = column(src, "1.self_attention.proj:fwd_weight"), column(src, "1.self_attention.proj:bwd_grad_output")
    scale_before = (fwd.scale[1].clone(), bwd.scale[0].clone())
    for k in range(1, 6):
        train_step(model, recipe, k)
        out = read(src)
        if length > 1:  # the latest completed amax is the history's last row
            want_w, want_g = fwd.amax_history[-1, 1], bwd.amax_history[-1, 0]
            assert torch.equal(out[HISTORY_MAX, w], fwd.amax_history[:, 1].amax())
        else:  # TE zeroed the only row: the amax comes back from the new scale
            want_w = torch.tensor(E4M3_MAX) / (fwd.scale[1] * 2.0)
            want_g = torch.tensor(E5M2_MAX) / (bwd.scale[0] * 2.0)
            assert torch.equal(out[HISTORY_MAX, w], out[AMAX, w])
        assert torch.equal(out[AMAX, w], want_w) and torch.equal(out[AMAX, g], want_g)
        assert out[AMAX, w] > 0 and out[AMAX, g] > 0
        # the scale reported is the one in use when that amax was measured: the previous read's
        assert torch.equal(out[SCALE, w], scale_before[0]) and torch.equal(out[SCALE, g], scale_before[1])
        scale_before = (fwd.scale[1].clone(), bwd.scale[0].clone())
    with torch.no_grad():
        model[1].self_attention.proj.weight.mul_(4)
    train_step(model, recipe, 6)
    if length > 1:
        assert torch.equal(read(src)[AMAX, w], model[1].self_attention.proj.weight.detach().abs().amax())


def test_current_scaling_reads_the_hooked_operands() -> None:
    model = stack(1)
    recipe = fake_te.Float8CurrentScaling()
    train_step(model, recipe, 0)
    src = te.discover(model, required=True)
    assert src is not None and src.exact_counts == "hooks"
    names = [s.name for s in src.tensors()]
    # LayerNorm outputs and the MLP's internal operands are out of a module hook's reach
    assert "0.self_attention.layernorm_qkv:fwd_input" not in names and "0.self_attention.proj:fwd_input" in names
    proj = model[0].self_attention.proj
    seen: dict[str, Any] = {}
    proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].detach().clone()))
    train_step(model, recipe, 1)
    out = read(src)
    i, w = column(src, "0.self_attention.proj:fwd_input"), column(src, "0.self_attention.proj:fwd_weight")
    assert torch.equal(out[AMAX, i], seen["x"].abs().amax())
    assert torch.equal(out[AMAX, w], proj.weight.detach().abs().amax())
    assert torch.equal(out[SCALE, i], te.te_current_scale(out[AMAX, i:i + 1], E4M3_MAX)[0])
    assert torch.equal(out[HISTORY_MAX], out[AMAX])
    # read consumed the step: an eval pass (no grad) measures nothing
    with torch.no_grad(), fake_te.autocast(enabled=True, recipe=recipe):
        model(torch.randn(4, 16))
    assert torch.equal(read(src)[AMAX], torch.zeros(len(names)))


def test_bf16_fallback_and_repromotion() -> None:
    model = stack(2)
    recipe = fake_te.DelayedScaling(amax_history_len=4)
    train_step(model, recipe, 0)
    src = te.discover(model, required=True)
    assert src is not None
    name = "1.layernorm_mlp"
    mlp = model[1].layernorm_mlp
    fp8_inside: list[bool] = []
    prepare = mlp._fp8
    mlp._fp8 = lambda: fp8_inside.append(prepare()) or fp8_inside[-1]  # what the module's forward saw
    train_step(model, recipe, 1)
    src.set_fp8([name + ".fc1"], False)  # a GEMM's name switches its whole module, as TE does
    assert src.precision()[name] is False and sum(src.precision().values()) == 5
    for k in (2, 3):
        train_step(model, recipe, k)
    out = read(src)
    cols = [i for i, s in enumerate(src.tensors()) if s.module.startswith(name)]
    others = [i for i, s in enumerate(src.tensors()) if not s.module.startswith(name)]
    assert fp8_inside == [True, False, False]
    assert torch.equal(out[AMAX, cols], torch.zeros(len(cols)))  # absent, not the stale history
    assert bool((out[AMAX, others] > 0).all())
    src.set_fp8(None, True)
    assert all(src.precision().values())
    # re-promotion starts from fresh FP8 state: the pre-fallback scale must not be reused
    assert torch.equal(mlp.fp8_meta["scaling_fwd"].scale, torch.ones(6))
    assert torch.equal(mlp.fp8_meta["scaling_fwd"].amax_history, torch.zeros(4, 6))
    train_step(model, recipe, 4)
    assert fp8_inside[-1] is True and bool((read(src)[AMAX, cols] > 0).all())


def test_monitor_over_the_fake_records_te_state_and_grad_norm() -> None:
    model = stack(3)
    recipe = fake_te.DelayedScaling(amax_history_len=8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    train_step(model, recipe, 0, opt)
    monitor = Monitor(MonitorConfig(sources=["te"], flush_interval_steps=50, count_interval_steps=0,
                                    tripwire=False, harm_interval_steps=0), transport=NullTransport())
    monitor.attach(model, opt)
    src = monitor.sources[0]
    fc2 = model[2].layernorm_mlp.fp8_meta["scaling_bwd"]
    g = column(src, "2.layernorm_mlp.fc2:bwd_grad_output")
    wanted, norms = [], []
    for k in range(1, 5):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(k))
        with fake_te.autocast(enabled=True, recipe=recipe):
            loss = model(x).pow(2).mean()
        loss.backward()
        norms.append(torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()])))
        monitor.step(loss)
        wanted.append(fc2.amax_history[-1, 2].clone())
        opt.step()
        opt.zero_grad()
    ring = monitor._ring
    assert ring is not None and len(ring) == 4 and not monitor._broken
    assert torch.equal(ring.stats[:4, AMAX, g], torch.stack(wanted))
    assert torch.allclose(ring.scalars[:4, GRAD_NORM].double(), torch.stack(norms), rtol=1e-6)
    monitor.close()


def test_seam_nests_and_restores() -> None:
    outer = te_access.load_te(required=False)  # the fixture's stand-in
    assert outer is not None and not outer.real and not te_access.inspect_importable(outer)
    with te_access.substitute(fake_te) as inner:
        assert te_access.load_te(required=False) is inner is not outer
    assert te_access.load_te(required=False) is outer


def test_delayed_scaling_hooks_only_while_counting() -> None:
    model = stack(2)
    recipe = fake_te.DelayedScaling(amax_history_len=4)
    train_step(model, recipe, 0)
    src = te.discover(model, required=True, exact_counts="hooks")
    assert src is not None and src.supports_counts

    def hooks() -> int:
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())

    assert hooks() == 0  # the reads need none: an uncounted step runs no code of fp8guard per module
    src.arm_counts(True)
    assert hooks() > 0
    train_step(model, recipe, 1)
    counts = torch.zeros(2, len(src.tensors()), dtype=torch.int64)
    src.read_counts(counts)
    src.arm_counts(False)
    assert hooks() == 0
    counted = torch.tensor(src.counted)
    assert bool((counts[:, ~counted] == 0).all())
    src.close()


def test_delayed_reader_follows_reallocated_state_and_refuses_lost_state() -> None:
    model = stack(1)
    recipe = fake_te.DelayedScaling(amax_history_len=4)
    train_step(model, recipe, 0)
    src = te.discover(model, required=True)
    assert src is not None
    read(src)
    state = model[0].layernorm_mlp.fp8_meta["scaling_fwd"]
    # TE's adjust_amax_history_length: a new, longer history tensor in place of the old one
    state.amax_history = torch.cat([torch.zeros(4, 6), state.amax_history])
    train_step(model, recipe, 1)
    w = column(src, "0.layernorm_mlp.fc1:fwd_weight")
    out = read(src)
    assert torch.equal(out[AMAX, w], state.amax_history[-1, 1])
    assert torch.equal(out[HISTORY_MAX, w], state.amax_history[:, 1].amax())
    del model[0].layernorm_mlp.fp8_meta["scaling_bwd"]  # a recipe change or a reset after attach
    with pytest.raises(RuntimeError, match="is gone"):
        read(src)


def test_probe_leaves_precision_and_te_state_as_they_were() -> None:
    model = stack(2)
    recipe = fake_te.DelayedScaling(amax_history_len=4)
    train_step(model, recipe, 0)
    train_step(model, recipe, 1)
    src = te.discover(model, required=True)
    assert src is not None
    src.set_fp8(["1.layernorm_mlp"], False)
    precision = src.precision()
    hists, scales = src._live_state()
    before = [t.clone() for t in (*hists, *scales)]
    with src.probe({"0.layernorm_mlp": False, "1.layernorm_mlp": True}):
        assert src.precision()["0.layernorm_mlp"] is False and src.precision()["1.layernorm_mlp"] is True
        with fake_te.autocast(enabled=True, recipe=recipe):  # an autocast exit that updates TE's state
            model(torch.randn(4, 16) * 100)
    assert src.precision() == precision
    assert all(torch.equal(a, b) for a, b in zip(before, (*hists, *scales), strict=True))
    out = read(src)
    cols = [i for i, s in enumerate(src.tensors()) if s.module.startswith("1.layernorm_mlp")]
    assert torch.equal(out[AMAX, cols], torch.zeros(len(cols)))  # the fallback's mask is back too


def _steps_without_autocast(model: Any, monitor: Any, n: int, recipe: Any = None) -> None:
    for k in range(n):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(k))
        if recipe is None:
            loss = model(x).pow(2).mean()
        else:
            with fake_te.autocast(enabled=True, recipe=recipe):
                loss = model(x).pow(2).mean()
        loss.backward()
        monitor.step(loss)
        model.zero_grad()


def test_stale_state_warns_once_naming_te_autocast() -> None:
    """Warmed up in FP8, then trained outside TE's autocast: TE's state never changes again, and
    the monitor says so once, naming the fix; the watching hooks are gone afterwards."""
    model = stack(2)
    train_step(model, fake_te.DelayedScaling(amax_history_len=4), 0)
    monitor = Monitor(MonitorConfig(sources=["te"], count_interval_steps=0, tripwire=False, harm_interval_steps=0),
                      transport=NullTransport())
    monitor.attach(model)
    with pytest.warns(RuntimeWarning, match=r"te\.autocast\(enabled=True, recipe=\.\.\.\).*te\.fp8_autocast") as caught:
        _steps_without_autocast(model, monitor, 12)
    assert len(caught) == 1 and "no Transformer Engine module has run a forward in FP8" in str(caught[0].message)
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 0
    monitor.close()


def test_no_stale_warning_when_te_runs_in_fp8_and_the_watch_costs_one_forward(recwarn: Any) -> None:
    model = stack(2)
    recipe = fake_te.DelayedScaling(amax_history_len=4)
    train_step(model, recipe, 0)
    monitor = Monitor(MonitorConfig(sources=["te"], count_interval_steps=0, tripwire=False, harm_interval_steps=0),
                      transport=NullTransport())
    monitor.attach(model)
    src = monitor.sources[0]
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) > 0  # armed at attach
    _steps_without_autocast(model, monitor, 1, recipe)
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 0  # gone at the first FP8 forward
    _steps_without_autocast(model, monitor, 11, recipe)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert src.stale_reason() is None  # type: ignore[attr-defined]
    src.set_fp8(None, False)  # every module in BF16 on purpose: nothing to warn about either
    assert src.stale_reason() is None  # type: ignore[attr-defined]
    monitor.close()


@pytest.mark.parametrize("recipe", [fake_te.Float8CurrentScaling(), fake_te.DelayedScaling(amax_history_len=4)],
                         ids=["current", "delayed_counting"])
def test_the_fp8_watch_rides_on_the_sources_one_pre_hook_per_module(recipe: Any) -> None:
    """Measuring (current scaling) or counting (delayed) and watching for the first FP8 forward
    at once: every TE module carries one forward pre-hook, the source's; the watch leaves the
    hooks that measuring or counting still needs."""
    model = stack(2)
    train_step(model, recipe, 0)
    src = te.discover(model, required=True, exact_counts="hooks")
    assert src is not None

    def pre_hooks() -> list[int]:
        return [len(m._forward_pre_hooks) for m in model.modules() if m._forward_pre_hooks]

    src.arm_counts(True)
    before = pre_hooks()
    src.prepare_step(0, 1)  # the watch starts
    watching = pre_hooks()
    assert watching and set(watching) == {1}, watching
    train_step(model, recipe, 1)  # an FP8 forward: the watch ends
    assert pre_hooks() == before and src.stale_reason() is None
    src.close()
    assert pre_hooks() == []


def test_stale_reason_is_quiet_when_every_module_fell_back_to_bf16() -> None:
    model = stack(1)
    train_step(model, fake_te.DelayedScaling(amax_history_len=4), 0)
    src = te.discover(model, required=True)
    assert src is not None
    src.prepare_step(0, 0)
    src.set_fp8(None, False)
    assert src.stale_reason() is None
    src.set_fp8(None, True)
    assert src.stale_reason() is not None and "te.autocast(enabled=True" in src.stale_reason()  # type: ignore[operator]
    src.close()


def test_reallocated_state_is_seen_within_the_rotation_and_at_once_after_a_checkpoint_load() -> None:
    """TE's tensors are checked a fixed number of entries per read (not every module every step):
    a history TE reallocates mid-run is followed within ceil(entries / _VERIFY_PER_READ) reads,
    reading the old (still held) tensor until then; after ``load_state_dict`` at the next read."""
    from fp8guard.agent.sources import te_delayed

    layers = 12
    model = stack(layers)
    recipe = fake_te.DelayedScaling(amax_history_len=4)
    train_step(model, recipe, 0)
    src = te.discover(model, required=True)
    assert src is not None
    entries = 6 * layers  # three modules per layer, forward and backward states
    rotation = -(-entries // te_delayed._VERIFY_PER_READ)
    assert rotation == 3
    w = column(src, f"{layers - 1}.layernorm_mlp.fc1:fwd_weight")  # the last entries: checked last

    def reallocate() -> Any:
        state = model[layers - 1].layernorm_mlp.fp8_meta["scaling_fwd"]
        state.amax_history = state.amax_history.clone() + 1.0  # as adjust_amax_history_length: a new tensor
        return state.amax_history

    read(src)  # the rotation now starts at entry 32
    new = reallocate()
    seen_at = None
    for k in range(1, rotation + 1):
        out = read(src)
        if torch.equal(out[AMAX, w], new[-1, 1]):
            seen_at = k
            break
        assert not torch.equal(out[AMAX, w], new[-1, 1])  # the old tensor, still held: stale, never invalid
    assert seen_at is not None and seen_at <= rotation
    newer = reallocate()
    model.load_state_dict(model.state_dict())  # a checkpoint load: every entry is checked at the next read
    out = read(src)
    assert torch.equal(out[AMAX, w], newer[-1, 1]) and torch.equal(out[HISTORY_MAX, w], newer[:, 1].amax())
    src.close()
    assert not any(m._load_state_dict_post_hooks for m in model.modules())
