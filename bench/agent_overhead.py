"""Step-time overhead of the agent: a small byte-level GPT trained on the CPU in emulated FP8
(fp8guard's emulation of TE delayed scaling), with telemetry of every FP8 operand every step,
against the same loop without the agent, in one run.

    python bench/agent_overhead.py --json

The two modes alternate in blocks of ``--block`` steps (order flipped every round) on one
model, so drift (thermal, other processes) hits both alike; the ratio is the median step time
with the agent over the median without. The agent ships to ``--url`` if given, else it builds
and encodes every batch on its background thread and discards it (NullTransport).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fp8guard.agent import Monitor, MonitorConfig, NullTransport, emulate_fp8
from fp8guard.nanogpt import GPT, GPTConfig, TextBatches, stdlib_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--block", type=int, default=10, help="steps per mode per round")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--count-interval", type=int, default=0, help="exact counts every N steps (0: off)")
    parser.add_argument("--url", default=None, help="ship to this fp8guard service instead of discarding")
    args = parser.parse_args()

    torch.manual_seed(0)
    cfg = GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128)
    model = GPT(cfg)
    fp8 = emulate_fp8(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TextBatches(stdlib_text(), block_size=cfg.block_size, batch_size=args.batch_size)
    monitor = Monitor(MonitorConfig(url=args.url, run_id=f"overhead-{int(time.time())}",
                                    count_interval_steps=args.count_interval),
                      transport=None if args.url else NullTransport()).attach(model, opt)

    calls: list[float] = []

    def step(with_agent: bool) -> float:
        t0 = time.perf_counter()
        x, y = data.next()
        _, loss = model(x, y)
        loss.backward()
        fp8.update()
        if with_agent:
            t1 = time.perf_counter()
            monitor.step(loss)
            calls.append(time.perf_counter() - t1)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for _ in range(5):
        step(True)
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        for mode in ((False, True) if r % 2 == 0 else (True, False)):
            times[mode] += [step(mode) for _ in range(args.block)]
    monitor.close()
    base, agent = statistics.median(times[False]), statistics.median(times[True])
    result = {
        "overhead_ratio": agent / base,
        "step_ms_without": base * 1e3,
        "step_ms_with": agent * 1e3,
        "agent_call_ms_median": statistics.median(calls) * 1e3,
        "steps_per_mode": len(times[False]),
        "fp8_operands": len(monitor.tensors),
        "count_interval": args.count_interval,
        "shipped": bool(args.url),
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result) if args.json else
          f"overhead x{result['overhead_ratio']:.4f} ({base * 1e3:.1f} -> {agent * 1e3:.1f} ms/step)")


if __name__ == "__main__":
    main()
