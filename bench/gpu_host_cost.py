"""Host cost of ``Monitor.step`` against model depth on a real Transformer Engine model (issue 14.1).

    python bench/gpu_host_cost.py --out OUT/gpu_host_cost.json      # the H200: estimated 3-5 minutes
    python bench/gpu_host_cost.py --parts sweep --out OUT/...       # only the depth sweep (about 2 minutes)
    python bench/gpu_host_cost.py --parts ratios --out OUT/...      # only the side-by-side ratios
    python bench/gpu_host_cost.py --smoke --out /tmp/host_cost.json  # CPU, over tests/fake_te.py

Model: ``bench/_te_model.TEModel`` (``te.TransformerLayer`` stacks, bf16 parameters, fused AdamW,
loss mean(h**2), DelayedScaling HYBRID with a 1024-step history). The monitor is the README's:
``Monitor(MonitorConfig(url=None, sources=["te"], flush_interval_steps=50, count_interval_steps=0),
transport=NullTransport())``, computing its own grad norm with its default (on CUDA with Triton:
the table kernel, built once at attach) (``monitor.step(loss)`` after ``opt.step()``, before
``zero_grad``); no service. The TE read is its default too (one Triton gather launch).

``--grads keep``: every loop (plain and monitored) zeroes the gradients in place
(``zero_grad(set_to_none=False)``) and the monitor keeps them as views of its buffer
(``MonitorConfig(grad_buffer=True)``); the default, ``none``, is PyTorch's ``set_to_none=True``.

1. ``sweep``: bench/_host_cost_sweep.py (what it measures at each depth).
2. ``ratios``: bench/_host_cost_ratios.py (plain FP8 step against monitored step, side by side).
The environment both run on (the real TE, or the stand-in under ``--smoke``): bench/_host_cost_env.py.

Prints one JSON summary line; writes the full result to ``--out`` (a file, or a folder that gets
``gpu_host_cost.json``). Without CUDA/TE/FP8 it prints a skip line and exits 0, unless
``--smoke``: tiny sizes on the CPU over the TE stand-in (tests/fake_te.py, through the TE
source's seam), which proves the script runs, not any GPU figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._host_cost_env import BENCH, Env
from bench._host_cost_ratios import ratio
from bench._host_cost_sweep import depth_point
from bench._te_model import Records


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU over the TE stand-in")
    p.add_argument("--out", default=None, help="JSON file (or folder) for the full result")
    p.add_argument("--layers", default="12,24,48,96", help="sweep depths")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="timed monitor.step calls per depth, in the loop")
    p.add_argument("--idle-steps", type=int, default=10, help="timed monitor.step calls per depth, GPU idle")
    p.add_argument("--rounds", type=int, default=12, help="ratio rounds (one block per mode each; a verdict "
                   "against 1.005x needs 6 at least, and the interval narrows with more: 16-20)")
    p.add_argument("--ratio-models", default="604M_12x2048,48x1024",
                   help="which models the ratios part runs (604M_12x2048, 48x1024): one alone fits more rounds")
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--gc-between-blocks", action="store_true",
                   help="ratios: Python's cyclic GC off inside timed blocks, a full collection between them "
                        "(both modes alike): tells a collection landing in a block from the monitor's cost")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sync-steps", type=int, default=6)
    p.add_argument("--profile-steps", type=int, default=10,
                   help="monitor.step calls under cProfile per depth (GPU idle before each; 0: none)")
    p.add_argument("--grads", choices=("none", "keep"), default="none",
                   help="how every loop clears the gradients: none = zero_grad(set_to_none=True), PyTorch's "
                        "default (the monitor walks new gradients each step); keep = zero_grad(set_to_none=False) "
                        "with MonitorConfig(grad_buffer=True) (gradients as views of one buffer)")
    p.add_argument("--parts", default="sweep,ratios", help="which parts to run: sweep, ratios or both")
    p.add_argument("--budget-s", type=float, default=400.0,
                   help="start no new part after this long; ratio rounds stop 40 s later (at least 4 rounds)")
    a = p.parse_args()
    unknown = set(a.ratio_models.split(",")) - {"604M_12x2048", "48x1024"}
    if unknown:
        p.error(f"--ratio-models: unknown {sorted(unknown)}; choose from 604M_12x2048, 48x1024")
    a.deadline = time.perf_counter() + a.budget_s + 40.0
    if a.smoke:
        a.layers, a.hidden, a.seq, a.batch = "2,4,8", 32, 8, 2
        a.steps, a.idle_steps, a.rounds, a.block, a.warmup, a.sync_steps = 4, 3, 2, 2, 1, 0
        a.profile_steps = min(a.profile_steps, 2)
    return a


@contextlib.contextmanager
def _part(result: dict[str, Any], key: str, started: float, budget_s: float,
          cleanup: Callable[[], None]) -> Iterator[Callable[[Any], None]]:
    """Run one part unless the budget is spent; an error is recorded, the other parts still run."""
    if time.perf_counter() - started > budget_s:
        result[key] = {"skipped": f"time budget of {budget_s} s spent"}
        yield lambda value: None
        return
    t0 = time.perf_counter()
    try:
        yield lambda value: result.__setitem__(key, value)
    except Exception as exc:  # one failed part (e.g. out of memory) must not lose the others
        result[key] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    if "error" in result.get(key, {}):
        cleanup()  # after the except block, so the traceback no longer holds the part's model
    if isinstance(result.get(key), dict):
        result[key]["seconds"] = round(time.perf_counter() - t0, 1)


def main() -> None:
    a = _args()
    env = Env(a.smoke, a.grads)
    records = Records()
    logging.getLogger("fp8guard").addHandler(records)
    started = time.perf_counter()
    result: dict[str, Any] = {"bench": BENCH, "smoke": a.smoke, **env.versions,
                              "monitor": {"sources": ["te"], "flush_interval_steps": 50, "count_interval_steps": 0,
                                          "transport": "NullTransport", "grad_norm": "computed by the monitor",
                                          "grad_buffer": env.keep_grads},
                              "zero_grad_set_to_none": not env.keep_grads}
    try:
        parts = set(a.parts.split(","))
        depths = [int(x) for x in a.layers.split(",")] if "sweep" in parts else []
        sweep: dict[str, Any] = {}
        for layers in depths:
            with _part(sweep, str(layers), started, a.budget_s, env.free) as put:
                put(depth_point(env, a, layers))
        result["sweep"] = sweep
        small, large = (2, 32, 8, 2), (4, 32, 8, 2)
        models = {"604M_12x2048": (12, 2048, 2048, 8), "48x1024": (48, 1024, 1024, 8)} if not a.smoke else \
            {"smoke_2x32": small, "smoke_4x32": large}
        if not a.smoke:
            models = {k: v for k, v in models.items() if k in a.ratio_models.split(",")}
        ratios: dict[str, Any] = {}
        for name, shape in (models.items() if "ratios" in parts else ()):
            with _part(ratios, name, started, a.budget_s, env.free) as put:
                put(ratio(env, a, *shape))
        result["ratios"] = ratios
    finally:
        env.close()
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["agent_log"] = records.messages[:10]
    summary = {"bench": BENCH, "smoke": a.smoke, "grads": a.grads,
               "host_us_in_loop_median_by_layers": {k: v.get("monitor_step_host_us_in_loop", {}).get("median")
                                                    for k, v in result["sweep"].items()},
               "host_us_idle_median_by_layers": {k: v.get("monitor_step_host_us_idle", {}).get("median")
                                                  for k, v in result["sweep"].items()},
               "ratios": {k: v.get("ratio", v.get("error") or v.get("skipped")) for k, v in result["ratios"].items()},
               "foreach_ratios": {k: v.get("foreach_ratio") for k, v in result["ratios"].items()},
               "verdicts": {k: v.get("paired", {}).get("verdict") for k, v in result["ratios"].items()},
               "ratios_vs_set_to_none_loop": {k: v.get("ratio_vs_set_to_none_loop") for k, v in result["ratios"].items()},
               "seconds": result["seconds"]}
    if a.out:
        out = Path(a.out)
        if out.suffix != ".json":
            out = out / f"{BENCH}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        summary["out"] = str(out)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
