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
from typing import Any

from fp8guard.service.detect.config import GuardConfig
from fp8guard.service.detect.types import Finding, Severity

__all__ = ["Decision", "RunView", "decide", "promotions"]

_NUMERICS = ("saturation", "amax_growth", "inf_amax", "stale_scale")
_ROLLBACK = ("loss_spike", "nonfinite")


@dataclass(frozen=True, slots=True)
class RunView:
    step: int
    modules: Sequence[str]
    """Every FP8 module of the run."""
    bf16: dict[str, int]
    """Modules currently in BF16 (or being switched) -> since step."""
    rollback_pending: bool
    known_good: Sequence[int]
    """Known-good checkpoint steps of the current timeline."""
    recent_rollbacks: Sequence[int]
    """Steps at which rollbacks were decided."""
    last_finding_step: dict[str, int] = field(default_factory=dict)
    """Module -> step of its latest numerics finding."""
    pinned: frozenset[str] = frozenset()
    """Modules held in BF16 by an escalation: never re-promoted automatically."""


@dataclass(frozen=True, slots=True)
class Decision:
    kind: str
    """fallback | promote | rollback | page | alert"""
    reason: str
    payload: dict[str, Any]
    findings: tuple[int, ...]
    """Indexes into the findings passed to ``decide``."""
    severity: Severity = Severity.WARNING


def decide(findings: Sequence[Finding], view: RunView, cfg: GuardConfig) -> list[Decision]:
    out: list[Decision] = []
    rollback = [i for i, f in enumerate(findings) if f.rule in _ROLLBACK
                or (f.rule == "grad_norm_spike" and f.severity is Severity.CRITICAL)]
    numerics = [i for i, f in enumerate(findings) if f.rule in _NUMERICS]
    if rollback and not view.rollback_pending:
        out += _rollback(findings, rollback, view, cfg)
    if numerics:
        out += _fallback(findings, numerics, view, cfg, already=out)
    for i, f in enumerate(findings):
        if i not in rollback and i not in numerics:
            out.append(Decision(kind="alert", reason=f.explanation, payload={"rule": f.rule}, findings=(i,),
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
        return [Decision(kind="fallback", reason=reason, payload={"modules": None, "escalation": True},
                         findings=tuple(idx), severity=Severity.CRITICAL),
                Decision(kind="page", reason=reason, payload={}, findings=tuple(idx), severity=Severity.CRITICAL)]
    candidates = [s for s in view.known_good if s <= onset - cfg.rollback_margin_steps]
    if not candidates:
        reason = (f"{first.explanation} No known-good checkpoint at least {cfg.rollback_margin_steps} steps before "
                  f"step {onset}, so the whole model falls back to BF16 instead of rolling back.")
        return [Decision(kind="fallback", reason=reason, payload={"modules": None}, findings=tuple(idx),
                         severity=Severity.CRITICAL)]
    ckpt = max(candidates)
    skip = (spike - ckpt) + cfg.skip_batches
    reason = (f"{first.explanation} Rolling back to the known-good checkpoint of step {ckpt} "
              f"({onset - ckpt} steps before the onset) and skipping {skip} batches.")
    payload = {"checkpoint_step": ckpt, "skip_batches": skip, "onset_step": onset, "spike_step": spike,
               "lr_scale": cfg.rollback_lr_scale, "lr_scale_steps": cfg.rollback_lr_steps}
    return [Decision(kind="rollback", reason=reason, payload=payload, findings=tuple(idx), severity=Severity.CRITICAL)]


def _fallback(findings: Sequence[Finding], idx: list[int], view: RunView, cfg: GuardConfig,
              already: list[Decision]) -> list[Decision]:
    if any(d.kind == "fallback" and d.payload.get("modules") is None for d in already):
        return []
    implicated = sorted({m for i in idx for m in findings[i].modules})
    new = [m for m in implicated if m not in view.bf16]
    if not new:
        return []
    total = max(len(view.modules), 1)
    widespread = len(set(view.bf16) | set(new)) / total >= cfg.widespread_fraction
    worst = max((findings[i] for i in idx), key=lambda f: (f.severity == Severity.CRITICAL, len(f.modules)))
    if widespread:
        reason = (f"{worst.explanation} FP8 trouble spans {len(set(view.bf16) | set(new))} of {total} modules: "
                  "the whole model falls back to BF16.")
        return [Decision(kind="fallback", reason=reason, payload={"modules": None}, findings=tuple(idx),
                         severity=Severity.CRITICAL)]
    reason = f"{worst.explanation} Falling back {len(new)} module(s) to BF16: {', '.join(new[:5])}."
    return [Decision(kind="fallback", reason=reason, payload={"modules": new}, findings=tuple(idx))]


def promotions(view: RunView, cfg: GuardConfig) -> list[Decision]:
    """Modules in BF16 long enough with no new trouble go back to FP8 (their stale amax
    history and scale reset by the agent)."""
    ready = sorted(m for m, since in view.bf16.items()
                   if m not in view.pinned and view.step - max(since, view.last_finding_step.get(m, since)) >= cfg.promote_after_steps)
    if not ready:
        return []
    reason = (f"{len(ready)} module(s) ran {cfg.promote_after_steps}+ clean steps in BF16: re-promoting to FP8 "
              "with a fresh amax history and scale.")
    return [Decision(kind="promote", reason=reason, payload={"modules": ready}, findings=(), severity=Severity.INFO)]
