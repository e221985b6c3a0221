"""Run by torchrun in test_healing_distributed.py: the README's healing loop under DDP with gloo
on the CPU (emulated FP8, ``heal=HealConfig`` + ``monitor.batches``); one rank alone receives a
rollback: rank 0, or (second argument ``1``) rank 1 as the only reporting rank
(``report_ranks=[1]``, as for a last pipeline stage that holds the loss). Every rank writes the
steps and batches it trained and hashes of its weights."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from fp8guard.agent import HealConfig, Monitor, MonitorConfig, NullTransport, emulate_fp8

ROLLBACK = {"id": 1, "kind": "rollback", "checkpoint_step": 9, "skip_batches": 2, "lr_scale": 0.5,
            "lr_scale_steps": 3, "reason": "loss spike"}


def param_hash(model: nn.Module) -> str:
    """The weights only: the emulation's amax histories are per rank (no amax all-reduce)."""
    h = hashlib.sha256()
    for name, t in model.named_parameters():
        h.update(name.encode())
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    out_dir = Path(sys.argv[1])
    receiver = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 1))
    emulate_fp8(model)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    g = torch.Generator().manual_seed(100 + rank)  # a shard per rank
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(40)]
    index = {id(x): i for i, (x, _) in enumerate(data)}
    reporters = "auto" if receiver == 0 else [receiver]
    monitor = Monitor(MonitorConfig(run_id="dist-heal", command_check_interval_steps=5, tripwire=False,
                                    report_ranks=reporters), transport=NullTransport())
    monitor.attach(model, opt, scheduler=sched, heal=HealConfig(out_dir / "ckpt", every_n_steps=5))
    seen: list[tuple[int, int]] = []
    for x, y in monitor.batches(data, steps=20):
        step = monitor.next_step
        seen.append((step, index[id(x)]))
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        if rank == receiver and step == 12:
            monitor.receive_commands([ROLLBACK])
        monitor.step(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
    monitor.close()
    healer = monitor.healer
    assert healer is not None
    result = {"rank": rank, "seen": seen, "final_hash": param_hash(model), "segment": monitor.segment,
              "checkpoints": healer.checkpoints.steps(), "reporting": monitor.reporting,
              "command_rank": monitor.command_rank}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
