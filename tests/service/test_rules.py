"""Detection rules and the detector: pure functions against synthetic traces."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from fp8guard.service.domain import Finding, StatBlock, StepRow
from fp8guard.service.kinds import Rule, Severity
from fp8guard.service.loop import Detector, GuardConfig, RunView, TensorMeta, decide, promotions, rules


def test_block_growth_equals_step_by_step() -> None:
    rng = np.random.default_rng(0)
    amax = np.exp(rng.normal(size=(300, 5)))
    amax[5:40, 2] = np.inf
    amax[:20, 3] = 0.0
    amax[100:, 4] *= np.linspace(1, 1000, 200)
    for seen0 in (0, 5):
        fast = rng.normal(size=5) if seen0 else np.zeros(5)
        slow, seen = fast.copy(), np.full(5, seen0)
        f, s, n = fast.copy(), slow.copy(), seen.copy()
        traj = []
        for t in range(amax.shape[0]):
            f, s, n, _ = rules.amax_growth(f, s, n, amax[t])
            traj.append((f, s))
        bf, bs, bn = rules.amax_growth_block(fast, slow, seen, amax)
        # equal wherever the amax was measured (the only steps a rule looks at) and at the end
        measured = np.isfinite(amax) & (amax > 0) & (np.cumsum(np.isfinite(amax) & (amax > 0), axis=0) > 0)
        np.testing.assert_allclose(bf[measured], np.array([t[0] for t in traj])[measured], atol=1e-3)
        np.testing.assert_allclose(bs[measured], np.array([t[1] for t in traj])[measured], atol=1e-3)
        np.testing.assert_allclose(bf[-1], traj[-1][0], atol=1e-3)
        assert (bn[-1] == n).all()


def test_consecutive_block_equals_step_by_step() -> None:
    rng = np.random.default_rng(1)
    over = rng.random((50, 6)) > 0.3
    run = np.array([0, 3, 0, 7, 1, 0])
    ref, r = [], run.copy()
    for t in range(50):
        r = rules.consecutive(r, over[t])
        ref.append(r)
    np.testing.assert_array_equal(rules.consecutive(run, over), np.array(ref))


def test_robust_spike_ignores_noise_and_warmup() -> None:
    rng = np.random.default_rng(2)
    hist = list(2.5 + 0.05 * rng.normal(size=64))
    assert rules.robust_spike(hist[:5], 9.0, z=8, min_rise=0.25, warmup=20) is None  # warm-up
    assert rules.robust_spike(hist, 2.6, z=8, min_rise=0.25, warmup=20) is None  # noise
    spike = rules.robust_spike(hist, 4.0, z=8, min_rise=0.25, warmup=20)
    assert spike is not None and spike.rise > 0.5
    flat = [1.0] * 64  # MAD = 0 must not make every wiggle a spike
    assert rules.robust_spike(flat, 1.001, z=8, min_rise=0.25, warmup=20) is None


def _metas(n: int) -> list[TensorMeta]:
    return [TensorMeta(name=f"l{i // 2}:{'bwd_grad_output' if i % 2 else 'fwd_input'}", module=f"l{i // 2}",
                       backward=bool(i % 2)) for i in range(n)]


def _block(steps: list[int], sat: np.ndarray, amax: np.ndarray | None = None) -> StatBlock:
    amax = np.ones_like(sat) if amax is None else amax
    vals = np.stack([amax, np.ones_like(sat), sat, amax], axis=1).astype(np.float32)
    return StatBlock(stats=("amax", "scale", "saturation", "amax_history_max"), steps=np.asarray(steps), values=vals)


def test_healthy_saturation_levels_never_fire() -> None:
    """Forward ratios of 1.0-1.2 and backward up to ~4 on hundreds of steps are healthy TE runs."""
    rng = np.random.default_rng(3)
    det = Detector(GuardConfig(), _metas(8))
    steps = list(range(1500))
    sat = np.where(np.arange(8) % 2, rng.uniform(0.5, 4.0, (1500, 8)), rng.uniform(0.8, 1.2, (1500, 8)))
    loss = 3.0 * np.exp(-np.arange(1500) / 700) + 0.05 * rng.normal(size=1500) + 1.0
    rows = [StepRow(step=s, loss=float(loss[s]), grad_norm=float(1 + 0.1 * rng.random())) for s in steps]
    found = []
    for lo in range(0, 1500, 100):
        found += det.observe(rows[lo:lo + 100], [_block(steps[lo:lo + 100], sat[lo:lo + 100])])
    assert found == []


def test_sustained_saturation_fires_once_with_evidence() -> None:
    det = Detector(GuardConfig(), _metas(4))
    sat = np.ones((40, 4))
    sat[10:, 2] = 5.0  # forward tensor of module l1 clips 5x for 30 steps
    found = det.observe([], [_block(list(range(40)), sat)])
    assert [f.rule for f in found] == ["saturation"]
    f = found[0]
    assert f.modules == ("l1",) and f.onset_step == 10 and f.step == 19 and f.evidence["ratios"] == [5.0]
    assert "l1:fwd_input" in f.explanation


def test_state_survives_a_restart() -> None:
    cfg = GuardConfig()
    sat = np.ones((20, 2))
    sat[:, 0] = 3.0
    a = Detector(cfg, _metas(2))
    assert a.observe([], [_block(list(range(6)), sat[:6])]) == []
    b = Detector(cfg, _metas(2), a.state_dict())  # "service restart"
    found = b.observe([], [_block(list(range(6, 20)), sat[6:])])
    assert [f.onset_step for f in found] == [0]


def test_nonfinite_and_loss_spike() -> None:
    det = Detector(GuardConfig(warmup_steps=10), _metas(2))
    rows = [StepRow(step=s, loss=2.0 + 0.01 * (s % 3), grad_norm=1.0) for s in range(30)]
    rows.append(StepRow(step=30, loss=6.0, grad_norm=1.0))
    rows.append(StepRow(step=31, loss=math.nan, grad_norm=math.inf))
    found = det.observe(rows, [])
    assert [f.rule for f in found] == ["loss_spike", "nonfinite"]
    assert found[0].step == 30 and found[1].severity == "critical"


def test_amax_growth_fires_before_saturation() -> None:
    det = Detector(GuardConfig(), _metas(2))
    amax = np.ones((300, 2))
    amax[150:, 0] = np.exp2(np.linspace(0, 8, 150))  # 256x over 150 steps
    found = det.observe([], [_block(list(range(300)), np.ones((300, 2)), amax)])
    # a steady 3.8 %-per-step climb: the ramp rule names it first, the fast/slow growth rule later
    assert {f.modules for f in found} == {("l0",)}
    rules_in_order = [f.rule for f in found]
    assert rules_in_order[0] == "amax_ramp" and "amax_growth" in rules_in_order
    assert found[0].step - 150 <= 50


def test_policy_rollback_fallback_escalation_and_promotion() -> None:
    cfg = GuardConfig(rollback_margin_steps=10, skip_batches=100, escalate_rollbacks=2, promote_after_steps=50)
    det = Detector(cfg, _metas(2))
    spike = det.observe([StepRow(step=s, loss=2.0) for s in range(30)] + [StepRow(step=30, loss=50.0)], [])
    view = RunView(step=30, modules=["l0"], bf16={}, rollback_pending=False, known_good=[0, 10, 25],
                   recent_rollbacks=[])
    d = decide(spike, view, cfg)
    assert d[0].kind == "rollback" and d[0].checkpoint_step == 10
    assert d[0].skip_batches == 30 - 10 + 100
    escalated = decide(spike, RunView(step=30, modules=["l0"], bf16={}, rollback_pending=False, known_good=[10],
                                      recent_rollbacks=[5, 20]), cfg)
    # a loss spike with no FP8 anomaly: BF16 cures nothing, the escalation is a page alone
    assert [x.kind for x in escalated] == ["page"] and "no BF16 fallback" in escalated[0].reason
    sat = Finding(rule=Rule.SATURATION, severity=Severity.WARNING, step=30, onset_step=21, modules=("l0",),
                  explanation="l0 clipped")
    escalated = decide([*spike, sat], RunView(step=30, modules=["l0"], bf16={}, rollback_pending=False,
                                              known_good=[10], recent_rollbacks=[5, 20]), cfg)
    assert [x.kind for x in escalated] == ["fallback", "page"] and escalated[0].modules is None and escalated[0].escalation
    promo = promotions(RunView(step=100, modules=["l0", "l1"], bf16={"l0": 40, "l1": 80}, rollback_pending=False,
                               known_good=[], recent_rollbacks=[], pinned=frozenset()), cfg)
    assert promo[0].modules == ("l0",)


@pytest.mark.parametrize("dry_run", [True, False])
def test_guard_config_validation(dry_run: bool) -> None:
    assert GuardConfig(dry_run=dry_run).dry_run is dry_run
    with pytest.raises(ValueError, match="saturation_fwd"):
        GuardConfig(saturation_fwd=0.5)
    with pytest.raises(ValueError, match="extra"):
        GuardConfig.model_validate({"nonsense": 1})


def _history_block(amax: np.ndarray, history: int = 1024) -> StatBlock:
    """Stats as a delayed-scaling source reports them: the history max over the last ``history`` steps."""
    hist_max = np.stack([amax[max(0, t - history + 1):t + 1].max(axis=0) for t in range(amax.shape[0])])
    sat = amax / hist_max
    vals = np.stack([amax, 448.0 / hist_max, sat, hist_max], axis=1).astype(np.float32)
    return StatBlock(stats=("amax", "scale", "saturation", "amax_history_max"), steps=np.arange(amax.shape[0]),
                     values=vals)


def test_stale_scale_fires_after_a_single_outlier_pins_the_history() -> None:
    """One outlier of 10,000x in step 100: the 1,024-step history keeps the scale pinned."""
    rng = np.random.default_rng(5)
    amax = np.exp(0.3 * rng.normal(size=(300, 4)))  # healthy: amax wobbles around 1
    amax[100, 2] = 1e4
    det = Detector(GuardConfig(), _metas(4))
    found = det.observe([], [_history_block(amax)])
    # one finding when the episode reaches stale_scale_steps, then one per cooldown while it lasts
    assert {f.rule for f in found} == {"stale_scale"} and {f.modules for f in found} == {("l1",)}
    assert [g.step for g in found] == list(range(120, 300, GuardConfig().cooldown_steps))
    f = found[0]
    assert f.modules == ("l1",) and f.step == 100 + GuardConfig().stale_scale_steps
    assert f.evidence["tensors"] == ["l1:fwd_input"] and f.evidence["history_over_amax"][0] > 256
    # the policy falls that module back to BF16 (its later re-promotion resets the FP8 state)
    d = decide(found, RunView(step=f.step, modules=["l0", "l1", "l2", "l3"], bf16={}, rollback_pending=False, known_good=[],
                              recent_rollbacks=[]), GuardConfig())
    assert [(x.kind, x.modules) for x in d] == [("fallback", ("l1",))]


def test_stale_scale_quiet_on_healthy_decay_and_in_bf16() -> None:
    rng = np.random.default_rng(6)
    # amax halving over the run (weights decaying, gradients shrinking) stays well inside 256x
    amax = np.exp(0.3 * rng.normal(size=(1500, 4))) * np.exp2(-np.linspace(0, 4, 1500))[:, None]
    assert Detector(GuardConfig(), _metas(4)).observe([], [_history_block(amax)]) == []
    # a module in BF16 reports amax 0: never "pinned"
    amax2 = np.ones((200, 2))
    amax2[50, 0] = 1e4
    amax2[51:, 0] = 0.0
    assert Detector(GuardConfig(), _metas(2)).observe([], [_history_block(amax2)]) == []


def test_cooldown_is_per_module_so_a_second_module_is_not_swallowed() -> None:
    """Two modules' amax climbs, the second crossing the line a few steps after the first: each
    gets its own finding (a rule-wide quiet period would leave the second in FP8 for 50 steps)."""
    det = Detector(GuardConfig(), _metas(4))
    amax = np.ones((300, 4))
    amax[150:, 0] = np.exp2(np.minimum(np.arange(150) * 0.8, 20))  # module l0 climbs first
    amax[156:, 2] = np.exp2(np.minimum(np.arange(144) * 0.8, 20))  # l1, six steps later
    found = []
    for lo in range(0, 300, 5):  # batches of 5 steps, as the agent flushes them
        found += det.observe([], [_block(list(range(lo, lo + 5)), np.ones((5, 4)), amax[lo:lo + 5])])
    growth = [f for f in found if f.rule == "amax_growth"]
    assert [f.modules for f in growth[:2]] == [("l0",), ("l1",)]
    assert growth[1].step - growth[0].step < GuardConfig().cooldown_steps
    # each module's own quiet period holds: its next finding comes a cooldown later at the earliest
    for m in ("l0", "l1"):
        at = [f.step for f in growth if f.modules == (m,)]
        assert all(b - a >= GuardConfig().cooldown_steps for a, b in itertools.pairwise(at))


def _healthy_block(rng: np.random.Generator, steps: int = 40, tensors: int = 6) -> np.ndarray:
    level = np.exp(rng.normal(size=tensors))
    return (level * np.exp(rng.normal(0.0, 0.05, size=(steps, tensors)))).astype(np.float32)


def test_healthy_block_fast_paths_equal_the_step_by_step_rules() -> None:
    """The rules skip their per-step branches when every value is measured (a healthy block);
    a column that is not (zero or non-finite amax, a NaN history) sends the whole block down
    the general path, and columns are independent, so the healthy columns must come out
    bit-for-bit the same either way: the same decisions whatever path a block takes."""
    rng = np.random.default_rng(7)
    amax = _healthy_block(rng)
    n = amax.shape[1]
    f0, s0 = rng.normal(size=n).astype(np.float32), rng.normal(size=n).astype(np.float32)
    seen0 = np.full(n, 12, dtype=np.int64)
    bad = np.hstack([amax, np.zeros((amax.shape[0], 1), np.float32)])  # one unmeasured tensor
    pad = lambda a, v: np.append(a, np.array([v], dtype=a.dtype))  # noqa: E731

    fast = rules.amax_growth_steps(f0, s0, seen0, amax)
    general = rules.amax_growth_steps(pad(f0, 0.0), pad(s0, 0.0), pad(seen0, 3), bad)
    for a, b in zip(fast, general, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b[:, :n])

    last0 = np.log2(amax[0] * 1.01).astype(np.float32)
    d0, r0 = rng.normal(0, 0.01, size=n).astype(np.float32), rng.uniform(size=n).astype(np.float32)
    fast = rules.ramp_steps(last0, d0, r0, amax[1:], alpha=0.1)
    general = rules.ramp_steps(pad(last0, np.nan), pad(d0, 0.0), pad(r0, 0.0), bad[1:], alpha=0.1)
    for a, b in zip(fast, general, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b[:, :n])

    over = amax > np.median(amax)
    quiet = np.zeros_like(over)
    run0 = rng.integers(0, 4, size=n)
    assert np.array_equal(rules.consecutive(run0, quiet), rules.consecutive(pad(run0, 0), np.hstack(
        [quiet, np.ones((quiet.shape[0], 1), bool)]))[:, :n])

    # the amax history's maximum: held for a while, then a new outlier, then decaying steps
    hist = np.repeat(amax[:1] * 4, amax.shape[0], axis=0)
    hist[15:] *= 3
    hist[30:] = amax[30:] * 2
    meta = [TensorMeta(name=f"m{i // 2}:{i}", module=f"m{i // 2}", backward=False) for i in range(n + 1)]
    steps = np.arange(100, 100 + amax.shape[0])
    healthy, mixed = Detector(GuardConfig(), meta[:n]), Detector(GuardConfig(), meta)
    hist_nan = np.hstack([hist, np.full((hist.shape[0], 1), np.nan, np.float32)])
    hist_nan[3, n] = 1.0
    for lo, hi in ((0, 7), (7, 40)):  # two batches: the state carries across
        got = healthy._pinned_since(steps[lo:hi], hist[lo:hi])
        want = mixed._pinned_since(steps[lo:hi], hist_nan[lo:hi])
        assert np.array_equal(got, want[:, :n], equal_nan=True)
    assert np.array_equal(healthy.hist_last, mixed.hist_last[:n]) and \
        np.array_equal(healthy.hist_since, mixed.hist_since[:n], equal_nan=True)


def _under(steps: list[int], values: np.ndarray) -> StatBlock:
    return StatBlock(stats=("underflows",), steps=np.asarray(steps), values=values.astype(np.float32)[:, None, :])


def test_a_standing_underflow_growth_raised_again_keeps_its_onset() -> None:
    """Underflow growth that goes on past the cooldown is raised again, dated from the check that
    began it: a new onset at each raise would take the known-good mark from every checkpoint near
    it (no onset may fall within the margin), sending a rollback back through the whole standing
    condition (an H100 heal run went back 102 steps instead of 27, docs/gpu.md). A tensor whose run
    is new makes the finding new; a rollback ends the abandoned timeline's runs."""
    cfg = GuardConfig(cooldown_steps=30)
    det = Detector(cfg, _metas(4))
    checks = list(range(0, 300, 10))  # a count every 10th step
    under = np.full((len(checks), 4), 500.0)
    under[12:, 3] = 100_000.0  # l1's gradient from the check of step 120 on
    found = det.observe([], [_under(checks, under)])
    raised = [(f.step, f.onset_step) for f in found if f.rule is Rule.UNDERFLOW_GROWTH]
    assert raised[0] == (140, 120) and len(raised) >= 3
    assert all(onset == 120 for _, onset in raised)
    # the state carries the run's start over a restart; another tensor's new run dates the finding
    again = Detector(cfg, _metas(4), det.state_dict())
    more = np.tile(np.array([500.0, 500.0, 500.0, 100_000.0]), (6, 1))
    more[2:, 1] = 100_000.0  # l0's gradient from the check of step 320 on
    later = [(f.step, f.onset_step) for f in again.observe([], [_under(list(range(300, 360, 10)), more)])]
    assert later == [(320, 120), (350, 320)]  # (the rule cools down for 30 steps after each raise)
    # a rollback to step 200: l1's run began at 120, before it, on the history both timelines share,
    # and goes on; l0's began at 320, on the abandoned timeline: it ends, and starts again at 200
    replay = np.tile(np.array([500.0, 100_000.0, 500.0, 100_000.0]), (6, 1))
    rewound = [(f.step, f.onset_step) for f in again.observe([], [_under(list(range(200, 260, 10)), replay)])]
    assert rewound == [(200, 120), (230, 200)]
