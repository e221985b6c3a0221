"""The harm probe on the CPU with emulated FP8 (and torchao): paired losses that equal a direct
recomputation, no trace left in FP8 state or the RNG stream, bisection that names the module
whose FP8 cast hurts, and promotion trials."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from fp8guard.agent import Monitor, MonitorConfig, emulate_fp8  # noqa: E402
from fp8guard.agent.harm import HarmProbe  # noqa: E402
from fp8guard.agent.sources.emulation import EmulationSource  # noqa: E402
from fp8guard.agent.transport import JsonlFileTransport  # noqa: E402


class _Net(torch.nn.Module):
    """Four linears with dropout between them: enough modules to bisect, and randomness to pair."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))
        self.drop = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.drop(torch.tanh(layer(x)))
        return self.head(x)


def _setup(seed: int = 0) -> tuple[_Net, Any, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = _Net()
    fp8 = emulate_fp8(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    return model, fp8, opt, x, y


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.named_buffers()}


def _records(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    steps, events = [], []
    for line in path.read_text().splitlines():
        body = json.loads(line)
        steps += body["steps"]
        events += body["events"]
    return steps, events


def test_probe_reports_paired_losses_and_leaves_no_trace(tmp_path: Path) -> None:
    model, fp8, opt, x, y = _setup()
    path = tmp_path / "t.jsonl"
    monitor = Monitor(MonitorConfig(run_id="harm", harm_interval_steps=3, flush_interval_steps=2, tripwire=False),
                      transport=JsonlFileTransport(path))
    monitor.attach(model, opt)
    source = next(s for s in monitor.sources if isinstance(s, EmulationSource))
    for step in range(7):
        loss = _loss(model, x, y)
        loss.backward()
        fp8.update()
        if step == 6:  # the probe must leave the FP8 state and the random stream as they were
            before, rng = _buffers(model), torch.get_rng_state()
        monitor.step(loss, loss_fn=lambda: _loss(model, x, y))
        if step == 6:
            after = _buffers(model)
            assert all(torch.equal(before[k], after[k]) for k in before), "the probe changed FP8 state"
            assert torch.equal(rng, torch.get_rng_state()), "the probe moved the RNG"
            # the same two forwards, recomputed here from the same RNG state
            torch.set_rng_state(rng)
            with torch.no_grad():
                expect_fp8 = _loss(model, x, y)
                torch.set_rng_state(rng)
                with source.probe(dict.fromkeys(source.precision(), False)):
                    expect_bf16 = _loss(model, x, y)
            torch.set_rng_state(rng)
            with torch.no_grad():
                for k, b in model.named_buffers():
                    b.copy_(before[k])
        opt.step()
        opt.zero_grad()
    monitor.close()
    steps, _ = _records(path)
    probed = {s["step"]: s for s in steps if "fp8_loss_gap" in s}
    assert sorted(probed) == [3, 6]
    last = probed[6]
    assert last["loss_fp8"] == pytest.approx(float(expect_fp8), rel=1e-6)
    assert last["loss_bf16"] == pytest.approx(float(expect_bf16), rel=1e-6)
    assert last["fp8_loss_gap"] == pytest.approx((last["loss_fp8"] - last["loss_bf16"]) / last["loss_bf16"], rel=1e-5)
    assert last["loss_fp8"] != last["loss_bf16"]  # FP8 does change the loss


def test_identical_plans_give_identical_losses_despite_dropout() -> None:
    model, _, _, x, y = _setup()
    probe = HarmProbe([EmulationSource.discover(model)], interval_steps=1, band_z=4, min_gap=0.005,  # type: ignore[list-item]
                      warmup_probes=3, device=torch.device("cpu"))
    a, b = probe._losses(lambda: _loss(model, x, y), [{}, {}])
    assert torch.equal(a, b)


def _poison(model: _Net, index: int, value: float = 30.0) -> None:
    """A weight outlier in one layer. Under delayed scaling its FP8 cast first clips it to the
    E4M3 maximum at the scale the healthy weights set; once the scale follows the outlier
    (``value`` 1e5), the layer's other weights sink into E4M3's subnormals. Either way that layer,
    and only it, computes something else in FP8."""
    with torch.no_grad():
        model.layers[index].weight[0, 0] = value


def _teacher(model: _Net, x: torch.Tensor) -> torch.Tensor:
    """Targets the high-precision model fits (plus a little noise): whatever FP8 changes, it
    raises the loss, so its gap measures harm."""
    source = EmulationSource.discover(model)
    assert source is not None
    model.drop.p = 0.0
    with torch.no_grad(), source.probe(dict.fromkeys(source.precision(), False)):
        return model(x) + 0.05 * torch.randn(x.shape[0], 1)


def test_bisection_names_the_module_whose_fp8_hurts() -> None:
    model, fp8, _, x, y = _setup()
    for _ in range(3):  # scales settle on the healthy weights
        _loss(model, x, y).backward()
        fp8.update()
        model.zero_grad()
    _poison(model, 2)
    y = _teacher(model, x)
    probe = HarmProbe([EmulationSource.discover(model)], interval_steps=1, band_z=4, min_gap=0.005,  # type: ignore[list-item]
                      warmup_probes=3, device=torch.device("cpu"))
    found = probe.bisect(10, lambda: _loss(model, x, y))
    assert found is not None
    assert found.modules == ["layers.2"]
    assert found.gap > 0.05 and abs(found.gap_after) < 0.5 * found.gap
    assert found.forwards <= 2 + 2 * 3  # two for the gap, at most two per halving of 5 modules


def test_trial_says_harmful_for_the_guilty_module_only() -> None:
    model, fp8, _, x, y = _setup()
    for _ in range(3):
        _loss(model, x, y).backward()
        fp8.update()
        model.zero_grad()
    _poison(model, 1, 1e5)  # harmful even at the fresh scale a trial (and a re-promotion) starts from
    y = _teacher(model, x)
    source = EmulationSource.discover(model)
    assert source is not None
    probe = HarmProbe([source], interval_steps=1, band_z=4, min_gap=0.005, warmup_probes=3, device=torch.device("cpu"))
    source.set_fp8(["layers.1", "layers.3"], False)  # training holds both in BF16
    fn = lambda: _loss(model, x, y)  # noqa: E731
    assert probe.trial(20, fn, ["layers.1"]).harmful
    assert not probe.trial(20, fn, ["layers.3"]).harmful
    assert source.precision()["layers.1"] is False  # the trial left training's precision alone


def test_gap_out_of_band_is_attributed_and_reported(tmp_path: Path) -> None:
    model, fp8, opt, x, _ = _setup()
    y = _teacher(model, x)
    path = tmp_path / "t.jsonl"
    monitor = Monitor(MonitorConfig(run_id="harm", harm_interval_steps=2, harm_warmup_probes=3, flush_interval_steps=4,
                                    tripwire=False), transport=JsonlFileTransport(path))
    monitor.attach(model, opt)
    for step in range(16):
        if step == 9:
            _poison(model, 3, 1e5)
        loss = _loss(model, x, y)
        loss.backward()
        fp8.update()
        monitor.step(loss, loss_fn=lambda: _loss(model, x, y))
        opt.zero_grad()  # no optimizer step: the poison stays as placed
    monitor.close()
    _, events = _records(path)
    found = [e for e in events if e["kind"] == "harm_attributed"]
    assert len(found) >= 1
    first = found[0]
    # poisoned at 9, probed at 10, read (and bisected) at 11
    assert first["data"]["modules"] == ["layers.3"] and first["data"]["probe_step"] == 10 and first["step"] == 11
    assert first["data"]["gap"] > first["data"]["band_high"]


def test_torchao_modules_probe_too() -> None:
    torchao_float8 = pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    cfg = torchao_float8.Float8LinearConfig.from_recipe_name("tensorwise")
    cfg = type(cfg)(**{**cfg.__dict__, "emulate": True})
    model = torchao_float8.convert_to_float8_training(model, config=cfg)
    monitor = Monitor(MonitorConfig(sources=["torchao"], harm_interval_steps=1, tripwire=False))
    monitor.attach(model)
    x = torch.randn(8, 32)
    harm = monitor._harm
    assert harm is not None
    fp8_loss, bf16_loss, gap = harm.measure(1, lambda: model(x).pow(2).mean()).tolist()
    with torch.no_grad():
        plain = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, model[0].weight, model[0].bias)),
                                           model[2].weight, model[2].bias).pow(2).mean()
    assert bf16_loss == pytest.approx(float(plain), rel=1e-6)
    assert gap == pytest.approx((fp8_loss - bf16_loss) / bf16_loss)
    assert all(harm.precision().values())  # back in FP8 after the probe
    monitor.close()


def test_a_tripped_tripwire_probes_at_once(tmp_path: Path) -> None:
    """With probes due only every 1,000 steps, the saturation the tripwire sees makes the next
    step probe anyway: measured harm within a few steps of the anomaly, not at the next due probe."""
    model, fp8, opt, x, _ = _setup()
    y = _teacher(model, x)
    path = tmp_path / "t.jsonl"
    monitor = Monitor(MonitorConfig(run_id="harm", harm_interval_steps=1000, flush_interval_steps=4),
                      transport=JsonlFileTransport(path))
    monitor.attach(model, opt)
    for step in range(16):
        if step == 9:
            _poison(model, 3, 1e5)
        loss = _loss(model, x, y)
        loss.backward()
        fp8.update()
        monitor.step(loss, loss_fn=lambda: _loss(model, x, y))
        opt.zero_grad()
    monitor.close()
    steps, events = _records(path)
    probed = [s["step"] for s in steps if "fp8_loss_gap" in s]
    assert probed and 9 < probed[0] <= 12, probed
    found = [e for e in events if e["kind"] == "harm_attributed"]
    assert found and found[0]["data"]["modules"] == ["layers.3"] and found[0]["step"] <= 13
