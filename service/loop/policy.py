"""Policy: from findings and the run's situation to auditable decisions (pure functions).

- FP8 numerics implicating some modules (saturation, amax growth, inf amax, a scale pinned by a
  past outlier): BF16 fallback of those modules, or of the whole model when at least
  ``widespread_fraction`` are implicated; their re-promotion later resets the FP8 state.
- Loss spike, non-finite loss or gradient norm: rollback to the newest known-good checkpoint at
  least ``rollback_margin_steps`` before the onset, skipping the bad window's batches plus
  ``skip_batches`` (PaLM: restart ~100 steps before the spike, skip 200-500 batches).
- ``escalate_rollbacks`` rollbacks within ``escalate_window_steps``: whole-model BF16 and a page.
- Modules in BF16 for ``promote_after_steps`` clean steps: re-promotion with fresh FP8 state.
- Underflow growth and warnings without modules: alert only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fp8guard.service.domain import Decision, Finding
from fp8guard.service.kinds import FP8_RULES, ROLLBACK_RULES, ActionKind, Rule, Severity
from fp8guard.service.loop.config import GuardConfig

__all__ = ["RunView", "decide", "promotions"]


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

    def off_fp8(self, module: str) -> bool:
        """In BF16, or on its way there: a fallback would order nothing new."""
        return (module in self.bf16 and self.pending.get(module) is not ActionKind.PROMOTE) or \
            self.whole_model_pending or self.pending.get(module) is ActionKind.FALLBACK

    def all_off_fp8(self) -> bool:
        return self.whole_model_pending or (bool(self.modules) and all(self.off_fp8(m) for m in self.modules))


def decide(findings: Sequence[Finding], view: RunView, cfg: GuardConfig) -> list[Decision]:
    out: list[Decision] = []
    rollback = [i for i, f in enumerate(findings) if f.rule in ROLLBACK_RULES
                or (f.rule is Rule.GRAD_NORM_SPIKE and f.severity is Severity.CRITICAL)]
    numerics = [i for i, f in enumerate(findings) if f.rule in FP8_RULES]
    if rollback and not view.rollback_pending:
        out += _rollback(findings, rollback, view, cfg)
    if numerics:
        out += _fallback(findings, numerics, view, cfg, already=out)
    for i, f in enumerate(findings):
        if i not in rollback and i not in numerics:
            out.append(Decision(kind=ActionKind.ALERT, reason=f.explanation, rule=f.rule, findings=(i,),
                                severity=f.severity))
    return out


def _rollback(findings: Sequence[Finding], idx: list[int], view: RunView, cfg: GuardConfig) -> list[Decision]:
    onset = min(findings[i].onset_step for i in idx)
    spike = max(findings[i].step for i in idx)
    first = findings[idx[0]]
    window = [s for s in view.recent_rollbacks if view.step - s <= cfg.escalate_window_steps]
    if len(window) + 1 > cfg.escalate_rollbacks:
        reason = (f"{len(window)} rollbacks within {cfg.escalate_window_steps} steps and trouble again at step "
                  f"{spike}: switching the whole model to BF16 and paging a human.")
        out = [Decision(kind=ActionKind.PAGE, reason=reason, findings=tuple(idx), severity=Severity.CRITICAL)]
        if not view.all_off_fp8():
            out.insert(0, Decision(kind=ActionKind.FALLBACK, reason=reason, modules=None, escalation=True,
                                   findings=tuple(idx), severity=Severity.CRITICAL))
        return out
    candidates = [s for s in view.known_good if s <= onset - cfg.rollback_margin_steps]
    if not candidates:
        if view.all_off_fp8():
            return []  # the whole model is (being) switched already: one decision per incident
        reason = (f"{first.explanation} No known-good checkpoint at least {cfg.rollback_margin_steps} steps before "
                  f"step {onset}, so the whole model falls back to BF16 instead of rolling back.")
        return [Decision(kind=ActionKind.FALLBACK, reason=reason, modules=None, findings=tuple(idx),
                         severity=Severity.CRITICAL)]
    ckpt = max(candidates)
    skip = (spike - ckpt) + cfg.skip_batches
    reason = (f"{first.explanation} Rolling back to the known-good checkpoint of step {ckpt} "
              f"({onset - ckpt} steps before the onset) and skipping {skip} batches.")
    return [Decision(kind=ActionKind.ROLLBACK, reason=reason, checkpoint_step=ckpt, skip_batches=skip,
                     onset_step=onset, spike_step=spike, lr_scale=cfg.rollback_lr_scale,
                     lr_scale_steps=cfg.rollback_lr_steps, findings=tuple(idx), severity=Severity.CRITICAL)]


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
                   and view.step - max(since, view.last_finding_step.get(m, since)) >= cfg.promote_after_steps)
    if not ready:
        return []
    reason = (f"{len(ready)} module(s) ran {cfg.promote_after_steps}+ clean steps in BF16: re-promoting to FP8 "
              "with a fresh amax history and scale.")
    return [Decision(kind=ActionKind.PROMOTE, reason=reason, modules=tuple(ready), findings=(), severity=Severity.INFO)]
