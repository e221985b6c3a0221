"""One scenario's training run for ``bench/scenarios.py``: fp8guard's byte-level GPT in emulated
FP8 (the demo's model, data, checkpoints and remediator), with one instability injected.

Every injection is honest about what it touches, and each is the CPU-sized twin of a class of
the real H200 traces in issue #11:

- ``healthy``: nothing.
- ``weight_spike``: one weight row of one Linear (the row holding that weight's largest
  magnitude) x64 for a single step, then restored: the weight's amax jumps 64x for one step and
  delayed scaling clips it until its scale catches up.
- ``weight_ramp``: that row x1.03 per step from the onset on (a gradual outlier).
- ``lr_blowup``: the learning rate ``lr_factor`` times the healthy runs' from step 0.
- ``data_spike``: a few data batches of uniformly random bytes (the loss jumps; nothing in the
  FP8 numerics is wrong).
- ``heal``: ``bench/gpu_heal.py``'s dormant unit: a unit with zero, frozen weights lights up to
  1e6x in the inputs of two projections of every block for a window of batches (an activation
  outlier that pins delayed scaling's scale for the whole amax history).

Steps, data positions, initial weights and batches are all seeded: two runs of one scenario see
the same telemetry until a command changes their course, whatever the agent's batch size.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["KINDS", "Scenario", "TrainResult", "train"]

KINDS = ("healthy", "weight_spike", "weight_ramp", "lr_blowup", "data_spike", "heal")


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    kind: str
    seed: int = 0
    steps: int = 300
    lr: float = 3e-3
    """The healthy runs' learning rate (AdamW, no warm-up, gradients clipped at 1.0)."""
    onset: int = 150
    """Step (or, for data, batch position) where the injection starts."""
    target: str = "blocks.1.mlp_fc"
    """The Linear whose weight row is hit (weight_spike, weight_ramp)."""
    spike_factor: float = 64.0
    ramp_rate: float = 1.03
    lr_factor: float = 100.0
    bad_batches: int = 5
    heal_batches: int = 60
    heal_ramp_batches: int = 20
    checkpoint_every: int = 25
    harm_interval: int = 10
    """The agent's harm probe (two extra forwards) every this many steps; 0: off (numerics alone)."""
    n_layer: int = 2
    """Blocks of the GPT (each 4 FP8 projections; the head is the last FP8 module)."""
    outlier: float = 1e6
    heal_target: str = "attn_proj,mlp_proj"
    """heal: whose input carries the lit unit (``bench/gpu_heal.py --target-linear``)."""
    """heal: the lit unit's peak, relative to the largest magnitude of the other units."""
    lr_burst: float = 1.0
    """heal: the learning rate times this for ``lr_burst_steps`` steps from the onset (an
    aggressive phase, as ``bench/gpu_heal.py --lr-burst``)."""
    lr_burst_steps: int = 40

    def replace(self, **kw: Any) -> Scenario:
        return dataclasses.replace(self, **kw)


@dataclass
class TrainResult:
    losses: dict[int, float]
    """The loss of each step number, as last trained (after a rollback, the new timeline's)."""
    timeline: list[tuple[int, float]]
    """(step, loss) in execution order, rollbacks included."""
    lr0: float
    seconds: float


_GPT = {"block_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 64}


def train(sc: Scenario, *, url: str | None, run_id: str, workdir: Path, flush_steps: int, guarded: bool) -> TrainResult:
    """Train ``sc`` for ``sc.steps`` steps, streaming to ``url`` (None: no service at all), with the
    demo's agent setup; ``guarded`` attaches a remediator (else commands are acknowledged as ignored)."""
    import time

    import torch

    from fp8guard.agent import EmulationConfig, Monitor, MonitorConfig, NullTransport, emulate_fp8
    from fp8guard.agent.checkpoint import CheckpointManager
    from fp8guard.agent.remediation import Remediator
    from fp8guard.nanogpt import GPT, GPTConfig, TextBatches, stdlib_text

    warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad")
    torch.set_num_threads(1)  # bit-identical runs whatever else the machine is doing
    torch.manual_seed(sc.seed)
    gcfg = GPTConfig(**{**_GPT, "n_layer": sc.n_layer})
    model = GPT(gcfg)
    fp8 = emulate_fp8(model, EmulationConfig(amax_history_len=1024))  # TE's default history
    lr = sc.lr * (sc.lr_factor if sc.kind == "lr_blowup" else 1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    burst = range(sc.onset, sc.onset + sc.lr_burst_steps) if sc.kind == "heal" else range(0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: sc.lr_burst if s in burst else 1.0)
    data = TextBatches(stdlib_text(2_000_000), block_size=gcfg.block_size, batch_size=8, seed=sc.seed)
    current = {"batch": -1}
    before_step, after_backward = _injection(sc, model, lambda: current["batch"])
    monitor = Monitor(MonitorConfig(url=url, run_id=run_id, model_name="byte-gpt-2x64", flush_interval_steps=flush_steps,
                                    count_interval_steps=0, harm_interval_steps=sc.harm_interval,
                                    run_config={"scenario": sc.name, "kind": sc.kind}),
                      transport=None if url else NullTransport())
    checkpoints = CheckpointManager(workdir / f"ckpt-{run_id}", model=model, optimizer=opt, scheduler=sched,
                                    data_state=lambda: {"position": data.position},
                                    load_data_state=lambda s: setattr(data, "position", int(s["position"])),
                                    every_n_steps=sc.checkpoint_every, keep_last=20)
    monitor.attach(model, opt)
    if guarded:
        monitor.handler = Remediator(sources=list(monitor.sources), checkpoints=checkpoints, optimizer=opt)
    bad = range(sc.onset, sc.onset + sc.bad_batches) if sc.kind == "data_spike" else range(0)
    noise = torch.Generator().manual_seed(10_007 + sc.seed)
    losses: dict[int, float] = {}
    timeline: list[tuple[int, float]] = []
    step = 0
    t0 = time.perf_counter()
    while step < sc.steps:
        current["batch"] = data.position
        x, y = data.next()
        if current["batch"] in bad:  # a bad shard: uniformly random bytes
            seq = torch.randint(0, 256, (x.shape[0], x.shape[1] + 1), generator=noise)
            x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
        before_step(step)
        _, loss = model(x, y)
        loss.backward()
        after_backward(step)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        fp8.update()
        monitor.step(loss, step=step, tokens=(step + 1) * x.numel(), loss_fn=lambda x=x, y=y: model(x, y)[1])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss.detach())  # the bench's own bookkeeping (one sync per step)
        losses[step] = value
        timeline.append((step, value))
        # A checkpoint of the first step too (as runs that save their start do): divergence from
        # the start has somewhere to go back to.
        if (checkpoints.save(step) if step == 0 else checkpoints.maybe_save(step)) is not None:
            monitor.event("checkpoint_saved", step=step, data={"path": str(checkpoints.path_for(step))})
        step = monitor.next_step
    monitor.close()
    return TrainResult(losses=losses, timeline=timeline, lr0=lr, seconds=time.perf_counter() - t0)


Hook = Callable[[int], None]


def _injection(sc: Scenario, model: Any, batch: Callable[[], int]) -> tuple[Hook, Hook]:
    """(before the forward, after the backward) callbacks of ``sc``'s injection, by step."""
    import torch

    def nothing(_: int) -> None:
        return None

    if sc.kind in ("weight_spike", "weight_ramp"):
        w = model.get_submodule(sc.target).weight
        row = int(w.detach().abs().amax(dim=1).argmax())  # the row that sets the weight's amax
        state = {"spiked": False, "undone": False}

        def spike(step: int) -> None:
            if step == sc.onset and not state["spiked"]:  # once, even if a rollback replays the step
                state["spiked"] = True
                with torch.no_grad():
                    w[row] *= sc.spike_factor

        def unspike(step: int) -> None:
            if state["spiked"] and not state["undone"]:
                state["undone"] = True
                with torch.no_grad():
                    w[row] /= sc.spike_factor

        def ramp(step: int) -> None:
            if step >= sc.onset:
                with torch.no_grad():
                    w[row] *= sc.ramp_rate

        return (spike, unspike) if sc.kind == "weight_spike" else (ramp, nothing)
    if sc.kind == "heal":
        from bench.gpu_heal import HealConfig, install_dormant_unit

        install_dormant_unit(model, HealConfig(backend="emulation", n_layer=sc.n_layer, incident=sc.onset,
                                               incident_batches=sc.heal_batches,
                                               ramp_batches=sc.heal_ramp_batches, outlier=sc.outlier,
                                               target_linear=sc.heal_target), batch)
    return nothing, nothing
