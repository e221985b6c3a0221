"""Run by torchrun in test_distributed.py: DDP with gloo on the CPU, emulated FP8, one Monitor per rank."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fp8guard.agent import Monitor, MonitorConfig, emulate_fp8
from fp8guard.nanogpt import GPT, GPTConfig, TextBatches, stdlib_text


def main() -> None:
    url, out_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # same initial weights on every rank
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16))
    fp8 = emulate_fp8(model)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
    # no run_id: rank 0 makes one up and broadcasts it
    monitor = Monitor(MonitorConfig(url=url, flush_interval_steps=2, model_name="ddp-tiny")).attach(model, opt)
    data = TextBatches(stdlib_text(100_000), block_size=16, batch_size=2, seed=rank)  # different shards
    for _ in range(5):
        x, y = data.next()
        _, loss = ddp(x, y)
        loss.backward()
        fp8.update()
        monitor.step(loss)
        opt.step()
        opt.zero_grad()
    monitor.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"run_id": monitor.run_id, "rank": monitor.rank, "reporting": monitor.reporting}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
