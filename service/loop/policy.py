"""Policy: from findings and the run's situation to auditable decisions (pure functions).

Cause before cure: a fallback needs FP8 evidence on the modules it names, and FP8 findings that
follow a loss or gradient event are its after-effects, not its cause.

- FP8 numerics implicating some modules (saturation, amax growth, inf amax, a scale pinned by a
  past outlier): BF16 fallback of those modules, or of the whole model when at least
  ``widespread_fraction`` are implicated; their re-promotion later resets the FP8 state. Not
  when they began after a loss or gradient event of the last ``after_effect_steps`` (or while a
  rollback is pending): then they are alerts.
- Loss spike, non-finite loss or gradient norm, divergence from the start: rollback to the
  newest known-good checkpoint at least ``rollback_margin_steps`` before the onset (else the
  newest checkpoint saved that early; for divergence from the start, the earliest), skipping the
  bad window's batches plus ``skip_batches`` (PaLM: restart ~100 steps before the spike, skip
  200-500 batches); divergence also lowers the learning rate for good. With no checkpoint to go
  back to: a page, never a fallback (BF16 does not cure bad data or a learning rate).
- ``escalate_rollbacks`` rollbacks within ``escalate_window_steps``: a page, and whole-model BF16
  only when FP8 findings are part of the trouble (else BF16 would cure nothing).
- Modules in BF16 for ``promote_after_steps`` clean steps: re-promotion with fresh FP8 state.

Measured harm (``service/loop/harm.py``): once the run's agent probes what FP8 costs the loss,
a fallback needs measured harm (an ``fp8_harm`` finding naming the modules) or broken numerics
(an infinite amax, saturation beyond 16x its bound); an FP8 anomaly the probe finds harmless is
an alert and the modules stay in FP8. While an incident is open (modules fallen back within
``incident_steps``) the policy escalates instead of following bisection piecemeal: harm measured
again on modules still in FP8 widens the fallback to every module the incident's FP8 findings
implicate (the whole model once that was done), and a rollback after the incident's fallback
carries that widening, so the replay does not re-live the incident and one rollback suffices
(on the H200 the piecemeal path took two). Re-promotion then waits for a trial (the modules
back in FP8 inside the probe) that finds no harm, and each harmful trial doubles the module's
wait.
- Underflow growth, one-step saturation spikes, amax ramps, warnings without modules: alerts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fp8guard.service.domain import Decision, Finding
from fp8guard.service.kinds import DIVERGENCE_RULES, FP8_RULES, ROLLBACK_RULES, ActionKind, Rule, Severity
from fp8guard.service.loop.config import GuardConfig
from fp8guard.service.loop.harm import TrialRecord

__all__ = ["FOR_GOOD", "RunView", "decide", "is_rollback_finding", "promotions"]

FOR_GOOD = 2**31 - 1
"""``lr_scale_steps`` of a rollback that lowers the learning rate for the rest of the run."""


@dataclass(frozen=True, slots=True)
class RunView:
    step: int
    modules: Sequence[str]
    """Every FP8 module of the run."""
    bf16: dict[str, int]
    """Modules the agent reported in BF16 -> since step."""
    rollback_pending: bool
    known_good: Sequence[int]
    """Known-good checkpoint steps of the current timeline."""
    recent_rollbacks: Sequence[int]
    """Steps at which rollbacks were decided."""
    last_finding_step: dict[str, int] = field(default_factory=dict)
    """Module -> step of its latest numerics finding."""
    pinned: frozenset[str] = frozenset()
    """Modules held in BF16 by an escalation: never re-promoted automatically."""
    pending: dict[str, ActionKind] = field(default_factory=dict)
    """Modules with a switch command the agent has not answered yet -> its kind."""
    whole_model_pending: bool = False
    """A whole-model fallback waits for the agent."""
    checkpoints: Sequence[int] = ()
    """Every checkpoint step of the current timeline, known-good or not yet."""
    last_loss_event: int | None = None
    """Onset step of the latest loss or gradient finding (a rollback's cause) before this decision."""
    last_page: int | None = None
    """Step of the latest page: one page per incident, whatever the number of ranks reporting it."""
    harm_probed: bool = False
    """The run's agent measures FP8 harm (it reported a probe at or before this step)."""
    trials: Sequence[TrialRecord] = ()
    """Promotion trials reported up to this step, oldest first."""

    def off_fp8(self, module: str) -> bool:
        """In BF16, or on its way there: a fallback would order nothing new."""
        return (module in self.bf16 and self.pending.get(module) is not ActionKind.PROMOTE) or \
            self.whole_model_pending or self.pending.get(module) is ActionKind.FALLBACK

    def all_off_fp8(self) -> bool:
        return self.whole_model_pending or (bool(self.modules) and all(self.off_fp8(m) for m in self.modules))


def is_rollback_finding(f: Finding) -> bool:
    return f.rule in ROLLBACK_RULES or (f.rule is Rule.GRAD_NORM_SPIKE and f.severity is Severity.CRITICAL)


def decide(findings: Sequence[Finding], view: RunView, cfg: GuardConfig) -> list[Decision]:
    out: list[Decision] = []
    rollback = [i for i, f in enumerate(findings) if is_rollback_finding(f)]
    numerics = [i for i, f in enumerate(findings) if f.rule in FP8_RULES]
    cause = min((findings[i].onset_step for i in rollback), default=None)
    after: list[int] = []
    for i in numerics:
        if _after_effect(findings[i], view, cause, cfg):
            after.append(i)
    numerics = [i for i in numerics if i not in after]
    evidence = bool(numerics)
    harmless: list[int] = []
    if view.harm_probed and cfg.require_measured_harm:
        harmless = [i for i in numerics if findings[i].rule is not Rule.FP8_HARM and not _broken(findings[i])]
        numerics = [i for i in numerics if i not in harmless]
    # Bisection only ever names modules training runs in FP8: a measurement naming modules that
    # are all off FP8 already was taken before their fallback applied, and says nothing new.
    known = [i for i in numerics if _attribution(findings[i]) and all(view.off_fp8(m) for m in findings[i].modules)]
    numerics = [i for i in numerics if i not in known]
    incident = _incident(view, cfg)
    if rollback and not view.rollback_pending:
        out += _rollback(findings, rollback, view, cfg, fp8_evidence=evidence or bool(incident))
        if incident and any(d.kind is ActionKind.ROLLBACK for d in out):
            # The incident's fallback did not stop the loss: the replay must not re-live it.
            out += _widen(findings, rollback + numerics, view, cfg, incident, after_rollback=True)
    # A measurement of a timeline that a rollback abandoned (its probe step lies ahead of the
    # replayed step): the rollback followed this harm, and the replay is about to re-live it.
    replayed = any(_attribution(findings[i]) and findings[i].onset_step > view.step for i in numerics)
    if numerics:
        if (incident or replayed) and any(_attribution(findings[i]) for i in numerics):
            out += _widen(findings, numerics, view, cfg, incident, after_rollback=replayed, already=out)
        else:
            out += _fallback(findings, numerics, view, cfg, already=out)
    for i, f in enumerate(findings):
        if i in known:
            out.append(Decision(kind=ActionKind.ALERT, rule=f.rule, findings=(i,), severity=f.severity, reason=(
                f"{f.explanation} Those modules are in BF16 or on their way (the probe ran before their fallback "
                "applied): the next probe tells whether that closed the gap.")))
        elif i in harmless:
            out.append(Decision(kind=ActionKind.ALERT, rule=f.rule, findings=(i,), severity=f.severity, reason=(
                f"{f.explanation} The run measures what FP8 costs its loss and has measured no harm from this: FP8 "
                "stays on (a fallback needs measured harm or broken numerics).")))
        elif i in after:
            event = cause if cause is not None and f.onset_step > cause else view.last_loss_event
            out.append(Decision(kind=ActionKind.ALERT, rule=f.rule, findings=(i,), severity=f.severity, reason=(
                f"{f.explanation} It began after the loss/gradient event of step {event}: an after-effect, so no "
                "fallback (the rollback is the cure).")))
        elif i not in rollback and i not in numerics:
            out.append(Decision(kind=ActionKind.ALERT, reason=f.explanation, rule=f.rule, findings=(i,),
                                severity=f.severity))
    return out


def _attribution(f: Finding) -> bool:
    """The harm probe's bisection: FP8 costs the loss now, on the modules it names."""
    return f.rule is Rule.FP8_HARM and f.severity is Severity.CRITICAL


def _recent(step: int, at: int, cfg: GuardConfig) -> bool:
    """``at`` belongs to the incident open at ``step``: within ``incident_steps`` before it, or
    later (a timeline that a rollback abandoned: its steps are replayed)."""
    return at > step or step - at <= cfg.incident_steps


def _incident(view: RunView, cfg: GuardConfig) -> set[str]:
    """The modules an open FP8 incident holds in BF16: fallen back (or on their way) within the
    last ``incident_steps`` steps of a run that probes FP8 harm. Empty: no incident open."""
    if not (view.harm_probed and cfg.require_measured_harm):
        return set()
    if view.whole_model_pending:
        return set(view.modules)
    held = {m for m, since in view.bf16.items()
            if view.pending.get(m) is not ActionKind.PROMOTE and _recent(view.step, since, cfg)}
    return held | {m for m, kind in view.pending.items() if kind is ActionKind.FALLBACK}


def _widen(findings: Sequence[Finding], idx: list[int], view: RunView, cfg: GuardConfig, incident: set[str], *,
           after_rollback: bool, already: Sequence[Decision] = ()) -> list[Decision]:
    """Escalation within an open incident, instead of one bisection's worth of modules at a time:
    the modules measured harm names, plus every module the incident's FP8 numerics findings
    implicate (harmless alone, but the harm spreads over them: bisection names the half that closes
    most of the gap, not every carrier). A rollback that follows the incident's fallback carries
    this fallback, so the replay does not re-live the incident. Harm measured again on modules the
    widening left in FP8 takes the whole model at once."""
    if any(d.kind is ActionKind.FALLBACK and d.modules is None for d in already):
        return []
    known = set(view.modules)
    named = {m for i in idx for m in findings[i].modules} & known
    implicated = named | ({m for m, at in view.last_finding_step.items() if _recent(view.step, at, cfg)} & known)
    implicated |= {m for i in idx if findings[i].rule in FP8_RULES for m in findings[i].modules} & known
    off = {m for m in view.modules if view.off_fp8(m)}
    new = sorted(implicated - off)
    # Numerics add nothing beyond what the probe named: the incident was widened already (or has
    # no numerics to widen by), and harm is measured again on modules it left in FP8.
    everything = not after_rollback and not (implicated - named - off)
    if not new and not everything:
        return []
    total = max(len(view.modules), 1)
    if after_rollback and incident:
        cause = "the loss went wrong after the incident's fallback, and the rollback replays the incident"
    elif after_rollback:
        cause = "FP8 harm measured before the rollback (on the abandoned timeline) is what the replay re-lives"
    else:
        cause = "FP8 harm is measured again during an incident whose fallback did not close the gap"
    idxs = tuple(i for i in idx if findings[i].rule in FP8_RULES or after_rollback)
    if everything or len(off | set(new)) / total >= cfg.widespread_fraction:
        held = len(off | set(new))
        reason = (f"{cause.capitalize()}: {len(incident)} module(s) held in BF16, harm or FP8 findings on {held} of "
                  f"{total}, so the whole model falls back to BF16 (re-promoted module by module after harmless "
                  "trials).")
        return [Decision(kind=ActionKind.FALLBACK, reason=reason, modules=None, findings=idxs,
                         severity=Severity.CRITICAL)]
    reason = (f"{cause.capitalize()}: widening the fallback to every module the incident's FP8 findings implicate, "
              f"{len(new)} more: {', '.join(new[:5])}{'...' if len(new) > 5 else ''}.")
    return [Decision(kind=ActionKind.FALLBACK, reason=reason, modules=tuple(new), findings=idxs,
                     severity=Severity.CRITICAL)]


def _broken(f: Finding) -> bool:
    """Numerics that are wrong whatever the loss says: an infinite amax, or saturation beyond
    16x its bound (the detector's critical saturation)."""
    return f.rule is Rule.INF_AMAX or (f.rule is Rule.SATURATION and f.severity is Severity.CRITICAL)


def _after_effect(f: Finding, view: RunView, cause: int | None, cfg: GuardConfig) -> bool:
    """An FP8 finding that began after a loss or gradient event (this batch's or a recent one),
    or while its rollback is pending, is that event's after-effect. One that began at the same
    step (an infinite amax with a NaN loss) may be its cause, and counts as FP8 evidence."""
    if view.rollback_pending:
        return True
    if f.rule is Rule.FP8_HARM:
        # Measured, not inferred: FP8 costs the loss now, whatever came first (a gradient spike
        # may well be the harm's own symptom); only a pending rollback makes it moot.
        return False
    events = [e for e in (cause, view.last_loss_event) if e is not None]
    return any(e < f.onset_step <= e + cfg.after_effect_steps for e in events)


def _rollback(findings: Sequence[Finding], idx: list[int], view: RunView, cfg: GuardConfig, *,
              fp8_evidence: bool) -> list[Decision]:
    onset = min(findings[i].onset_step for i in idx)
    spike = max(findings[i].step for i in idx)
    first = findings[idx[0]]
    diverging = any(findings[i].rule in DIVERGENCE_RULES for i in idx)
    window = [s for s in view.recent_rollbacks if view.step - s <= cfg.escalate_window_steps]
    if len(window) + 1 > cfg.escalate_rollbacks:
        if not fp8_evidence and view.last_page is not None and 0 <= onset - view.last_page <= cfg.cooldown_steps:
            return []  # this escalation already paged someone
        # Cause before cure holds here too: without FP8 evidence BF16 cures nothing (a learning
        # rate, bad data), so the escalation is a page alone.
        cure = "switching the whole model to BF16 and paging a human" if fp8_evidence else \
            "paging a human (no FP8 anomaly in the window, so no BF16 fallback)"
        reason = (f"{len(window)} rollbacks within {cfg.escalate_window_steps} steps and trouble again at step "
                  f"{spike}: {cure}.")
        out = [Decision(kind=ActionKind.PAGE, reason=reason, findings=tuple(idx), severity=Severity.CRITICAL)]
        if fp8_evidence and not view.all_off_fp8():
            out.insert(0, Decision(kind=ActionKind.FALLBACK, reason=reason, modules=None, escalation=True,
                                   findings=tuple(idx), severity=Severity.CRITICAL))
        return out
    ckpt, how = _checkpoint(view, onset, cfg, earliest=diverging)
    if ckpt is None:
        if view.last_page is not None and 0 <= onset - view.last_page <= cfg.cooldown_steps:
            return []  # this incident already paged someone (another rank's report of it)
        reason = (f"{first.explanation} There is no checkpoint from before step {onset} to roll back to, and BF16 "
                  "would not cure it: paging a human." + ("" if not fp8_evidence else
                                                        " FP8 findings of this window are handled on their own."))
        return [Decision(kind=ActionKind.PAGE, reason=reason, findings=tuple(idx), severity=Severity.CRITICAL)]
    skip = (spike - ckpt) + cfg.skip_batches
    cause = ("" if fp8_evidence else
             " No FP8 anomaly in the window: a data or optimisation event, so the bad batches are skipped"
             " and FP8 stays on.")
    lr_scale, lr_steps = cfg.rollback_lr_scale, cfg.rollback_lr_steps
    if diverging:
        # The checkpoint restores the optimizer's rate as it was, so each further divergence
        # rollback of the escalation window cuts from there once more (a back-off: 0.5, 0.25...).
        lr_scale, lr_steps = min(lr_scale, cfg.divergence_lr_scale ** (len(window) + 1)), FOR_GOOD
        cause += f" The run diverged from the start: the learning rate is multiplied by {lr_scale:g} for good."
    reason = (f"{first.explanation} Rolling back to the {how} of step {ckpt} ({onset - ckpt} steps before the "
              f"onset) and skipping {skip} batches (the {spike - ckpt} from there to step {spike} and "
              f"{cfg.skip_batches} more).{cause}")
    return [Decision(kind=ActionKind.ROLLBACK, reason=reason, checkpoint_step=ckpt, skip_batches=skip,
                     onset_step=onset, spike_step=spike, lr_scale=lr_scale, lr_scale_steps=lr_steps,
                     findings=tuple(idx), severity=Severity.CRITICAL)]


def _checkpoint(view: RunView, onset: int, cfg: GuardConfig, *, earliest: bool) -> tuple[int | None, str]:
    """Where to roll back to: a known-good checkpoint at least the margin before the onset; else
    a checkpoint saved that early (not confirmed yet: nothing was wrong then either); divergence
    from the start goes back to the earliest."""
    good = [s for s in view.known_good if s <= onset - cfg.rollback_margin_steps]
    early = [s for s in view.checkpoints if s <= onset - cfg.rollback_margin_steps]
    if earliest:
        before = [s for s in view.checkpoints if s <= onset]
        if before:
            return min(before), ("known-good checkpoint" if min(before) in view.known_good else "earliest checkpoint")
    if good:
        return max(good), "known-good checkpoint"
    if early:
        return max(early), "checkpoint"
    return None, ""


def _fallback(findings: Sequence[Finding], idx: list[int], view: RunView, cfg: GuardConfig,
              already: list[Decision]) -> list[Decision]:
    if any(d.kind is ActionKind.FALLBACK and d.modules is None for d in already):
        return []
    implicated = sorted({m for i in idx for m in findings[i].modules})
    new = [m for m in implicated if not view.off_fp8(m)]
    if not new:
        return []
    total = max(len(view.modules), 1)
    off = {m for m in view.modules if view.off_fp8(m)}
    widespread = len(off | set(new)) / total >= cfg.widespread_fraction
    worst = max((findings[i] for i in idx), key=lambda f: (f.severity == Severity.CRITICAL, len(f.modules)))
    if widespread:
        reason = (f"{worst.explanation} FP8 trouble spans {len(off | set(new))} of {total} modules: "
                  "the whole model falls back to BF16.")
        return [Decision(kind=ActionKind.FALLBACK, reason=reason, modules=None, findings=tuple(idx),
                         severity=Severity.CRITICAL)]
    reason = f"{worst.explanation} Falling back {len(new)} module(s) to BF16: {', '.join(new[:5])}."
    return [Decision(kind=ActionKind.FALLBACK, reason=reason, modules=tuple(new), findings=tuple(idx))]


def promotions(view: RunView, cfg: GuardConfig) -> list[Decision]:
    """Modules in BF16 long enough with no new trouble go back to FP8 (their stale amax
    history and scale reset by the agent)."""
    if view.whole_model_pending:
        return []
    ready = sorted(m for m, since in view.bf16.items()
                   if m not in view.pinned and m not in view.pending
                   and view.step - max(since, view.last_finding_step.get(m, since)) >= promotion_wait(view, m, cfg)
                   and (not view.harm_probed or _trial_passed(view, m, since)))
    if not ready:
        return []
    trialled = " and a trial inside the harm probe found no harm" if view.harm_probed else ""
    reason = (f"{len(ready)} module(s) ran {cfg.promote_after_steps}+ clean steps in BF16{trialled}: re-promoting "
              "to FP8 with a fresh amax history and scale.")
    return [Decision(kind=ActionKind.PROMOTE, reason=reason, modules=tuple(ready), findings=(), severity=Severity.INFO)]


def promotion_wait(view: RunView, module: str, cfg: GuardConfig) -> int:
    """Clean steps a module in BF16 waits: ``promote_after_steps``, doubled by each harmful trial
    once it was due (a module that fails its trial waits longer; trials during its first wait,
    while the incident may still be on, are only its evidence)."""
    since = view.bf16.get(module, 0)
    due = since + cfg.promote_after_steps
    failures = sum(1 for t in view.trials if t.module == module and t.step >= due and t.harmful)
    return int(cfg.promote_after_steps * 2 ** min(failures, 16))


def _trial_passed(view: RunView, module: str, since: int) -> bool:
    """The module's latest trial since its fallback found no harm."""
    latest = [t for t in view.trials if t.module == module and t.step >= since]
    return bool(latest) and not latest[-1].harmful
