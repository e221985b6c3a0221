"""``MonitorConfig``: everything the agent can be told, validated when it is built."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fp8guard.agent.errors import ConfigError
from fp8guard.wire import RUN_ID_PATTERN

__all__ = ["MonitorConfig", "SourceName"]

SourceName = Literal["te", "torchao", "emulation"]
_SOURCES: tuple[SourceName, ...] = ("te", "torchao", "emulation")


@dataclass(kw_only=True, slots=True)
class MonitorConfig:
    """Configuration of :class:`fp8guard.agent.Monitor`.

    >>> MonitorConfig(url="http://127.0.0.1:8000", run_id="gpt2-fp8-001")   # doctest: +ELLIPSIS
    MonitorConfig(url='http://127.0.0.1:8000', run_id='gpt2-fp8-001', ...)
    """

    url: str | None = None
    """The fp8guard service, e.g. ``http://127.0.0.1:8000``; default ``$FP8GUARD_URL``. With
    neither, telemetry is only counted (useful to measure overhead); pass ``transport=`` to
    the Monitor for anything else."""
    token: str | None = field(default=None, repr=False)
    """Bearer token for the service (a token with the ``ingest`` role); default
    ``$FP8GUARD_TOKEN``. Sent on every request, never logged nor shown in ``repr``."""
    run_id: str | None = None
    """The run's identity, the same on every rank; default ``$FP8GUARD_RUN_ID``, else rank 0
    makes one up and broadcasts it. Reusing an id resumes that run."""
    model_name: str | None = None
    """Shown in the dashboard; default: the model's class name."""
    run_config: dict[str, Any] | None = None
    """Free-form training configuration stored with the run (hyperparameters, data, ...)."""
    flush_interval_steps: int = 50
    """Copy the device buffers to the host and ship them every this many steps: the only
    device-to-host transfer the agent makes."""
    flush_interval_s: float = 10.0
    """...or after this many seconds, whichever comes first (slow steps still show up live)."""
    count_interval_steps: int = 0
    """Exact overflow/underflow counts every this many steps (1 = every step, 0 = never);
    counting reads every FP8 operand once more, so it costs more than the other statistics."""
    count_stagger: bool = True
    """Under Transformer Engine's inspection API, count each TE module at its own step of the
    ``count_interval_steps`` steps that end at a multiple of the interval (where the counts are
    read and reported), instead of every module at the multiple: every operand is still counted
    once per interval, and TE's debug path (its per-module Python, 32-40 ms of host time per
    counted step of the 604M model on the H200, docs/gpu.md) is spread over the interval's
    steps, where a GPU-bound loop's host has room, instead of stalling one step. A report then
    holds counts taken at up to ``interval - 1`` steps before its own; the first report after
    attach, a rollback or a cadence change waits for a whole interval. False counts every module
    at the multiple (one report's counts all from one step). Calibration (H200, 604M model,
    every 10th step, docs/gpu.md): on a host where TE's debug path is slow, 1.009x and 1.017x
    the plain step against 1.031x and 1.024x counting all modules at once; on a faster host
    1.012x either way; on a third 1.006x and 1.011x against 1.008x and 1.013x. The heal bench (a 1e6 outlier, counting every 10th step) took the same
    actions both ways (steps to apply 0, 1, 1; held-out loss within run-to-run noise), so
    staggering is the default; its first finding (amax growth, step 261 against 260) reads no
    counts, so a finding that does (underflow growth) may come up to an interval later, not
    measured there. Applies only when every source that counts can stagger (TE's inspection
    API in a debug session fp8guard owns); otherwise counts come at every multiple."""
    sources: Sequence[SourceName] | None = None
    """Which FP8 libraries to look for; None finds whatever the model uses. Naming a source
    makes its absence an error."""
    report_ranks: Literal["auto", "all", "zero"] | Sequence[int] = "auto"
    """Which ranks send telemetry. ``auto``: every rank, except that under Transformer Engine
    (whose amax all-reduce makes data-parallel replicas identical) only rank 0 reports."""
    compute_grad_norm: bool = True
    """Compute the global gradient norm on the device when ``step()`` is not given one."""
    grad_buffer: bool = False
    """Keep the gradients as views of one flat buffer per dtype (``fp8guard.agent.grad_buffer``),
    for a loop that zeroes them in place (``optimizer.zero_grad(set_to_none=False)``): the norm
    is then one launch and ``monitor.step`` reads no gradient, so its host time no longer grows
    with depth (under ``set_to_none=True`` every gradient is a new tensor each step and the
    monitor reads them all). Calibration (H200, TE, one call, docs/gpu.md): ``monitor.step``
    872 / 884 / 806 / 919 us at 12 / 24 / 48 / 96 layers with the buffer, 1,000 / 1,130 / 1,309 /
    2,390 us without; but zeroing in place cost the plain 604M loop 0.9-1.3 % of its step (a
    memset, and accumulation instead of taking the backward's gradients), more than the monitor:
    off by default, worth it for a host-bound loop or one that keeps its gradients already.
    Parameters without a gradient then have a zero one. A loop that sets the gradients to None
    every step makes the monitor give the buffer up after one step, with a warning. One process only."""
    segment: int = 0
    """Starting segment (incremented on every rollback); restored from checkpoints."""
    spool_dir: Path | None = None
    """Where batches wait while the service is unreachable or slow (default: a private per-user
    folder, ``~/.cache/fp8guard/spool/<run>/rank-<r>`` on Linux)."""
    spool_max_bytes: int = 256 * 2**20
    """Bound of the spool; the oldest batches are dropped beyond it, and the drop is reported."""
    max_pending_flushes: int = 8
    """Flushes waiting for the background shipper to encode them; beyond it the oldest is
    dropped (counted and reported as ``telemetry_dropped``), never the training step blocked.
    The network never holds the shipper up: batches it cannot send at once are spooled."""
    timeout_s: float = 10.0
    """Per request to the service. Training never waits for it: a background thread delivers,
    and while it waits batches go to the spool."""
    retry_max_s: float = 5.0
    """Longest pause between retries, and between probes of a service that failed."""
    command_check_interval_steps: int = 10
    """Under torch.distributed, look for remediation commands from the service every this many
    steps: rank 0 broadcasts them then (the agent's one intended host sync), so every rank
    applies a command at the same step. A single process applies a command at the first step
    boundary after it arrived."""
    tripwire: bool = True
    """Check every step's telemetry on the device (``fp8guard.agent.tripwire``): when it trips,
    flush at once and listen for the service's decision, so a command applies within two steps
    of the anomaly instead of after the next flush."""
    tripwire_loss_factor: float = 1.3
    """Trips when the loss exceeds this many times its running average (or is not finite)... A
    trip only makes the agent ship at once and listen: a false one costs a flush and at most
    ``tripwire_wait_s``, so the bounds sit well below the service's own rules."""
    tripwire_grad_factor: float = 5.0
    """...or the gradient norm this many times its running average (or is not finite)..."""
    tripwire_saturation: float = 8.0
    """...or a tensor's saturation ratio exceeds this (routine: 1.0-1.2 forward, ~4 backward)."""
    tripwire_warmup_steps: int = 10
    """Steps of averaging before the jump checks count (non-finite values count from the first)."""
    tripwire_early_loss_rise: float = 0.05
    """Before the warm-up ends: trips when the loss stays this fraction above the run's first loss
    for ``tripwire_early_steps`` steps in a row (the service's ``early_loss_rise``: a healthy
    run's loss only falls from its first value; a learning rate far too high lifts it by step 2)..."""
    tripwire_early_grad_factor: float = 20.0
    """...or the gradient norm stays this many times its smallest value so far (the service's
    ``early_grad_factor``)..."""
    tripwire_early_steps: int = 2
    """...for this many steps in a row: one fewer than the service's ``early_steps``, so the
    agent is already shipping and listening when the service's early rule fires."""
    tripwire_wait_s: float = 0.25
    """After it trips, the next step boundary waits up to this long for the decision (only then:
    a run that tripped is in trouble already; 0 never waits, and the command applies one step later)."""
    harm_interval_steps: int = 200
    """Every this many steps, when ``monitor.step`` gets a ``loss_fn``, measure what FP8 costs
    the loss on the current batch (``fp8guard.agent.harm``): two extra no-grad forwards, the
    training precision and every module in high precision. A forward is about a third of a
    training step, so the cost is about 2/3 / interval of step time (0.33 % at 200); 0 turns the
    probe off."""
    harm_band_z: float = 4.0
    """A probe's gap is harm when it exceeds the median of this run's gaps by this many robust
    spreads (and by at least ``harm_min_gap``): then the probe bisects to name the modules."""
    harm_min_gap: float = 0.005
    """The smallest relative loss gap ever called harm (0.5 %); before ``harm_warmup_probes``
    readings, gaps above 10x this are harm at once."""
    harm_warmup_probes: int = 5
    """Probes that build the band before it judges."""
    tripwire_lag_steps: int = 2
    """Under torch.distributed, every rank reads the tripwire's verdict of a step this many step
    boundaries later (waiting for it only if its device work has not completed by then), so all
    of them see it fire at the same boundary and enter one extra command broadcast together: a
    command applies this many steps after the anomaly. 1 answers a step sooner but lets the host
    run only one step ahead of the device."""
    tripwire_all_reduce: bool = False
    """Under torch.distributed, MAX-all-reduce each step's tripwire verdict (one int, enqueued on
    the device: no host sync, but a tiny collective per step), so that per-rank quantities (the
    loss, non-replicated amaxes) count for the two-step answer too, not only the gradient norm."""
    tripwire_backend: Literal["auto", "torch", "triton"] = "auto"
    """How the tripwire's per-step check runs: ``triton`` as one kernel launch
    (``fp8guard.agent.kernels.tripwire_check``), ``torch`` as some forty small torch ops (the
    reference: the same state and verdicts bit for bit), ``auto`` the kernel on CUDA with Triton."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Reserved for integrations."""

    def __post_init__(self) -> None:
        self.url = self.url if self.url is not None else os.environ.get("FP8GUARD_URL") or None
        self.run_id = self.run_id if self.run_id is not None else os.environ.get("FP8GUARD_RUN_ID") or None
        self.token = self.token if self.token is not None else os.environ.get("FP8GUARD_TOKEN") or None
        if self.token is not None and (not self.token.strip() or any(c.isspace() for c in self.token)):
            raise ConfigError("token must be a non-empty string without whitespace (the value `fp8guard token "
                              "create` printed); check MonitorConfig(token=...) or $FP8GUARD_TOKEN")
        if self.url is not None and not re.match(r"^https?://[^/\s]+", self.url):
            raise ConfigError(f"url {self.url!r} must look like http://host:port (the fp8guard service)")
        if self.run_id is not None and not re.match(RUN_ID_PATTERN, self.run_id):
            raise ConfigError(
                f"run_id {self.run_id!r} must be 1-128 characters of letters, digits and ._:- "
                "starting with a letter or digit")
        if self.flush_interval_steps < 1:
            raise ConfigError(f"flush_interval_steps must be >= 1, got {self.flush_interval_steps}")
        if self.flush_interval_steps > 10_000:
            raise ConfigError("flush_interval_steps above 10000 would hold too much on the device; use <= 10000")
        if not self.flush_interval_s > 0:
            raise ConfigError(f"flush_interval_s must be > 0, got {self.flush_interval_s}")
        if self.count_interval_steps < 0:
            raise ConfigError(f"count_interval_steps must be >= 0 (0 turns counting off), got {self.count_interval_steps}")
        if self.sources is not None:
            unknown = [s for s in self.sources if s not in _SOURCES]
            if unknown or not self.sources:
                raise ConfigError(f"sources must be a non-empty subset of {_SOURCES}, got {list(self.sources)}")
        if isinstance(self.report_ranks, str):
            if self.report_ranks not in ("auto", "all", "zero"):
                raise ConfigError(f"report_ranks must be 'auto', 'all', 'zero' or a list of ranks, got {self.report_ranks!r}")
        elif any((not isinstance(r, int)) or r < 0 for r in self.report_ranks):
            raise ConfigError(f"report_ranks must list non-negative ints, got {list(self.report_ranks)}")
        if self.segment < 0:
            raise ConfigError("segment must be >= 0")
        if self.spool_max_bytes < 1 << 20:
            raise ConfigError("spool_max_bytes must be at least 1 MiB")
        if self.max_pending_flushes < 1:
            raise ConfigError("max_pending_flushes must be >= 1")
        if self.command_check_interval_steps < 1:
            raise ConfigError("command_check_interval_steps must be >= 1")
        if not self.timeout_s > 0:
            raise ConfigError("timeout_s must be > 0")
        if not self.retry_max_s > 0:
            raise ConfigError("retry_max_s must be > 0")
        if not (self.tripwire_loss_factor > 1 and self.tripwire_grad_factor > 1 and self.tripwire_saturation > 1):
            raise ConfigError("tripwire_loss_factor, tripwire_grad_factor and tripwire_saturation must be > 1")
        if not (self.tripwire_early_loss_rise > 0 and self.tripwire_early_grad_factor > 1
                and self.tripwire_early_steps >= 1):
            raise ConfigError("tripwire_early_loss_rise must be > 0, tripwire_early_grad_factor > 1 and "
                              "tripwire_early_steps >= 1")
        if self.tripwire_warmup_steps < 0 or not self.tripwire_wait_s >= 0:
            raise ConfigError("tripwire_warmup_steps and tripwire_wait_s must be >= 0")
        if not 1 <= self.tripwire_lag_steps <= 16:
            raise ConfigError(f"tripwire_lag_steps must be between 1 and 16, got {self.tripwire_lag_steps}")
        if self.tripwire_backend not in ("auto", "torch", "triton"):
            raise ConfigError(f"tripwire_backend must be 'auto', 'torch' or 'triton', got {self.tripwire_backend!r}")
        if self.harm_interval_steps < 0 or self.harm_warmup_probes < 1:
            raise ConfigError("harm_interval_steps must be >= 0 (0: no probe) and harm_warmup_probes >= 1")
        if not (self.harm_band_z > 0 and self.harm_min_gap > 0):
            raise ConfigError("harm_band_z and harm_min_gap must be > 0")
