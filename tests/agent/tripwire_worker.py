"""Run by torchrun in test_tripwire_distributed.py: DDP with gloo on the CPU, the tiny GPT in
emulated FP8, a CheckpointManager, a real Remediator and a Monitor per rank streaming to a real
fp8guard service, with the monitor's default cadences (flush every 50 steps, command broadcast
every 10, tripwire lag 2).

``argv``: url, run id, output folder, the step to poison (-1: a healthy run), steps, and the
injection: ``nan`` (default) makes only the LAST rank's loss NaN at the poisoned step: its NaN
gradients go through DDP's all-reduce, so every rank's gradient norm (the tripwire's shared
quantity) is NaN at that step while rank 0's own loss stays finite. ``outlier`` multiplies one
MLP input by 1000 on the last rank only, with ``tripwire_all_reduce``: a saturation only that
rank sees. Then, optionally, ``tripwire_wait_s`` and ``tripwire_lag_steps`` (defaults: the
config's). Each rank writes the commands it applied and the steps at which it entered a command
broadcast."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fp8guard.agent import Monitor, MonitorConfig, emulate_fp8
from fp8guard.agent.checkpoint import CheckpointManager
from fp8guard.agent.commands import Command, Outcome
from fp8guard.agent.remediation import Remediator
from fp8guard.nanogpt import GPT, GPTConfig, TextBatches, stdlib_text


class RecordingRemediator(Remediator):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.record: list[dict[str, Any]] = []

    def apply(self, command: Command, *, step: int) -> Outcome:
        outcome = super().apply(command, step=step)
        self.record.append({"step": step, "id": command.id, "kind": str(command.kind), "status": str(outcome.status),
                            "error": outcome.error, "checkpoint_step": command.checkpoint_step})
        return outcome


def main() -> None:
    url, run_id, out_dir, poison, steps = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    injection = sys.argv[6] if len(sys.argv) > 6 else "nan"
    defaults = MonitorConfig()
    wait_s = float(sys.argv[7]) if len(sys.argv) > 7 else defaults.tripwire_wait_s
    lag = int(sys.argv[8]) if len(sys.argv) > 8 else defaults.tripwire_lag_steps
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial weights on every rank
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16))
    fp8 = emulate_fp8(model)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    data = TextBatches(stdlib_text(60_000), block_size=16, batch_size=2, seed=rank)  # a shard per rank
    ckpts = CheckpointManager(out_dir / "ckpt", model=model, optimizer=opt,
                              data_state=lambda: {"position": data.position},
                              load_data_state=lambda s: setattr(data, "position", int(s["position"])),
                              every_n_steps=5, keep_last=5)
    monitor = Monitor(MonitorConfig(url=url, run_id=run_id, model_name="ddp-tiny-tripwire",
                                    tripwire_all_reduce=injection == "outlier", tripwire_wait_s=wait_s,
                                    tripwire_lag_steps=lag))
    at = {"step": -1}
    if injection == "outlier" and rank == world - 1:
        def outlier(_: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            return (args[0] * 1000.0,) if at["step"] == poison else None
        model.get_submodule("blocks.0.mlp_proj").register_forward_pre_hook(outlier)
    remediator = RecordingRemediator(checkpoints=ckpts, optimizer=opt)
    monitor.attach(model, opt, handler=remediator)

    # Every command broadcast this rank enters, by step (the run id's broadcast at attach is over).
    broadcasts: list[int] = []
    original = dist.broadcast_object_list

    def counting(*a: Any, **k: Any) -> Any:
        broadcasts.append(at["step"])
        return original(*a, **k)

    dist.broadcast_object_list = counting  # type: ignore[assignment]

    step, calls, poisoned = 0, 0, False
    started = time.monotonic()
    while calls < steps:
        at["step"] = step
        x, y = data.next()
        _, loss = ddp(x, y)
        if injection == "nan" and step == poison and not poisoned and rank == world - 1:
            loss = loss * float("nan")  # one rank's loss: NaN gradients for all after the all-reduce
        poisoned = poisoned or step == poison
        loss.backward()
        fp8.update()
        monitor.step(loss, step=step)
        calls += 1
        if monitor.next_step != step + 1:  # rolled back: continue from the restored step
            step = monitor.next_step
            continue
        opt.step()
        opt.zero_grad()
        if ckpts.maybe_save(step, extra={"monitor": monitor.state_dict()}) is not None:
            monitor.event("checkpoint_saved", step=step, data={"path": str(ckpts.path_for(step))})
        step += 1
    seconds = time.monotonic() - started
    dist.broadcast_object_list = original  # type: ignore[assignment]
    monitor.close()
    result = {"rank": rank, "applied": remediator.record, "broadcasts": broadcasts, "reporting": monitor.reporting,
              "tripwire_broadcasts": monitor.tripwire_broadcasts, "calls": calls, "seconds": seconds,
              "waits": monitor._tripwire.waits if monitor._tripwire is not None else None}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
