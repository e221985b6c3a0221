"""``GuardConfig``: detection thresholds and policy knobs, per run (defaults documented here).

Calibration: in healthy Transformer Engine DelayedScaling runs measured on an H200 (1,500
steps, 24 FP8 modules) forward saturation ratios of 1.0-1.2 and backward (E5M2) ratios up to
about 4 occurred routinely, on hundreds of steps: delayed scaling uses last step's scale, so
any growth of amax clips a little for a step. A rule on ``ratio > 1`` alone would roll back
healthy runs. The defaults therefore ask for magnitude (2x over the FP8 maximum forward, 16x
backward), persistence (10 consecutive steps) and, for loss spikes, a robust z-score well
outside the recent noise.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["GuardConfig"]


class GuardConfig(BaseModel):
    """Per-run overrides come from ``PUT /v1/runs/{id}`` (``guard``); unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")

    dry_run: bool = False
    """Only recommend: record decisions and alert, never send commands."""
    # -- loss and gradient norm --
    warmup_steps: int = Field(default=20, ge=0)
    """No spike rule fires before this many finite values were seen (early loss falls fast)."""
    window: int = Field(default=64, ge=8, le=4096)
    """Steps of history for the median/MAD baseline."""
    loss_z: float = Field(default=8.0, gt=0)
    """Robust z-score ((x - median) / (1.4826 * MAD)) a loss must exceed to be a spike."""
    loss_min_rise: float = Field(default=0.25, ge=0)
    """...and the loss must also be this fraction above the median (noise-free runs have tiny MAD)."""
    early_loss_rise: float = Field(default=0.05, gt=0)
    """Before ``warmup_steps`` losses were seen: a loss this fraction above the run's first loss
    for ``early_steps`` steps in a row is divergence (a healthy run's loss only falls from its
    first value; 5 % and three steps keep a noisy fine-tuning start from tripping it)."""
    early_grad_factor: float = Field(default=20.0, gt=1)
    """Before the gradient-norm baseline exists: a norm this many times its smallest value so
    far, for ``early_steps`` steps in a row, is a blow-up (healthy starts fall from their first
    norm; a learning rate 10x too high reached 186x its early norm by step 18)."""
    early_steps: int = Field(default=3, ge=1)
    grad_z: float = Field(default=12.0, gt=0)
    grad_min_rise: float = Field(default=2.0, ge=0)
    """A gradient-norm spike must at least triple the median (1 + 2.0)."""
    # -- FP8 numerics --
    saturation_fwd: float = Field(default=2.0, gt=1)
    """Forward (E4M3) saturation ratio counted as real clipping (healthy runs: 1.0-1.2)."""
    saturation_bwd: float = Field(default=16.0, gt=1)
    """Backward (E5M2) saturation ratio counted as real clipping (healthy runs: up to ~4)."""
    saturation_steps: int = Field(default=10, ge=1)
    """Consecutive steps a tensor must stay over its threshold: one-step overshoots are normal."""
    saturation_spike_fwd: float = Field(default=8.0, gt=1)
    saturation_spike_bwd: float = Field(default=32.0, gt=1)
    """A single step over these ratios is a ``saturation_spike`` finding at that step (alert
    only): far above the routine 1.0-1.2 forward and ~4 backward, and what a one-step outlier
    that delayed scaling has not caught up with yet looks like (a weight row x64 gave 40x)."""
    amax_growth_factor: float = Field(default=8.0, gt=1)
    """Outlier amplification: fast amax average over slow average (both in log2)."""
    amax_growth_steps: int = Field(default=5, ge=1)
    amax_growth_warmup: int = Field(default=50, ge=1)
    ramp_alpha: float = Field(default=1 / 16, gt=0, lt=1)
    ramp_min_step: float = Field(default=0.02, gt=0)
    ramp_rising: float = Field(default=0.8, gt=0.5, lt=1)
    ramp_steps: int = Field(default=5, ge=1)
    """``amax_ramp`` (alert only): averaged with weight ``ramp_alpha``, the amax grows at least
    ``ramp_min_step`` per step and rises on at least ``ramp_rising`` of the steps, for
    ``ramp_steps`` steps in a row after ``amax_growth_warmup`` measured steps. A 3 %-per-step ramp
    is flagged about 30 steps after it starts; the fast/slow ``amax_growth`` rule needs ~160."""
    divergence_lr_scale: float = Field(default=0.5, gt=0, le=1)
    """A rollback for divergence from the start (``loss_divergence``, ``grad_divergence``)
    multiplies the learning rate by this for the rest of the run; by its square after one earlier
    rollback in the escalation window, and so on (the checkpoint restores the old rate)."""
    after_effect_steps: int = Field(default=200, ge=0)
    """FP8 findings within this many steps after a loss or gradient event that came first are
    its after-effects (a blown-up update inflates amaxes and pins scales): alerts, not fallbacks."""
    stale_scale_factor: float = Field(default=256.0, gt=1)
    """Scale pinned by a past outlier: the amax history's maximum (which sets a delayed-scaling
    scale under ``max``) is at least this many times the tensor's current amax..."""
    stale_scale_steps: int = Field(default=20, ge=1)
    """...for this many consecutive measured steps. One outlier can pin the scale for the whole
    history (1,024 steps by default), flushing the tensor's ordinary values towards zero."""
    underflow_growth_factor: float = Field(default=10.0, gt=1)
    underflow_min: float = Field(default=1000.0, ge=0)
    underflow_checks: int = Field(default=3, ge=1)
    """Consecutive counted steps with underflows above factor x baseline + min."""
    # -- policy --
    widespread_fraction: float = Field(default=0.5, gt=0, le=1)
    """Fall back the whole model when at least this fraction of FP8 modules is implicated."""
    rollback_margin_steps: int = Field(default=20, ge=0)
    """Roll back to a checkpoint at least this many steps before the anomaly's onset."""
    known_good_after_steps: int = Field(default=20, ge=0)
    """A checkpoint becomes known-good once this many clean steps followed it."""
    skip_batches: int = Field(default=200, ge=0)
    """Extra batches skipped after the bad window on rollback (PaLM skipped 200-500)."""
    rollback_lr_scale: float = Field(default=1.0, gt=0, le=1)
    rollback_lr_steps: int = Field(default=0, ge=0)
    require_measured_harm: bool = True
    """Once the run's agent probes FP8 harm (``monitor.step(loss, loss_fn=...)``), fall back only
    on measured harm or broken numerics (infinite amax, saturation beyond 16x its bound); FP8
    anomalies the probe finds harmless are alerts. On the H200 a fallback on numerics alone cost
    more than the outlier it cured (docs/gpu.md). Runs without the probe decide on numerics alone."""
    incident_steps: int = Field(default=200, ge=1)
    """Measured harm within this many steps of a fallback belongs to the same incident, as do the FP8
    findings of those steps: more harm, or a rollback, escalates the fallback (every module those
    findings implicate, then the whole model) instead of one bisection at a time. On the H200 the
    piecemeal path (6, 5, 1 modules, then the whole model) cost a second rollback (docs/gpu.md)."""
    promote_after_steps: int = Field(default=500, ge=1)
    """Clean steps in BF16 before a fallen-back module is re-promoted (with fresh FP8 state)."""
    escalate_rollbacks: int = Field(default=3, ge=1)
    escalate_window_steps: int = Field(default=2000, ge=1)
    """After this many rollbacks within this many steps: a page (and whole-model BF16 when FP8
    findings are part of the trouble)."""
    cooldown_steps: int = Field(default=50, ge=0)
    """A rule that fired on a module stays quiet on that module this long (one finding per episode);
    other modules crossing the line meanwhile get findings of their own."""
