"""Replays ``bench/gpu_counts.py time``'s schedule on the CPU: for each timed block of a staggered
mode, how many of its steps counted no module (the schedule restarted by a mode switch and not yet
at its first whole window). No model, no GPU: the monitor's own schedule code (``SourceSteps``,
``InspectCounts._due``) driven in the bench's order of modes, warm-up, settle and block steps.

    python3 bench/stagger_replay.py --modes agent_no_counts,counts_every_10_staggered,counts_every_10_staggered_batched --rounds 20
    python3 bench/stagger_replay.py ... --settle-before-fix   # the batched mode settled 2 steps (before the fifteenth session)

It prints, per staggered mode, the uncounted steps of each timed block and their total. Modes as
the bench switches them (``bench/_counts_modes.py``): ``plain`` steps no monitor and changes no
schedule; the others set the count interval and staggering, which restarts the schedule when
either changes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._counts_modes import _TIME_MODES, MODE_INTERVAL, _round_order
from bench._counts_time import settle_steps


def replay(modes_arg: list[str], rounds: int, *, block: int = 10, settle: int = 2, warmup: int = 3,
           modules: int = 36, before_fix: bool = False) -> dict[str, list[int]]:
    import torch

    from fp8guard.agent.fp8 import Fp8Format
    from fp8guard.agent.source_steps import SourceSteps
    from fp8guard.agent.sources.te_counts import InspectCounts

    counter = InspectCounts({(f"m{i}", "activation"): (i, Fp8Format.E4M3) for i in range(modules)},
                            torch.zeros(modules, 2, dtype=torch.int64))
    counter.owning = True

    class Source:  # what the TE source's prepare_step hands its counter
        kind, supports_counts, staggers_counts = "te", True, True

        def prepare_step(self, step: int, every: int, stagger_from: int | None = None) -> None:
            counter.every, counter.stagger_from = every, stagger_from

        def arm_counts(self, want: bool) -> None:
            counter.armed = want

    steps = SourceSteps([Source()])
    modes = [m for m in _TIME_MODES if m in modes_arg]
    if "plain" not in modes:
        modes.insert(0, "plain")
    state = {"next": 0, "every": 1, "stagger": False}
    steps.arm_counts_for(0, every=1, reporting=True)  # attached, then the bench's count interval

    def arm() -> None:
        steps.arm_counts_for(state["next"], every=int(state["every"]), reporting=True, stagger=bool(state["stagger"]))

    def use(mode: str) -> None:
        if mode != "plain":  # (plain runs no monitor: the schedule is left as it was)
            state["every"], state["stagger"] = MODE_INTERVAL[mode], mode.startswith("counts_every_10_staggered")
            arm()

    def step(mode: str) -> bool | None:
        """Steps the monitor; whether a staggered step counted any module (None: not staggered)."""
        if mode == "plain":
            return None
        n = int(state["next"])
        counted = any(counter._due(n, p)[0] for p in range(min(modules, counter.every))) \
            if counter.staggered else None
        state["next"] = n + 1
        arm()
        return counted

    for mode in modes:
        use(mode)
        for _ in range(warmup):
            step(mode)
    uncounted: dict[str, list[int]] = {m: [] for m in modes if m.startswith("counts_every_10_staggered")}
    for r in range(rounds):
        for mode in _round_order(modes, r):
            use(mode)
            old = max(settle, 10) if mode == "counts_every_10_staggered" else settle
            for _ in range(old if before_fix else settle_steps(mode, settle)):
                step(mode)
            timed = [step(mode) for _ in range(block)]
            if mode in uncounted:
                uncounted[mode].append(timed.count(False))
    return uncounted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", required=True, help="the time command's --modes")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--settle", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--settle-before-fix", dest="before_fix", action="store_true",
                   help="the settle rule before the fifteenth session (batched staggered: --settle steps)")
    a = p.parse_args()
    out = replay(a.modes.split(","), a.rounds, block=a.block, settle=a.settle, warmup=a.warmup,
                 before_fix=a.before_fix)
    print(json.dumps({"uncounted_steps_per_timed_block": out,
                      "total": {k: [sum(v), len(v) * a.block] for k, v in out.items()}}))


if __name__ == "__main__":
    main()
