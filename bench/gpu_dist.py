"""Data-parallel FP8 training, guarded: every rank applies the service's commands at the same step.

    torchrun --standalone --nproc-per-node 2 bench/gpu_dist.py --out DIR                 # TE + NCCL
    torchrun --standalone --nproc-per-node 2 bench/gpu_dist.py --backend emulation --small --out DIR

One process per GPU (``--backend te``: NCCL, ``te.Linear`` under ``te.autocast`` with the amax
reduction group spanning the data-parallel world; ``emulation``: gloo on the CPU with fp8guard's
FP8 emulation), the byte-level GPT of ``bench/gpu_heal.py`` wrapped in DistributedDataParallel,
each rank on its own shard of the data. Rank 0 starts the fp8guard service in-process; under TE
only rank 0 reports (``report_ranks="auto"``: TE's amax all-reduce makes the replicas' FP8 state
identical, which the script checks), under emulation rank 0 reports for the group (its amaxes
are per rank).

Two instabilities are injected, honestly said: the dormant-unit outlier of ``gpu_heal.py``
(batches ``--incident`` .. +``--incident-batches``: the service falls the affected projections
back to BF16), then an aggressive learning-rate phase (``--lr-burst`` x for
``--lr-burst-steps`` from ``--burst-at``: the loss spikes and the service rolls the run back).
Commands reach rank 0 with its ingest answers; rank 0 broadcasts them at the command check every
``command_check_interval_steps`` (the agent's one intended sync point), and every rank applies
them at that step.

Writes ``OUT/gpu_dist.json`` (rank 0): per rank, whether it reported, the commands it applied and
at which step, whether its FP8 amaxes equal rank 0's, and a hash of its final weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")

from bench.gpu_heal import GUARD, HealConfig, _to_te, install_dormant_unit


def _param_hash(model: Any) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().float().cpu().reshape(-1).numpy().tobytes())
    return h.hexdigest()


def _fp8_amax(model: Any) -> Any:
    """The latest completed amax of every FP8 operand this rank holds (TE or emulation)."""
    import torch

    parts = []
    for m in model.modules():
        meta = getattr(m, "fp8_meta", None)
        if isinstance(meta, dict) and "scaling_fwd" in meta:
            parts += [meta["scaling_fwd"].amax_history[-1], meta["scaling_bwd"].amax_history[-1]]
        elif hasattr(m, "last_amax_fwd"):
            parts += [m.last_amax_fwd, m.last_amax_bwd]
    return torch.cat([p.detach().float().reshape(-1) for p in parts])


def run(cfg: HealConfig, args: argparse.Namespace) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from fp8guard.agent import EmulationConfig, Monitor, MonitorConfig, NullTransport, emulate_fp8
    from fp8guard.agent.checkpoint import CheckpointManager
    from fp8guard.agent.commands import Command, Outcome
    from fp8guard.agent.remediation import Remediator
    from fp8guard.nanogpt import GPT, GPTConfig, TextBatches, stdlib_text

    te_backend = cfg.backend == "te"
    dist.init_process_group("nccl" if te_backend else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if te_backend else torch.device("cpu")
    if te_backend:
        torch.cuda.set_device(device)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = GPT(GPTConfig(block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd))
    emu = None
    te_ctx: Any = None
    if te_backend:
        model = model.to(device)
        _to_te(model)
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling, Format

        recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=cfg.history, amax_compute_algo="max")

        def te_ctx() -> Any:
            return te.autocast(enabled=True, recipe=recipe, amax_reduction_group=dist.group.WORLD)
    else:
        emu = emulate_fp8(model, EmulationConfig(amax_history_len=cfg.history))

    current = {"batch": -1}
    install_dormant_unit(model, cfg, lambda: current["batch"])

    ddp = DistributedDataParallel(model, device_ids=[device.index] if te_backend else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=cfg.lr, weight_decay=0.0, fused=te_backend)
    burst = range(args.burst_at, args.burst_at + cfg.lr_burst_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * (cfg.lr_burst if s in burst else 1.0))
    data = TextBatches(stdlib_text(4_000_000), block_size=cfg.block_size, batch_size=cfg.batch_size,
                       seed=cfg.seed * 100 + rank)  # a shard per rank

    def forward(x: Any, y: Any) -> Any:
        if te_ctx is None:
            return ddp(x, y)[1]
        with torch.autocast("cuda", dtype=torch.bfloat16), te_ctx():
            return ddp(x, y)[1]

    wx, wy = data.batch(10_000_000)  # warm-up forward/backward outside the stream: TE creates its FP8 state
    forward(wx.to(device), wy.to(device)).backward()
    opt.zero_grad(set_to_none=True)
    if emu is not None:
        emu.update()

    workdir = Path(tempfile.mkdtemp(prefix=f"fp8guard-dist-r{rank}-"))
    service = None
    box: list[Any] = [None]
    run_id = f"dist-{cfg.backend}-{time.strftime('%Y%m%d-%H%M%S')}"
    if rank == 0:
        import httpx

        from fp8guard.demo import _Service

        service = _Service(f"sqlite:///{workdir / 'fp8guard.db'}", "127.0.0.1", 8766)
        httpx.put(f"{service.base}/v1/runs/{run_id}", json={"model": "byte-gpt", "guard": GUARD,
                                                           "recipe": {"backend": cfg.backend}}, timeout=10
                  ).raise_for_status()
        box = [service.base]
    dist.broadcast_object_list(box, src=0)
    base_url: str = box[0]

    class Recording(Remediator):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.applied: list[dict[str, Any]] = []

        def apply(self, command: Command, *, step: int) -> Outcome:
            outcome = super().apply(command, step=step)
            self.applied.append({"step": step, "kind": command.kind, "id": command.id, "status": outcome.status,
                                 "modules": list(command.modules or [])[:4], "error": outcome.error,
                                 "checkpoint_step": command.checkpoint_step})
            return outcome

    ckpts = CheckpointManager(workdir / "ckpt", model=model, optimizer=opt, scheduler=sched,
                              data_state=lambda: {"position": data.position},
                              load_data_state=lambda s: setattr(data, "position", int(s["position"])),
                              every_n_steps=cfg.checkpoint_every, keep_last=8)
    monitor = Monitor(MonitorConfig(url=base_url if rank == 0 else None, run_id=run_id, flush_interval_steps=5,
                                    command_check_interval_steps=5, count_interval_steps=10,
                                    report_ranks="auto" if te_backend else "zero"),
                      transport=None if rank == 0 else NullTransport())
    monitor.attach(model, opt)
    remediator = Recording(sources=list(monitor.sources), checkpoints=ckpts, optimizer=opt)
    monitor.handler = remediator
    amax_equal: list[bool] = []
    step = 0
    t0 = time.perf_counter()
    while step < cfg.steps:
        current["batch"] = data.position
        x, y = data.next()
        loss = forward(x.to(device), y.to(device))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        if emu is not None:
            emu.update()
        monitor.step(loss, grad_norm=norm, step=step)
        if monitor.next_step != step + 1:  # rolled back: continue from the restored step
            step = monitor.next_step
            continue
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0:  # TE's amax all-reduce: every rank holds rank 0's amaxes
            mine = _fp8_amax(model)
            ref = mine.clone()
            dist.broadcast(ref, src=0)
            amax_equal.append(bool(torch.equal(mine, ref)))
        if ckpts.maybe_save(step, extra={"monitor": monitor.state_dict()}) is not None and monitor.reporting:
            monitor.event("checkpoint_saved", step=step, data={"path": str(ckpts.path_for(step))})
        step = monitor.next_step
    seconds = time.perf_counter() - t0
    monitor.close()
    mine_out = {"rank": rank, "reporting": monitor.reporting, "applied": remediator.applied,
                "amax_equal_to_rank0": amax_equal, "final_hash": _param_hash(model), "segment": monitor.segment,
                "seconds": round(seconds, 1)}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine_out)
    result = None
    if rank == 0:
        import httpx

        api = httpx.Client(base_url=base_url, timeout=30)
        findings = [{k: f[k] for k in ("step", "rule", "modules")} for f in api.get(f"/v1/runs/{run_id}/findings").json()]
        actions = [{k: a[k] for k in ("step", "kind", "status")} for a in api.get(f"/v1/runs/{run_id}/actions").json()]
        detail = api.get(f"/v1/runs/{run_id}").json()
        api.close()
        applied = [[(a["step"], a["kind"], a["status"]) for a in r["applied"]] for r in gathered]
        result = {"bench": "gpu_dist", "backend": cfg.backend, "world": world,
                  "device": torch.cuda.get_device_name() if te_backend else "cpu",
                  "ranks": gathered, "findings": findings, "actions": actions,
                  "service_ranks": detail.get("ranks"),
                  "same_commands_same_steps_on_every_rank": all(a == applied[0] for a in applied),
                  "kinds_applied": sorted({k for _, k, s in applied[0] if s == "applied"}),
                  "one_reporting_rank": [r["reporting"] for r in gathered].count(True) == 1,
                  "replicas_identical_at_end": len({r["final_hash"] for r in gathered}) == 1,
                  "amax_identical_across_ranks": all(all(r["amax_equal_to_rank0"]) for r in gathered)}
        if service is not None:
            service.close()
    # every rank leaves together: a rank that tears gloo down while rank 0 still reads the
    # service aborted once in CI ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["te", "emulation"], default="te")
    parser.add_argument("--small", action="store_true", help="a 2x64 model and 220 steps (CPU run)")
    parser.add_argument("--burst-at", dest="burst_at", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cfg = HealConfig(backend=args.backend, steps=500, incident=150, incident_batches=60, outlier=1e6,
                     lr_burst=40.0, lr_burst_steps=30)
    if args.small:
        cfg = HealConfig(backend=args.backend, steps=220, n_layer=2, n_head=2, n_embd=64, block_size=64,
                         batch_size=8, incident=110, incident_batches=30, ramp_batches=10, outlier=1e6,
                         lr_burst=100.0, lr_burst_steps=20, checkpoint_every=20)
    if args.burst_at is None:
        args.burst_at = cfg.incident + cfg.incident_batches + (20 if args.small else 100)
    if cfg.backend == "te":
        from bench._te_model import require_te

        torch, _ = require_te("gpu_dist")
        if torch.cuda.device_count() < int(os.environ.get("WORLD_SIZE", "1")):
            print(json.dumps({"bench": "gpu_dist", "skipped": "fewer GPUs than ranks"}), flush=True)
            return
    if "RANK" not in os.environ:
        print(json.dumps({"bench": "gpu_dist", "skipped": "start it with torchrun --nproc-per-node N"}), flush=True)
        return
    result = run(cfg, args)
    if result is not None:
        print(json.dumps({k: v for k, v in result.items() if k != "ranks"}), flush=True)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "gpu_dist.json").write_text(json.dumps(result) + "\n")
    # Every rank has left the process group and its results are written: leave without the
    # interpreter's finalization. Twice in CI (once after the barrier above was added) a rank
    # aborted there with gloo's "terminate called without an active exception", after the run
    # had finished (C++ threads of the process group or its store torn down during interpreter
    # finalization: pytorch/pytorch#179291 describes the same abort).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
