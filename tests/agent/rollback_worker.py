"""Run by torchrun in test_rollback_distributed.py: DDP with gloo on the CPU, the tiny GPT in
emulated FP8, a CheckpointManager and a Monitor per rank. Rank 0 alone receives a fallback and
a rollback command; every rank writes what it applied, when, and hashes of its state."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fp8guard.agent import Monitor, MonitorConfig, NullTransport, emulate_fp8
from fp8guard.agent.checkpoint import CheckpointManager
from fp8guard.agent.commands import Command, Outcome
from fp8guard.agent.remediation import Remediator
from fp8guard.nanogpt import GPT, GPTConfig, TextBatches, stdlib_text

STEPS = 25
COMMANDS = {  # step at which rank 0 receives them -> commands; applied at the next check step
    12: [{"id": 1, "kind": "fallback", "modules": ["blocks.0.mlp_fc"], "reason": "underflow"}],
    17: [{"id": 2, "kind": "rollback", "checkpoint_step": 9, "skip_batches": 2, "reason": "loss spike"}],
    # the last rank lost its checkpoint of step 14 (deleted at step 21): applied on no rank
    22: [{"id": 3, "kind": "rollback", "checkpoint_step": 14, "reason": "second spike"}],
}
LOSE_AT = 21


def param_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_hash(model: nn.Module) -> str:
    """Parameters and the FP8 metadata buffers."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class RecordingRemediator(Remediator):
    def __init__(self, model: nn.Module, **kw: Any) -> None:
        super().__init__(**kw)
        self.record: list[dict[str, Any]] = []
        self._watched = model

    def apply(self, command: Command, *, step: int) -> Outcome:
        outcome = super().apply(command, step=step)
        self.record.append({"step": step, "kind": command.kind, "status": outcome.status, "error": outcome.error,
                            "resume_step": outcome.resume_step, "checkpoint_step": command.checkpoint_step,
                            "param_hash": param_hash(self._watched), "state_hash": state_hash(self._watched),
                            "fp8_enabled": {n: m.fp8_enabled for n, m in self._watched.named_modules()
                                            if hasattr(m, "fp8_enabled")}})
        return outcome


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # same initial weights on every rank
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16))
    fp8 = emulate_fp8(model)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    data = TextBatches(stdlib_text(60_000), block_size=16, batch_size=2, seed=rank)  # a shard per rank
    ckpts = CheckpointManager(out_dir / "ckpt", model=model, optimizer=opt,
                              data_state=lambda: {"position": data.position},
                              load_data_state=lambda s: setattr(data, "position", s["position"]),
                              every_n_steps=5, keep_last=5)
    remediator = RecordingRemediator(model, checkpoints=ckpts)
    monitor = Monitor(MonitorConfig(run_id="dist-rollback", command_check_interval_steps=5),
                      transport=NullTransport()).attach(model, opt, handler=remediator)
    saved: dict[int, dict[str, str]] = {}
    done: list[int] = []
    resumed_position: int | None = None
    step = 0
    while step < STEPS:
        x, y = data.next()
        _, loss = ddp(x, y)
        loss.backward()
        fp8.update()
        if rank == dist.get_world_size() - 1 and step == LOSE_AT:
            ckpts.path_for(14).unlink()
        if rank == 0 and step in COMMANDS:
            monitor.receive_commands(COMMANDS[step])
        monitor.step(loss, step=step)
        if monitor.next_step != step + 1:  # rolled back: continue from the restored step
            resumed_position = data.position
            step = monitor.next_step
            continue
        opt.step()
        opt.zero_grad()
        if ckpts.maybe_save(step, extra={"monitor": monitor.state_dict()}) is not None:
            saved[step] = {"param_hash": param_hash(model), "state_hash": state_hash(model)}
        done.append(step)
        step += 1
    monitor.close()
    result = {"rank": rank, "applied": remediator.record, "saved": saved, "done": done,
              "resumed_position": resumed_position, "segment": monitor.segment, "final_hash": param_hash(model),
              "checkpoints": ckpts.steps()}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
