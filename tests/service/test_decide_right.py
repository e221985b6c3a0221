"""Rules from step 0, one-step and gradual outliers, derived statistics, and cause before cure."""

from __future__ import annotations

import numpy as np

from fp8guard.service.domain import StatBlock, StepRow
from fp8guard.service.kinds import ActionKind, Rule
from fp8guard.service.loop import Detector, GuardConfig, RunView, TensorMeta, decide
from fp8guard.service.loop.policy import FOR_GOOD


def _metas(n: int = 4) -> list[TensorMeta]:
    return [TensorMeta(name=f"l{i // 2}:{'bwd_grad_output' if i % 2 else 'fwd_input'}", module=f"l{i // 2}",
                       backward=bool(i % 2), fp8_max=57344.0 if i % 2 else 448.0) for i in range(n)]


def _view(step: int, **kw: object) -> RunView:
    base: dict[str, object] = {"step": step, "modules": ["l0", "l1"], "bf16": {}, "rollback_pending": False,
                               "known_good": [], "recent_rollbacks": []}
    return RunView(**{**base, **kw})  # type: ignore[arg-type]


def test_lr_blowup_from_step_0_is_caught_within_five_steps_and_rolled_back_to_the_start() -> None:
    """Loss 10.9 at step 0, 11.7 at step 2 and climbing; the gradient norm runs away: nothing has a
    baseline yet (the spike rules wait for 20 values), the early rules fire."""
    loss = [10.9, 11.2, 11.7, 12.4, 13.0, 13.9, 15.0]
    grad = [2.0, 3.0, 9.0, 30.0, 60.0, 120.0, 372.0]
    rows = [StepRow(step=s, loss=loss[s], grad_norm=grad[s]) for s in range(len(loss))]
    found = Detector(GuardConfig(), _metas()).observe(rows, [])
    first = {f.rule: f for f in reversed(found)}
    assert first[Rule.LOSS_DIVERGENCE].step <= 2 + 5
    assert first[Rule.GRAD_DIVERGENCE].step <= 18
    d = decide([first[Rule.LOSS_DIVERGENCE]], _view(first[Rule.LOSS_DIVERGENCE].step, checkpoints=[0]),
               GuardConfig())
    assert [x.kind for x in d] == [ActionKind.ROLLBACK]
    assert d[0].checkpoint_step == 0 and d[0].lr_scale == 0.5 and d[0].lr_scale_steps == FOR_GOOD
    assert "learning rate" in d[0].reason


def test_each_further_divergence_rollback_cuts_the_learning_rate_again() -> None:
    """The earliest checkpoint restores the optimizer's rate as it was: a second divergence
    rollback must cut deeper than the first, or the run diverges again the same way."""
    found = Detector(GuardConfig(), _metas()).observe(
        [StepRow(step=s, loss=10.9 + s) for s in range(5)], [])
    div = [f for f in found if f.rule is Rule.LOSS_DIVERGENCE]
    scales = [decide(div, _view(div[0].step, checkpoints=[0], recent_rollbacks=r), GuardConfig())[0].lr_scale
              for r in ([], [3], [3, 40])]
    assert scales == [0.5, 0.25, 0.125]


def test_healthy_starts_and_noisy_fine_tuning_do_not_trip_the_early_rules() -> None:
    rng = np.random.default_rng(0)
    cfg = GuardConfig()
    for seed_loss, noise in ((10.9, 0.01), (2.1, 0.02)):  # pre-training from scratch; a fine-tuning start
        det = Detector(cfg, _metas())
        loss = seed_loss * (1 - 0.01 * np.arange(40)) * (1 + noise * rng.normal(size=40))
        rows = [StepRow(step=s, loss=float(loss[s]), grad_norm=float(1.5 + 0.3 * rng.random())) for s in range(40)]
        assert [f.rule for f in det.observe(rows, [])] == []


def test_a_one_step_outlier_is_a_finding_at_its_step_on_its_module() -> None:
    sat = np.ones((30, 4), dtype=np.float32)
    sat[12, 2] = 40.0  # a weight row x64 for one step: saturation 40x, delayed scaling catches up next step
    block = StatBlock(stats=("saturation",), steps=np.arange(30), values=sat[:, None, :])
    found = Detector(GuardConfig(), _metas()).observe([], [block])
    assert [(f.rule, f.step, f.modules) for f in found] == [(Rule.SATURATION_SPIKE, 12, ("l1",))]
    # an alert, not a fallback: TE rescales the tensor the next step
    assert [x.kind for x in decide(found, _view(12), GuardConfig())] == [ActionKind.ALERT]


def test_routine_overshoots_stay_quiet() -> None:
    rng = np.random.default_rng(1)
    sat = np.where(np.arange(4) % 2, rng.uniform(0.5, 4.0, (2000, 4)), rng.uniform(0.8, 1.2, (2000, 4)))
    block = StatBlock(stats=("saturation",), steps=np.arange(2000), values=sat[:, None, :].astype(np.float32))
    assert Detector(GuardConfig(), _metas()).observe([], [block]) == []


def test_saturation_is_derived_from_amax_and_the_previous_scale() -> None:
    """A batch with amax and scale but no saturation: ``amax_t * scale_{t-1} / fp8_max``."""
    amax = np.ones((20, 4), dtype=np.float32)
    scale = np.full((20, 4), 448.0, dtype=np.float32)  # delayed scaling: amax 1 maps to 448 (the E4M3 max)
    amax[10:, 0] = 5.0  # l0 forward: 5x over its scale for 10 steps (the scale is never updated here)
    values = np.stack([amax, scale], axis=1)
    found = Detector(GuardConfig(), _metas()).observe([], [StatBlock(stats=("amax", "scale"), steps=np.arange(20),
                                                                     values=values)])
    sat = [f for f in found if f.rule is Rule.SATURATION]
    assert [(f.step, f.modules, f.evidence["ratios"]) for f in sat] == [(19, ("l0",), [5.0])]


def test_a_loss_spike_without_fp8_evidence_is_rolled_back_never_fallen_back() -> None:
    rows = [StepRow(step=s, loss=1.9 + 0.01 * (s % 3)) for s in range(60)] + [StepRow(step=60, loss=10.1)]
    found = Detector(GuardConfig(), _metas()).observe(rows, [])
    assert [f.rule for f in found] == [Rule.LOSS_SPIKE]
    d = decide(found, _view(60, known_good=[0, 10], checkpoints=[0, 10, 50]), GuardConfig())
    assert [x.kind for x in d] == [ActionKind.ROLLBACK] and d[0].checkpoint_step == 10
    assert "data or optimisation event" in d[0].reason
    # no checkpoint to go back to: a page, not a BF16 fallback
    d = decide(found, _view(60), GuardConfig())
    assert [x.kind for x in d] == [ActionKind.PAGE]
    # and a second rank reporting the same incident pages nobody again
    assert decide(found, _view(60, last_page=60), GuardConfig()) == []


def test_fp8_findings_after_a_loss_event_are_its_after_effects() -> None:
    """LR 10x too high: the loss blows up first, stale E5M2 scales follow. The cure is the
    rollback; the scales are alerts, not a fallback."""
    cfg = GuardConfig()
    stale = Detector(cfg, _metas())
    amax = np.ones((120, 4), dtype=np.float32)
    amax[60, 1] = 1e5  # an outlier of the blown-up update pins l0's gradient scale
    hist = np.stack([amax[max(0, t - 1023):t + 1].max(axis=0) for t in range(120)])
    found = stale.observe([], [StatBlock(stats=("amax", "amax_history_max"), steps=np.arange(120),
                                         values=np.stack([amax, hist], axis=1))])
    assert found and found[0].rule is Rule.STALE_SCALE
    d = decide(found[:1], _view(found[0].step, last_loss_event=55), cfg)
    assert [x.kind for x in d] == [ActionKind.ALERT] and "after-effect" in d[0].reason
    # while the rollback is pending too
    d = decide(found[:1], _view(found[0].step, rollback_pending=True), cfg)
    assert [x.kind for x in d] == [ActionKind.ALERT]
    # but FP8 trouble that came first is the cause: it is fallen back
    d = decide(found[:1], _view(found[0].step, last_loss_event=found[0].onset_step + 1), cfg)
    assert [x.kind for x in d] == [ActionKind.FALLBACK]


def test_the_guard_reads_back_with_every_default(client: object) -> None:
    c = client
    assert c.put("/v1/runs/guarded", json={"guard": {"skip_batches": 300}}).status_code == 201  # type: ignore[attr-defined]
    g = c.get("/v1/runs/guarded/guard").json()  # type: ignore[attr-defined]
    assert g["skip_batches"] == 300 and g["saturation_fwd"] == GuardConfig().saturation_fwd
    assert set(g) == set(GuardConfig.model_fields)
    assert c.get("/v1/runs/nobody/guard").status_code == 404  # type: ignore[attr-defined]
