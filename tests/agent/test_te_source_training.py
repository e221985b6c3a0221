"""The Transformer Engine source on a real GPU, inside training: reads and whole training steps without
a host sync, the Monitor end to end on TE TransformerLayers, BF16 fallback and re-promotion, the harm
probe, and exact counts through TE's inspection API (against the hooks, staggered per module,
modules in BF16 kept off TE's debug path).

Needs a CUDA GPU with FP8 (Hopper or newer) and ``transformer_engine`` 2.x; skips otherwise (CI has
neither). The helpers are in te_gpu_helpers.py. See docs/gpu-te-source.md.
"""

from __future__ import annotations

from typing import Any

import pytest

# first: skips this module unless a CUDA GPU runs Transformer Engine in FP8
from tests.agent.te_gpu_helpers import (
    BF16,
    DEV,
    TE_GPU_MARKS,
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    batch,
    fresh_te_state,  # noqa: F401 - autouse fixture
    nn,
    te,
    torch,
    train_step,
    two_linears,
)

pytestmark = TE_GPU_MARKS

from fp8guard.agent.config import MonitorConfig  # noqa: E402
from fp8guard.agent.monitor import Monitor  # noqa: E402
from fp8guard.agent.sources import te as te_source  # noqa: E402
from fp8guard.agent.sources.base import AMAX, HISTORY_MAX, STATS  # noqa: E402

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
