"""``fp8guard demo``: the closed loop on one machine, no GPU.

A byte-level GPT trains on real text (the Python standard library's sources) in emulated FP8
(fp8guard's CPU emulation of Transformer Engine's delayed scaling), streaming to an fp8guard
service started in-process on SQLite. Two instabilities are *injected*, honestly so:

1. a window of "poisoned" data batches carries activation outliers: the input of one MLP
   projection is multiplied by ``outlier_scale`` for those batches, as outlier features do in
   large models. Its amax climbs and the FP8 rules see it; the agent's harm probe (every 10
   steps here) measures what FP8 costs the loss on the same batches, finds no harm (the gap stays
   in its band, about 0.1 %), so the service alerts and leaves the layer in FP8, where a
   numerics-only policy would have switched it to BF16 for nothing;
2. an aggressive learning-rate phase (``lr_burst_factor`` x the base rate): the loss spikes;
   the service rolls the run back to a known-good checkpoint before the onset, skips the bad
   window's batches and lowers the learning rate for a while.

``--compare`` trains the same run unguarded for the final-loss comparison.
"""

from __future__ import annotations

import functools
import json
import math
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DemoConfig", "DemoResult", "run_demo"]


@dataclass(kw_only=True)
class DemoConfig:
    steps: int = 300
    seed: int = 0
    port: int = 8000
    host: str = "127.0.0.1"
    database_url: str | None = None
    """Default: a fresh SQLite file in a temporary folder."""
    poison_start: int = 150
    poison_batches: int = 20
    outlier_scale: float = 300.0
    lr_burst_start: int = 200
    lr_burst_steps: int = 40
    lr_burst_factor: float = 40.0
    """The second injected instability: an aggressive learning-rate phase."""
    checkpoint_every: int = 25
    compare: bool = False
    progress: bool = True
    workdir: Path | None = None


@dataclass
class DemoResult:
    run_id: str
    url: str
    guarded_final_loss: float
    pre_incident_loss: float
    unguarded_final_loss: float | None
    findings: list[dict[str, Any]] = field(default_factory=list)
    actions: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    """The harm probe's fp8_loss_gap at each probe of the guarded run."""
    seconds: float = 0.0

    @property
    def recovered(self) -> bool:
        """The guarded run ended finite and at least as good as just before the incident."""
        return math.isfinite(self.guarded_final_loss) and self.guarded_final_loss <= self.pre_incident_loss * 1.02

    def gap_summary(self) -> dict[str, Any]:
        """What FP8 cost the loss, as the harm probe measured it, and the modules it blamed."""
        finite = sorted(g for g in self.gaps if math.isfinite(g))
        blamed = [e["data"].get("modules") for e in self.events if e["kind"] == "harm_attributed"]
        return {"probes": len(self.gaps), "median": round(finite[len(finite) // 2], 5) if finite else None,
                "max": round(finite[-1], 5) if finite else None, "attributed": blamed[0] if blamed else None}

    def steps_to_apply(self) -> list[int]:
        """Per applied command: steps from the first step its findings saw the anomaly to the step
        every rank applied it."""
        seen = {f["id"]: f["step"] for f in self.findings}
        out = []
        for a in self.actions:
            steps = [seen[i] for i in a.get("finding_ids") or [] if i in seen]
            if a["status"] == "applied" and a.get("applied_step") is not None and steps:
                out.append(int(a["applied_step"]) - min(steps))
        return out

    def summary_json(self) -> dict[str, Any]:
        latency = self.steps_to_apply()
        return {
            "recovered": self.recovered,
            "findings": len(self.findings),
            "finding_rules": sorted({f["rule"] for f in self.findings}),
            "actions": [a["kind"] for a in self.actions if a["kind"] in ("fallback", "promote", "rollback", "page")],
            "final_loss": round(self.guarded_final_loss, 4),
            "pre_incident_loss": round(self.pre_incident_loss, 4),
            "unguarded_final_loss": None if self.unguarded_final_loss is None else round(self.unguarded_final_loss, 4),
            "steps_to_apply": latency,
            "max_steps_to_apply": max(latency, default=None),
            "fp8_loss_gap": self.gap_summary(),
            "run_id": self.run_id,
            "seconds": round(self.seconds, 1),
        }


GUARD = {
    # A 300-step demo needs shorter horizons than the defaults, which are set for real runs.
    "warmup_steps": 20, "rollback_margin_steps": 10, "known_good_after_steps": 10, "skip_batches": 10,
    "promote_after_steps": 60, "cooldown_steps": 30, "saturation_steps": 5, "amax_growth_warmup": 100,
    "rollback_lr_scale": 0.05, "rollback_lr_steps": 60, "loss_z": 5.0,
}


class _Service:
    """uvicorn in a background thread, stopped by ``close``."""

    def __init__(self, url: str, host: str, port: int) -> None:
        import uvicorn

        from fp8guard.service import Settings, create_app
        from fp8guard.service.auth.tokens import issue_token
        from fp8guard.service.kinds import Role
        from fp8guard.service.settings import AuthMode, is_loopback
        from fp8guard.service.store import make_engine, upgrade

        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        # As `fp8guard serve` does: no tokens on loopback; beyond it, the demo makes its own.
        auth = AuthMode.OFF if is_loopback(host) else AuthMode.REQUIRED
        self.app = create_app(Settings(database_url=url, auth=auth))
        self.ingest_token: str | None = None
        self.read_token: str | None = None
        if auth is AuthMode.REQUIRED:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            self.ingest_token = issue_token(self.app.state.store, name=f"demo-agent-{stamp}", role=Role.INGEST)[0]
            self.read_token = issue_token(self.app.state.store, name=f"demo-reader-{stamp}", role=Role.READ)[0]
        self.port = _free_port(host, port)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="fp8guard-demo-service", daemon=True)
        self.thread.start()
        self.base = f"http://{host}:{self.port}"
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the demo service did not start")
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _free_port(host: str, preferred: int) -> int:
    import socket

    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError("no free port")


def _batch_loss(model: Any, x: Any, y: Any) -> Any:
    """The harm probe's loss of one batch: the model as it is now, on that batch."""
    return model(x, y)[1]


def _train(cfg: DemoConfig, *, guarded: bool, url: str | None, run_id: str, workdir: Path,
           progress: Any = None, token: str | None = None) -> tuple[list[float], float]:
    """Train; return (per-step losses, mean loss of the 10 steps before the poisoned window)."""
    import torch

    from fp8guard.agent import EmulationConfig, HealConfig, Monitor, MonitorConfig, NullTransport, emulate_fp8
    from fp8guard.nanogpt import GPT, GPTConfig, TextBatches, stdlib_text

    torch.manual_seed(cfg.seed)
    gcfg = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64)
    model = GPT(gcfg)
    emulate_fp8(model, EmulationConfig(amax_history_len=16))  # the monitor updates its scales each step
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    burst = range(cfg.lr_burst_start, cfg.lr_burst_start + cfg.lr_burst_steps)

    def lr_factor(s: int) -> float:
        # Linear warm-up (full-rate early training spikes on its own, not this demo's story),
        # then the injected aggressive phase.
        return min(1.0, (s + 1) / 50) * (cfg.lr_burst_factor if s in burst else 1.0)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    data = TextBatches(stdlib_text(2_000_000), block_size=gcfg.block_size, batch_size=8, seed=cfg.seed)
    poisoned = range(cfg.poison_start, cfg.poison_start + cfg.poison_batches)

    def outlier(_: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if data.position - 1 in poisoned:  # the batch being trained on: the one drawn last
            return (args[0] * cfg.outlier_scale,)
        return None

    target = model.get_submodule("blocks.1.mlp_proj")
    target.register_forward_pre_hook(outlier)
    # The harm probe every 10 steps (a 300-step demo; real runs: every 200): two extra forwards.
    monitor = Monitor(MonitorConfig(url=url, run_id=run_id, model_name="byte-gpt-2x64", flush_interval_steps=5,
                                    command_check_interval_steps=5, count_interval_steps=5, harm_interval_steps=10,
                                    run_config={"demo": True, "guarded": guarded}, token=token),
                      transport=None if url else NullTransport())
    # The guarded run heals (checkpoints, fallback, rollback with batch skipping and a lowered
    # learning rate); the unguarded twin trains the same way but never acts on anything.
    heal = HealConfig(workdir / "ckpt-guarded", every_n_steps=cfg.checkpoint_every, keep_last=8) if guarded else None
    monitor.attach(model, opt, scheduler=sched, heal=heal)
    losses: dict[int, float] = {}
    for x, y in monitor.batches(data, steps=cfg.steps):  # a rollback moves the data and the step back
        step = monitor.next_step
        _, loss = model(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the norm before clipping
        monitor.step(loss, grad_norm=norm, tokens=(step + 1) * x.numel(),
                     loss_fn=functools.partial(_batch_loss, model, x, y))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = float(loss.detach())  # the demo's own bookkeeping: one sync per step is fine here
        if progress is not None:
            progress(monitor.next_step, losses.get(monitor.next_step - 1, float("nan")))
    monitor.close()
    before = [losses[s] for s in range(cfg.poison_start - 10, cfg.poison_start) if s in losses]
    final = [losses[s] for s in range(cfg.steps - 10, cfg.steps) if s in losses]
    ordered = [losses[s] for s in sorted(losses)]
    return [*ordered, sum(final) / len(final)], sum(before) / len(before)


def run_demo(cfg: DemoConfig) -> DemoResult:
    import httpx
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    started = time.monotonic()
    workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix="fp8guard-demo-"))
    url = cfg.database_url or f"sqlite:///{workdir / 'fp8guard.db'}"
    service = _Service(url, cfg.host, cfg.port)
    run_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    agent_auth = {"authorization": f"Bearer {service.ingest_token}"} if service.ingest_token else {}
    httpx.put(f"{service.base}/v1/runs/{run_id}", headers=agent_auth,
              json={"model": "byte-gpt-2x64", "guard": GUARD, "recipe": {"emulation": "delayed", "history": 16}},
              timeout=10).raise_for_status()
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("loss {task.fields[loss]:.3f}"), TimeRemainingColumn())
    with Progress(*columns, disable=not cfg.progress, transient=False) as bar:
        task = bar.add_task("guarded FP8  ", total=cfg.steps, loss=float("nan"))
        losses, pre = _train(cfg, guarded=True, url=service.base, run_id=run_id, workdir=workdir,
                             progress=lambda s, v: bar.update(task, completed=min(s, cfg.steps), loss=v),
                             token=service.ingest_token)
        unguarded = None
        if cfg.compare:
            task2 = bar.add_task("unguarded FP8", total=cfg.steps, loss=float("nan"))
            u_losses, _ = _train(cfg, guarded=False, url=None, run_id=run_id + "-unguarded", workdir=workdir,
                                 progress=lambda s, v: bar.update(task2, completed=min(s, cfg.steps), loss=v))
            unguarded = u_losses[-1]
    reader = {"authorization": f"Bearer {service.read_token}"} if service.read_token else {}
    api = httpx.Client(base_url=service.base, timeout=30, headers=reader)
    result = DemoResult(
        run_id=run_id, url=service.base, guarded_final_loss=losses[-1], pre_incident_loss=pre,
        unguarded_final_loss=unguarded,
        findings=api.get(f"/v1/runs/{run_id}/findings").json(),
        actions=api.get(f"/v1/runs/{run_id}/actions").json(),
        events=api.get(f"/v1/runs/{run_id}/events").json(),
        gaps=[g for g in api.get(f"/v1/runs/{run_id}/scalars",
                                 params={"fields": "fp8_loss_gap", "width": 10_000}).json()["max"]["fp8_loss_gap"]
              if g is not None],
        seconds=time.monotonic() - started,
    )
    api.close()
    result.__dict__["_service"] = service
    return result


def print_summary(result: DemoResult, echo: Any) -> None:
    echo("")
    echo("Timeline")
    rows = [(f["step"], "finding", f"[{f['severity']}] {f['rule']}: {f['explanation']}") for f in result.findings]
    rows += [(a["step"], "decision", f"{a['kind']} ({a['status']}): {a['reason']}") for a in result.actions
             if a["kind"] != "alert"]
    rows += [(e["step"], "agent", f"{e['kind']} {json.dumps({k: v for k, v in e['data'].items() if k in ('command_id', 'checkpoint_step', 'modules', 'skip_batches')})}")
             for e in result.events if e["kind"] in ("rollback_applied", "fallback_applied", "promotion_applied",
                                                     "harm_attributed")]
    for step, who, text in sorted(rows, key=lambda r: (r[0] or 0, r[1])):
        echo(f"  step {step:>5}  {who:<8}  {text}")
    echo("")
    echo(f"Loss before the incident: {result.pre_incident_loss:.4f}")
    echo(f"Final loss, guarded:      {result.guarded_final_loss:.4f}")
    if result.unguarded_final_loss is not None:
        echo(f"Final loss, unguarded:    {result.unguarded_final_loss:.4f}")
    gap = result.gap_summary()
    if gap["probes"]:
        blamed = f"; harm attributed to {', '.join(gap['attributed'])}" if gap["attributed"] else ""
        echo(f"FP8 cost to the loss (harm probe, {gap['probes']} probes): median {100 * gap['median']:.2f} %, "
             f"max {100 * gap['max']:.2f} %{blamed}")
    latency = result.steps_to_apply()
    if latency:
        echo(f"Steps from anomaly to applied command: {', '.join(map(str, latency))} (max {max(latency)})")
    echo(f"Recovered: {'yes' if result.recovered else 'no'}   ({result.seconds:.0f} s)")
