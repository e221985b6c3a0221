"""A policy that weighs measured FP8 harm (issue 12): pure decisions, then the whole loop through
the real app (SQLite and PostgreSQL) with the agent's probe scalars and events."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fp8guard import wire
from fp8guard.service.domain import EventRecord, Finding, StepRow
from fp8guard.service.kinds import ActionKind, Rule, Severity
from fp8guard.service.loop import GuardConfig, RunView, decide, promotions
from fp8guard.service.loop.harm import HarmLedger, TrialRecord
from tests.helpers import STATS, batch, post


def _view(step: int, **kw: Any) -> RunView:
    base: dict[str, Any] = {"step": step, "modules": ["l0", "l1", "l2", "l3"], "bf16": {}, "rollback_pending": False,
                            "known_good": [90], "recent_rollbacks": [], "checkpoints": [90]}
    return RunView(**{**base, **kw})


def _finding(rule: Rule, severity: Severity, modules: tuple[str, ...], step: int = 120) -> Finding:
    return Finding(rule=rule, severity=severity, step=step, onset_step=step, explanation=f"{rule} on {modules}.",
                   modules=modules)


def test_an_fp8_anomaly_without_measured_harm_is_an_alert_once_the_run_probes() -> None:
    sat = _finding(Rule.SATURATION, Severity.WARNING, ("l1",))
    assert [d.kind for d in decide([sat], _view(120), GuardConfig())] == [ActionKind.FALLBACK]  # no probe: as before
    probed = decide([sat], _view(120, harm_probed=True), GuardConfig())
    assert [d.kind for d in probed] == [ActionKind.ALERT] and "measured no harm" in probed[0].reason
    off = decide([sat], _view(120, harm_probed=True), GuardConfig(require_measured_harm=False))
    assert [d.kind for d in off] == [ActionKind.FALLBACK]


def test_broken_numerics_fall_back_without_measured_harm() -> None:
    for f in (_finding(Rule.INF_AMAX, Severity.CRITICAL, ("l2",)), _finding(Rule.SATURATION, Severity.CRITICAL, ("l2",))):
        (d,) = decide([f], _view(120, harm_probed=True), GuardConfig())
        assert d.kind is ActionKind.FALLBACK and d.modules == ("l2",)


def test_measured_harm_falls_back_the_modules_it_names() -> None:
    harm = _finding(Rule.FP8_HARM, Severity.CRITICAL, ("l3",))
    (d,) = decide([harm], _view(120, harm_probed=True), GuardConfig())
    assert d.kind is ActionKind.FALLBACK and d.modules == ("l3",)


def test_measured_harm_after_a_gradient_event_is_no_after_effect() -> None:
    """A gradient spike that the FP8 harm itself caused comes first; inferred FP8 findings after
    it are after-effects, a measured harm is not (unless a rollback is already pending)."""
    harm = _finding(Rule.FP8_HARM, Severity.CRITICAL, ("l3",), step=80)
    (d,) = decide([harm], _view(80, harm_probed=True, last_loss_event=78), GuardConfig())
    assert d.kind is ActionKind.FALLBACK and d.modules == ("l3",)
    sat = _finding(Rule.SATURATION, Severity.CRITICAL, ("l2",), step=80)
    assert [x.kind for x in decide([sat], _view(80, harm_probed=True, last_loss_event=78), GuardConfig())] == [
        ActionKind.ALERT]
    (pending,) = decide([harm], _view(80, harm_probed=True, rollback_pending=True), GuardConfig())
    assert pending.kind is ActionKind.ALERT


def test_harm_named_on_modules_already_falling_back_is_no_new_news() -> None:
    """Bisection only names modules training runs in FP8: naming modules already off FP8 means the
    probe ran before their fallback applied. An alert, not a rollback (it used to be one, and on the
    CPU heal story that was a second rollback the incident did not need)."""
    harm = _finding(Rule.FP8_HARM, Severity.CRITICAL, ("l3",), step=300)
    for view in (_view(300, harm_probed=True, bf16={"l3": 290}, known_good=[250], checkpoints=[250]),
                 _view(300, harm_probed=True, pending={"l3": ActionKind.FALLBACK}, known_good=[250],
                       checkpoints=[250])):
        (d,) = decide([harm], view, GuardConfig())
        assert d.kind is ActionKind.ALERT and "next probe" in d.reason


_EIGHT = [f"b{k}.{n}" for k in range(2) for n in ("qkv", "proj", "fc", "out")]


def test_a_rollback_after_the_incidents_fallback_carries_a_wider_fallback() -> None:
    """The H200 1e6 heal: bisection named a subset, the fallback applied, the loss spiked anyway.
    The rollback carries a fallback of every module the incident's FP8 findings implicate, so
    the replay does not re-live the incident (the old path needed a second rollback)."""
    spike = Finding(rule=Rule.LOSS_SPIKE, severity=Severity.CRITICAL, step=120, onset_step=120,
                    explanation="The loss jumped.")
    view = _view(120, modules=_EIGHT, harm_probed=True, bf16={"b0.qkv": 119, "b0.proj": 119},
                 last_finding_step={"b0.proj": 119, "b0.out": 112, "b1.proj": 111, "b1.out": 113, "b0.qkv": 119})
    rollback, widen = decide([spike], view, GuardConfig(widespread_fraction=0.9))
    assert rollback.kind is ActionKind.ROLLBACK and rollback.checkpoint_step == 90
    assert "No FP8 anomaly" not in rollback.reason  # the incident's fallback is FP8 evidence
    assert widen.kind is ActionKind.FALLBACK and widen.modules == ("b0.out", "b1.out", "b1.proj")
    assert not widen.escalation  # trials re-promote them, as any fallback
    # 5 of 8 reach the default widespread_fraction (0.5): the whole model
    (_, whole) = decide([spike], view, GuardConfig())
    assert whole.kind is ActionKind.FALLBACK and whole.modules is None
    # no incident open (nothing held, or held long ago, or no probe): the rollback alone
    for quiet in (_view(120, modules=_EIGHT, harm_probed=True, last_finding_step=view.last_finding_step),
                  _view(520, modules=_EIGHT, harm_probed=True, bf16={"b0.qkv": 119}, known_good=[490],
                        checkpoints=[490], last_finding_step={"b1.out": 500}),
                  _view(120, modules=_EIGHT, bf16={"b0.qkv": 119}, last_finding_step={"b1.out": 113})):
        late = Finding(rule=Rule.LOSS_SPIKE, severity=Severity.CRITICAL, step=quiet.step, onset_step=quiet.step,
                       explanation="The loss jumped.")
        assert [d.kind for d in decide([late], quiet, GuardConfig())] == [ActionKind.ROLLBACK]


def test_harm_measured_again_in_an_open_incident_widens_at_once_then_takes_the_whole_model() -> None:
    """In the replay after a rollback (the held modules' fallback step lies ahead of the replayed
    step) the probe names more modules: the fallback widens to every implicated module, not one
    bisection at a time; once the widening is done, harm on modules it left out takes the whole
    model."""
    findings = {"b0.out": 276, "b1.out": 276, "b1.proj": 260}
    harm = _finding(Rule.FP8_HARM, Severity.CRITICAL, ("b0.fc",), step=251)
    view = _view(251, modules=_EIGHT, harm_probed=True, bf16={"b0.qkv": 277, "b0.proj": 277},
                 last_finding_step=findings)
    (d,) = decide([harm], view, GuardConfig(widespread_fraction=0.9))
    assert d.kind is ActionKind.FALLBACK and d.modules == ("b0.fc", "b0.out", "b1.out", "b1.proj")
    widened = _view(260, modules=_EIGHT, harm_probed=True, last_finding_step=findings,
                    bf16={m: 277 for m in ("b0.qkv", "b0.proj", "b0.fc", "b0.out", "b1.out", "b1.proj")})
    (whole,) = decide([_finding(Rule.FP8_HARM, Severity.CRITICAL, ("b1.qkv",), step=260)], widened,
                      GuardConfig(widespread_fraction=0.9))
    assert whole.kind is ActionKind.FALLBACK and whole.modules is None and not whole.escalation
    # the first measurement of an incident falls back what it names, as before
    (first,) = decide([harm], _view(251, modules=_EIGHT, harm_probed=True, last_finding_step=findings), GuardConfig())
    assert first.modules == ("b0.fc",)


def test_promotion_waits_for_a_harmless_trial_and_backs_off_after_a_harmful_one() -> None:
    cfg = GuardConfig(promote_after_steps=100)
    bf16 = {"l1": 200}
    assert [d.modules for d in promotions(_view(400, bf16=bf16), cfg)] == [("l1",)]  # no probe: time alone
    assert promotions(_view(400, bf16=bf16, harm_probed=True), cfg) == []  # probing: no trial yet
    passed = (TrialRecord(350, "l1", False),)
    assert [d.modules for d in promotions(_view(400, bf16=bf16, harm_probed=True, trials=passed), cfg)] == [("l1",)]
    # harmful at 240 (its first wait: evidence only) and at 310 (due since 300: the wait doubles)
    failed = (TrialRecord(240, "l1", True), TrialRecord(310, "l1", True), TrialRecord(350, "l1", False))
    view = _view(420, bf16=bf16, harm_probed=True, trials=failed, last_finding_step={"l1": 310})
    assert promotions(view, cfg) == []  # 110 clean steps since the failed trial, but the wait is 200 now
    later = _view(520, bf16=bf16, harm_probed=True, trials=failed, last_finding_step={"l1": 310})
    assert [d.modules for d in promotions(later, cfg)] == [("l1",)]


def test_the_ledger_reads_probe_scalars_and_events_as_of_a_step() -> None:
    ledger = HarmLedger()
    rows = [StepRow(step=s, loss=2.0, loss_fp8=2.01 if s == 200 else None, loss_bf16=2.0 if s == 200 else None)
            for s in range(195, 205)]
    events = [EventRecord(kind="harm_attributed", step=201, data={"probe_step": 200, "gap": 0.04, "gap_after": 0.002,
                                                                   "band_high": 0.01, "modules": ["l3"]}),
              EventRecord(kind="promotion_trial", step=203, data={"modules": ["l1"], "gap": "NaN", "band_high": 0.01,
                                                                   "harmful": False})]
    found = ledger.observe(rows, events)
    assert not ledger.probed_at(199) and ledger.probed_at(200)
    assert [(f.rule, f.severity, f.modules, f.step, f.onset_step) for f in found] == [
        (Rule.FP8_HARM, Severity.CRITICAL, ("l3",), 201, 200),
        (Rule.FP8_HARM, Severity.WARNING, ("l1",), 203, 203)]  # a NaN gap is harmful whatever the agent said
    assert ledger.trials_at(202) == [] and ledger.trials_at(203) == [TrialRecord(203, "l1", True)]
    again = HarmLedger(ledger.state_dict())
    assert again.probe_since == 200 and again.trials == ledger.trials


def _healthy(run: str, steps: list[int], **kw: Any) -> dict[str, Any]:
    """Six tensors with steady amax 1.0, scale 200 and saturation 0.45 (amax x scale / 448)."""
    vals = np.empty((len(steps), len(STATS), 6), dtype="<f4")
    vals[:, STATS.index("amax")] = vals[:, STATS.index("amax_history_max")] = 1.0
    vals[:, STATS.index("scale")] = 200.0
    vals[:, STATS.index("saturation")] = 200.0 / 448.0
    return batch(run, steps, n_tensors=6, values=vals, **kw)


def _probe_step(run: str, step: int, gap: float) -> dict[str, Any]:
    payload = _healthy(run, [step], define_tensors=False)
    payload["steps"][0].update(loss_fp8=2.0 * (1 + gap), loss_bf16=2.0, fp8_loss_gap=gap)
    return payload


def _saturated(run: str, steps: list[int]) -> dict[str, Any]:
    """blocks.0.fc's forward input clipped at 3x the FP8 maximum for every step: a saturation
    finding (warning) after saturation_steps, no measured harm."""
    payload = _healthy(run, steps, define_tensors=False)
    vals = np.full((len(steps), len(STATS), 6), 1.0, dtype="<f4")
    vals[:, STATS.index("scale")] = 200.0
    vals[:, STATS.index("saturation")] = 200.0 / 448.0
    vals[:, STATS.index("saturation"), 0] = 3.0
    payload["tensor_stats"] = [wire.tensor_stats_block(stats=STATS, steps=steps, n_tensors=6, data=vals.tobytes())]
    return payload


def test_the_loop_weighs_measured_harm_end_to_end(client: Any) -> None:
    run = "harm-e2e"
    guard = {"saturation_steps": 3, "promote_after_steps": 20, "cooldown_steps": 5, "widespread_fraction": 0.9}
    assert client.put(f"/v1/runs/{run}", json={"guard": guard}).status_code == 201
    post(client, _healthy(run, list(range(0, 10))))
    post(client, _probe_step(run, 10, 0.001))  # the run probes from step 10
    post(client, _saturated(run, list(range(11, 16))))
    actions = client.get(f"/v1/runs/{run}/actions").json()
    assert [a["kind"] for a in actions] == ["alert"] and "measured no harm" in actions[0]["reason"]
    assert client.get(f"/v1/runs/{run}/commands").json() == []
    # the probe measures harm on blocks.1.fc: a fallback of that module alone
    harm = {"kind": "harm_attributed", "step": 21, "data": {"probe_step": 20, "gap": 0.05, "gap_after": 0.001,
                                                            "band_high": 0.01, "modules": ["blocks.1.fc"]}}
    post(client, _healthy(run, [20, 21], define_tensors=False, events=[harm]))
    (command,) = client.get(f"/v1/runs/{run}/commands").json()
    assert command["kind"] == "fallback" and command["modules"] == ["blocks.1.fc"]
    findings = client.get(f"/v1/runs/{run}/findings").json()
    assert any(f["rule"] == "fp8_harm" and f["modules"] == ["blocks.1.fc"] and f["onset_step"] == 20 for f in findings)
    applied = [{"kind": "command_acknowledged", "step": 22, "data": wire.CommandAck(
                    command_id=command["id"], status=wire.AckStatus.APPLIED, applied_step=22).to_json()},
               {"kind": "fallback_applied", "step": 22, "data": {"command_id": command["id"],
                                                                 "modules": ["blocks.1.fc"]}}]
    post(client, _healthy(run, [22], define_tensors=False, events=applied))
    # a harmful trial keeps it in BF16 past promote_after_steps; a harmless one later promotes it
    bad = {"kind": "promotion_trial", "step": 45, "data": {"modules": ["blocks.1.fc"], "gap": 0.04,
                                                           "band_high": 0.01, "harmful": True}}
    post(client, _healthy(run, list(range(40, 50)), define_tensors=False, events=[bad]))
    assert client.get(f"/v1/runs/{run}/commands").json() == []
    good = {"kind": "promotion_trial", "step": 95, "data": {"modules": ["blocks.1.fc"], "gap": 0.002,
                                                            "band_high": 0.01, "harmful": False}}
    post(client, _healthy(run, list(range(90, 100)), define_tensors=False, events=[good]))
    (promote,) = client.get(f"/v1/runs/{run}/commands").json()
    assert promote["kind"] == "promote" and promote["modules"] == ["blocks.1.fc"]
    gaps = client.get(f"/v1/runs/{run}/scalars", params={"fields": "fp8_loss_gap"}).json()
    assert any(v is not None and math.isclose(v, 0.001, rel_tol=1e-6) for v in gaps["max"]["fp8_loss_gap"])
