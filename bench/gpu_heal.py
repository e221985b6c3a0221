"""A real FP8 instability, healed: one script, three runs of the same training on the same data.

    python bench/gpu_heal.py --out DIR                    # Transformer Engine on a GPU
    python bench/gpu_heal.py --backend emulation --small  # the same story on the CPU (emulated FP8)
    python bench/gpu_heal.py --outlier 1e4 --noise        # + the unguarded run again: run-to-run noise
    python bench/gpu_heal.py --runs fp8_unguarded,fp8_unguarded_again   # the noise check alone

The model is fp8guard's byte-level GPT (``fp8guard.nanogpt``) trained on the Python standard
library's sources; on the GPU every Linear (the head included) is a ``te.Linear`` under
``te.autocast(DelayedScaling(HYBRID, amax_history_len=1024, "max"))`` inside a bf16
``torch.autocast``; the emulation backend casts the same Linears.

What goes wrong, honestly said: it is *injected*. At ``--incident`` one data batch carries an
outlier feature: the input of every block's attention QKV projection (``--target-linear``,
``--target-blocks``), i.e. the LayerNorm output, is multiplied by ``--outlier`` for that batch
only (the kind of activation outlier large models grow in a few channels). BF16 takes one bad step and
moves on. Under delayed scaling that batch's amax enters the 1,024-step amax history, whose
maximum sets the layer's scale: for the next 1,024 steps the layer's ordinary inputs are cast
``--outlier`` times below the FP8 range, most of them flushed to zero, and the run trains on
with a crippled layer. That is TE's documented behaviour, not a simulation: nothing but the one
batch is touched.

The three runs:
1. ``fp8_unguarded``: FP8, telemetry streamed to the service with ``dry_run`` (fp8guard detects
   and records what it would do, but sends nothing);
2. ``fp8_guarded``: FP8, fp8guard service + agent acting (BF16 fallback, re-promotion with a
   fresh FP8 state, checkpoint rollback, whatever its policy decides);
3. ``bf16``: the same training in BF16;
4. with ``--noise`` (or named in ``--runs``): ``fp8_unguarded_again``, the unguarded run once more
   with nothing changed. Two runs under the same empty action list differ by the platform's
   run-to-run noise alone (on the CPU they are bit-identical; on a GPU nondeterministic kernels
   can make them drift): ``noise`` reports where their losses first differ and their held-out
   ratio, and ``same_as_unguarded`` where every other FP8 run's losses first leave the unguarded
   run's (a guarded run that received no command should not, beyond that noise).
   ``--deterministic`` asks torch, cuBLAS and TE for deterministic kernels (slower), to tell
   the two apart.

Reported: the loss curves, each run's findings and actions with their steps, when the
unguarded run's loss left the BF16 curve (the "spike": the first step after the incident where
its 10-step mean loss is 5% above BF16's and stays there for the next 20 steps), and each run's
final loss on the same held-out batches (``val_loss``, in the run's own precision) beside the mean
training loss of its last 20 steps. One JSON line, also written to ``OUT/gpu_heal.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._batch_check import batched_vs_at_once
from bench.scenarios import steps_to_apply

# TE 2.20 refuses its own pickled DelayedScaling checkpoint state unless told otherwise; the
# checkpoints here are written and read by this process only.
os.environ.setdefault("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")

GUARD = {
    # Horizons for a run of hundreds of steps (the defaults are set for real runs).
    "warmup_steps": 20, "rollback_margin_steps": 10, "known_good_after_steps": 10, "skip_batches": 10,
    "promote_after_steps": 120, "cooldown_steps": 30, "saturation_steps": 5, "amax_growth_warmup": 100,
    "stale_scale_steps": 10, "rollback_lr_scale": 0.1, "rollback_lr_steps": 40, "loss_z": 6.0,
}


@dataclass(kw_only=True)
class HealConfig:
    backend: str = "te"
    steps: int = 600
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    block_size: int = 256
    batch_size: int = 32
    lr: float = 1e-3
    history: int = 1024
    incident: int = 250
    """First batch (data position) in which the dormant unit lights up."""
    incident_batches: int = 100
    ramp_batches: int = 30
    """The unit brightens geometrically over these first batches of the window (outlier
    amplification grows, it does not appear at full size), then stays at ``outlier``."""
    outlier: float = 1e6
    """The lit unit's peak value, relative to the largest magnitude of the other units in that input."""
    target_blocks: str = "all"
    """Which blocks carry the unit: ``all`` or a comma list of indexes."""
    target_linear: str = "attn_proj,mlp_proj"
    """Whose input holds the unit: a comma list of ``attn_qkv``, ``attn_proj`` (the attention output),
    ``mlp_fc``, ``mlp_proj`` (the MLP activation), or ``all`` (these four and ``lm_head``)."""
    lr_burst: float = 1.0
    """An aggressive learning-rate phase: the rate times this for ``lr_burst_steps`` from ``incident``."""
    lr_burst_steps: int = 40
    checkpoint_every: int = 25
    count_interval: int = 10
    """Exact overflow/underflow counts every this many steps (TE: its inspection API); 0: off."""
    count_stagger: bool = True
    """``MonitorConfig.count_stagger`` (its default): each TE module counted at its own step of the
    interval; False counts every module at the interval's multiple."""
    operands_per_launch: int | None = None
    """``count_batch.OPERANDS_PER_LAUNCH`` for the runs (TE's counted casts per count launch); None:
    the library's default (8); 0: one launch per operand."""
    harm_interval: int = 25
    """The harm probe every this many steps in both FP8 runs (plus whenever the tripwire fires);
    0 runs the policy on numerics alone, as before the probe existed."""
    val_batches: int = 20
    seed: int = 0


def _device(cfg: HealConfig) -> Any:
    import torch

    return torch.device("cuda" if cfg.backend == "te" else "cpu")


def _to_te(model: Any) -> None:
    """Every nn.Linear (blocks and head) becomes a te.Linear with the same weights (same init)."""
    import torch
    import transformer_engine.pytorch as te

    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            full = f"{name}.{child_name}" if name else child_name
            new = te.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                            params_dtype=torch.float32, device="cuda", name=full)
            with torch.no_grad():
                new.weight.copy_(child.weight)
                if child.bias is not None:
                    new.bias.copy_(child.bias)
            setattr(parent, child_name, new)


RUNS = ("fp8_unguarded", "fp8_guarded", "bf16", "fp8_unguarded_again")
"""The runs this bench knows; ``fp8_unguarded_again`` repeats ``fp8_unguarded`` (the noise check)."""


def train(cfg: HealConfig, mode: str, *, url: str | None, run_id: str, workdir: Path) -> dict[str, Any]:
    import torch

    from fp8guard.agent import EmulationConfig, Monitor, MonitorConfig, NullTransport, emulate_fp8
    from fp8guard.agent.checkpoint import CheckpointManager
    from fp8guard.agent.remediation import Remediator
    from fp8guard.nanogpt import GPT, GPTConfig, TextBatches, stdlib_text

    device = _device(cfg)
    fp8 = mode != "bf16"
    torch.manual_seed(cfg.seed)
    gcfg = GPTConfig(block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd)
    model = GPT(gcfg)
    emu = None
    te_ctx: Any = None
    if cfg.backend == "te":
        model = model.to(device)
        _to_te(model)
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling, Format

        recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=cfg.history, amax_compute_algo="max")

        def te_ctx() -> Any:
            return te.autocast(enabled=fp8, recipe=recipe)
    elif fp8:
        emu = emulate_fp8(model, EmulationConfig(amax_history_len=cfg.history))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, fused=device.type == "cuda")
    burst = range(cfg.incident, cfg.incident + cfg.lr_burst_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * (cfg.lr_burst if s in burst else 1.0))
    data = TextBatches(stdlib_text(4_000_000), block_size=cfg.block_size, batch_size=cfg.batch_size, seed=cfg.seed)
    current = {"batch": -1}
    install_dormant_unit(model, cfg, lambda: current["batch"])

    def forward(x: Any, y: Any) -> Any:
        with contextlib.ExitStack() as stack:
            if device.type == "cuda":
                stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
            if te_ctx is not None:
                stack.enter_context(te_ctx())
            _, loss = model(x, y)
        return loss

    # TE creates its FP8 state at the first FP8 forward: one warm-up forward/backward (no update)
    # on a batch outside the training stream before the monitor attaches.
    wx, wy = data.batch(10_000_000)
    forward(wx.to(device), wy.to(device)).backward()
    opt.zero_grad(set_to_none=True)
    if emu is not None:
        emu.update()

    guarded = mode == "fp8_guarded"
    monitor = None
    if fp8:
        monitor = Monitor(MonitorConfig(url=url, run_id=run_id, model_name=f"byte-gpt-{cfg.n_layer}x{cfg.n_embd}",
                                        flush_interval_steps=5, command_check_interval_steps=5,
                                        count_interval_steps=cfg.count_interval, count_stagger=cfg.count_stagger,
                                        harm_interval_steps=cfg.harm_interval,
                                        run_config={"bench": "gpu_heal", "mode": mode}),
                          transport=None if url else NullTransport())
    checkpoints = CheckpointManager(workdir / f"ckpt-{mode}", model=model, optimizer=opt, scheduler=sched,
                                    data_state=lambda: {"position": data.position},
                                    load_data_state=lambda s: setattr(data, "position", int(s["position"])),
                                    every_n_steps=cfg.checkpoint_every, keep_last=8)
    if monitor is not None:
        monitor.attach(model, opt)
        if guarded:
            monitor.handler = Remediator(sources=list(monitor.sources), checkpoints=checkpoints, optimizer=opt)
    losses: dict[int, float] = {}
    timeline: list[tuple[int, float]] = []  # (step, loss) in execution order, rollbacks included
    step = 0
    t0 = time.perf_counter()
    while step < cfg.steps:
        current["batch"] = data.position
        x, y = data.next()
        loss = forward(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if emu is not None:
            emu.update()
        if monitor is not None:
            monitor.step(loss, grad_norm=norm, step=step, tokens=(step + 1) * x.numel(),
                         loss_fn=lambda x=x, y=y: forward(x.to(device), y.to(device)))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss.detach())  # the bench's own bookkeeping (one sync per step)
        losses[step] = value
        timeline.append((step, value))
        if checkpoints.maybe_save(step) is not None and monitor is not None:
            monitor.event("checkpoint_saved", step=step, data={"path": str(checkpoints.path_for(step))})
        step = monitor.next_step if monitor is not None else step + 1
    seconds = time.perf_counter() - t0
    if monitor is not None:
        monitor.close()
    # The final comparison uses the same held-out batches for every run (text the training never
    # draws: a different crop seed), evaluated in the run's own precision at the end.
    held_out = TextBatches(stdlib_text(4_000_000), block_size=cfg.block_size, batch_size=cfg.batch_size,
                           seed=cfg.seed + 7919)
    with torch.no_grad():
        val = [float(forward(*(t.to(device) for t in held_out.batch(i)))) for i in range(cfg.val_batches)]
    curve = [losses[s] for s in sorted(losses)]
    return {"mode": mode, "losses": curve, "timeline_len": len(timeline), "seconds": round(seconds, 1),
            "final_train_loss": statistics.fmean(curve[-20:]), "val_loss": statistics.fmean(val),
            "run_id": run_id if fp8 else None}


def install_dormant_unit(model: Any, cfg: HealConfig, batch: Any) -> None:
    """The injection: input unit 0 of every target projection has a zero weight column, kept zero
    (a gradient hook), so in exact arithmetic the unit does nothing. While ``batch()`` is in the
    incident window the unit lights up to ``cfg.outlier`` times the largest magnitude of the other
    units of that input, growing geometrically over ``cfg.ramp_batches`` batches."""
    import torch

    window = range(cfg.incident, cfg.incident + cfg.incident_batches)
    unit = 0

    def light_up(_: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        b = batch()
        if b not in window:
            return None
        k = b - cfg.incident + 1
        x = args[0].clone()
        # a device op, no host sync: the unit carries `factor` times the input's own largest magnitude
        x[..., unit] = cfg.outlier ** min(1.0, k / max(cfg.ramp_batches, 1)) * args[0].detach().abs().amax()
        return (x,)

    def keep_dormant(grad: Any) -> Any:
        grad = grad.clone()
        grad[:, unit] = 0.0
        return grad

    for name in _target_modules(cfg):
        lin = model.get_submodule(name)
        with torch.no_grad():
            lin.weight[:, unit] = 0.0
        lin.weight.register_hook(keep_dormant)
        lin.register_forward_pre_hook(light_up)


def _target_modules(cfg: HealConfig) -> list[str]:
    if cfg.target_linear == "lm_head":
        return ["lm_head"]
    blocks = range(cfg.n_layer) if cfg.target_blocks == "all" else [int(k) for k in cfg.target_blocks.split(",")]
    names = ("attn_qkv", "attn_proj", "mlp_fc", "mlp_proj") if cfg.target_linear == "all" \
        else tuple(cfg.target_linear.split(","))
    return [f"blocks.{k}.{n}" for k in blocks for n in names] + (["lm_head"] if cfg.target_linear == "all" else [])


def _spike_step(unguarded: list[float], reference: list[float], start: int) -> int | None:
    """First step >= start where the 10-step mean loss runs 5% above the reference's, for 20 steps."""
    def mean10(c: list[float], s: int) -> float:
        return statistics.fmean(c[max(0, s - 9):s + 1])

    n = min(len(unguarded), len(reference))
    for s in range(start, n - 20):
        if all(mean10(unguarded, t) > 1.05 * mean10(reference, t) for t in range(s, s + 20)):
            return s
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["te", "emulation"], default="te")
    parser.add_argument("--small", action="store_true", help="a 2x64 model and 300 steps (CPU smoke run)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--incident", type=int)
    parser.add_argument("--incident-batches", dest="incident_batches", type=int)
    parser.add_argument("--ramp-batches", dest="ramp_batches", type=int)
    parser.add_argument("--outlier", type=float)
    parser.add_argument("--lr-burst", dest="lr_burst", type=float)
    parser.add_argument("--history", type=int)
    parser.add_argument("--target-blocks", dest="target_blocks")
    parser.add_argument("--target-linear", dest="target_linear")
    parser.add_argument("--harm-interval", dest="harm_interval", type=int)
    parser.add_argument("--count-interval", dest="count_interval", type=int)
    parser.add_argument("--count-stagger", dest="count_stagger", action=argparse.BooleanOptionalAction, default=None,
                        help="count each TE module at its own step of the interval (MonitorConfig.count_stagger, "
                             "the default), or with --no-count-stagger every module at the interval's multiple")
    parser.add_argument("--operands-per-launch", dest="operands_per_launch", type=int,
                        help="count_batch.OPERANDS_PER_LAUNCH for the runs (0: one count launch per operand)")
    parser.add_argument("--check-batch", dest="check_batch", action="store_true",
                        help="count every batched operand also at once and compare (bench/_batch_check.py)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--runs", default="fp8_unguarded,fp8_guarded,bf16",
                        help=f"comma list of {', '.join(RUNS)} (in this order of training)")
    parser.add_argument("--noise", action="store_true",
                        help="also run fp8_unguarded_again: the unguarded run twice (run-to-run noise)")
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic kernels (torch, cuBLAS workspace, TE's NVTE_ALLOW_NONDETERMINISTIC_ALGO=0)")
    args = parser.parse_args()
    modes = [m for m in RUNS if m in args.runs.split(",") or (args.noise and m == "fp8_unguarded_again")]
    unknown = set(args.runs.split(",")) - set(RUNS)
    if unknown or not modes:
        parser.error(f"--runs: unknown {sorted(unknown)}; choose from {', '.join(RUNS)}")
    if args.deterministic:
        # Before CUDA, cuBLAS or TE start: they read these once.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
        import torch

        torch.use_deterministic_algorithms(True, warn_only=True)
    cfg = HealConfig(backend=args.backend)
    if args.small:
        cfg = HealConfig(backend=args.backend, steps=300, n_layer=2, n_head=2, n_embd=64, block_size=64,
                         batch_size=8, incident=150, incident_batches=60, ramp_batches=20, checkpoint_every=25)
    for name in ("steps", "incident", "incident_batches", "ramp_batches", "outlier", "target_blocks", "target_linear", "lr_burst",
                 "history", "harm_interval", "count_interval", "count_stagger", "operands_per_launch"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    if args.check_batch and cfg.backend != "te":
        parser.error("--check-batch checks TE's batched counting: it needs --backend te")
    if cfg.backend == "te":  # read by the TE source when a monitor attaches; recorded as it ran
        from fp8guard.agent.kernels import count_batch

        if cfg.operands_per_launch is not None:
            count_batch.OPERANDS_PER_LAUNCH = cfg.operands_per_launch
        cfg.operands_per_launch = count_batch.OPERANDS_PER_LAUNCH
        if args.check_batch and cfg.operands_per_launch < 2:
            parser.error("--check-batch compares batched counts: it needs --operands-per-launch of 2 or more")
    if cfg.backend == "te":
        from bench._te_model import require_te

        require_te("gpu_heal")

    import httpx

    from fp8guard.demo import _Service

    workdir = Path(tempfile.mkdtemp(prefix="fp8guard-heal-"))
    service = _Service(f"sqlite:///{workdir / 'fp8guard.db'}", "127.0.0.1", 8765)
    api = httpx.Client(base_url=service.base, timeout=30)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    try:
        for mode in modes:
            run_id = f"heal-{mode.replace('_', '-')}-{stamp}"
            if mode != "bf16":
                guard = dict(GUARD, dry_run=mode.startswith("fp8_unguarded"))
                api.put(f"/v1/runs/{run_id}", json={"model": "byte-gpt", "guard": guard,
                                                    "recipe": {"backend": cfg.backend, "history": cfg.history}}
                        ).raise_for_status()
            with (batched_vs_at_once() if args.check_batch and mode != "bf16" else contextlib.nullcontext({})) as check:
                result = train(cfg, mode, url=service.base if mode != "bf16" else None, run_id=run_id,
                               workdir=workdir)
            if check:
                result["batch_check"] = check
            if mode != "bf16":
                time.sleep(0.5)  # the service stores the last batches
                result["findings"] = [{k: f[k] for k in ("id", "step", "onset_step", "rule", "severity", "modules",
                                                         "explanation") if k in f}
                                      for f in api.get(f"/v1/runs/{run_id}/findings").json()]
                result["actions"] = [{k: a[k] for k in ("step", "kind", "status", "reason", "payload", "finding_ids",
                                                        "applied_step") if k in a}
                                     for a in api.get(f"/v1/runs/{run_id}/actions").json()]
                # per applied command: steps from the first step its findings saw to the step applied
                result["steps_to_apply"] = steps_to_apply(result["findings"], result["actions"])
                result["agent_events"] = [{"step": e["step"], "kind": e["kind"],
                                           "data": {k: v for k, v in e["data"].items()
                                                    if k in ("modules", "checkpoint_step", "skip_batches", "status", "gap",
                                                             "gap_after", "band_high", "harmful")}}
                                          for e in api.get(f"/v1/runs/{run_id}/events").json()
                                          if e["kind"] in ("fallback_applied", "promotion_applied", "rollback_applied",
                                                           "harm_attributed", "promotion_trial")]
                scalars = api.get(f"/v1/runs/{run_id}/scalars",
                                  params={"fields": "fp8_loss_gap", "width": 100_000}).json()
                result["fp8_loss_gap"] = [[s, g] for s, g in zip(scalars["steps"], scalars["max"]["fp8_loss_gap"],
                                                                  strict=True) if g is not None]
            runs[mode] = result
    finally:
        api.close()
        service.close()
    bf16 = runs["bf16"]["losses"] if "bf16" in runs else None
    unguarded = runs["fp8_unguarded"]["losses"] if "fp8_unguarded" in runs else None
    spike = _spike_step(unguarded, bf16, cfg.incident) if unguarded and bf16 else None
    first = {m: min((f["step"] for f in runs[m].get("findings", []) if f["step"] >= cfg.incident), default=None)
             for m in ("fp8_unguarded", "fp8_guarded") if m in runs}

    def ratio(a: str, b: str) -> float | None:
        return round(runs[a]["val_loss"] / runs[b]["val_loss"], 4) if a in runs and b in runs else None

    result = {
        "bench": "gpu_heal", "config": asdict(cfg), "guard": GUARD,
        "device": _device_name(cfg),
        "injected": (f"batches {cfg.incident}-{cfg.incident + cfg.incident_batches - 1}: input unit 0 of "
                     f"{', '.join(_target_modules(cfg))} (a unit whose weights are zero and frozen in every run) "
                     f"carries up to {cfg.outlier:g}x the largest magnitude of the other units, growing "
                     f"geometrically over the first {cfg.ramp_batches} batches"),
        "unguarded_loss_leaves_bf16_at": spike,
        "first_finding_step": first,
        "steps_to_apply": runs["fp8_guarded"].get("steps_to_apply") if "fp8_guarded" in runs else None,
        "detected_steps_before_spike": (spike - first["fp8_guarded"])
        if spike is not None and first.get("fp8_guarded") is not None else None,
        "val_loss": {m: round(r["val_loss"], 4) for m, r in runs.items()},
        "final_train_loss": {m: round(r["final_train_loss"], 4) for m, r in runs.items()},
        "guarded_vs_bf16": ratio("fp8_guarded", "bf16"),
        "unguarded_vs_bf16": ratio("fp8_unguarded", "bf16"),
        "same_as_unguarded": {m: same_as(runs[m], runs["fp8_unguarded"]) for m in runs
                              if m not in ("fp8_unguarded", "bf16") and "fp8_unguarded" in runs},
        "noise": same_as(runs["fp8_unguarded_again"], runs["fp8_unguarded"])
        if "fp8_unguarded_again" in runs and "fp8_unguarded" in runs else None,
        "deterministic": args.deterministic,
        "batch_check": {m: {k: r["batch_check"].get(k) for k in ("operands", "differing", "alone", "still_held",
                                                                  "launch_failed", "aborted")}
                        for m, r in runs.items() if "batch_check" in r} or None,
        "runs": runs, "seconds": round(time.perf_counter() - started, 1),
    }
    line = json.dumps(result, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_heal.json").write_text(line + "\n")
    if any(r["batch_check"]["differing"] != 0 for r in runs.values() if "batch_check" in r):
        sys.exit("gpu_heal: --check-batch: batched counts differ from counts taken at once (see batch_check)")


def same_as(run: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """How far ``run`` is from ``reference`` (the unguarded run): whether every step's training loss
    is bit-identical, the first step where they differ, the largest relative difference of a step's
    loss, the commands ``run`` applied, and the ratio of their held-out losses."""
    a, b = run["losses"], reference["losses"]
    diff = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    rel = max((abs(x - y) / abs(y) for x, y in zip(a, b, strict=True) if y), default=0.0)
    applied = sum(1 for act in run.get("actions", []) if act.get("status") == "applied")
    return {"identical_losses": a == b, "first_diff_step": diff[0] if diff else None,
            "max_rel_step_diff": rel, "commands_applied": applied,
            "val_ratio": run["val_loss"] / reference["val_loss"]}


def _device_name(cfg: HealConfig) -> str:
    import torch

    return torch.cuda.get_device_name() if cfg.backend == "te" else "cpu (emulated FP8)"


if __name__ == "__main__":
    main()
