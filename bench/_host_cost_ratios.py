"""``bench/gpu_host_cost.py --parts ratios``: plain FP8 step against monitored step, side by side.

``ratios``: plain FP8 step against monitored step, for the 604M model (12 layers, hidden 2048,
sequence 2048, batch 8) and the 48-layer hidden-1024 model: ``--rounds`` rounds of one block
of ``--block`` steps per mode (plain; monitor (its default, the table norm); monitor with the
foreach grad norm), the order
rotating every round, in one process; a block is synchronise, steps, synchronise. Ratio of
medians and median of per-round ratios. Then ``--sync-steps`` monitored steps (each norm)
under ``torch.cuda.set_sync_debug_mode("error")``. With ``--grads keep``, first (before the
monitor attaches) what zeroing in place costs the plain loop against ``set_to_none=True``
(``keep_cost``), and the product of the two ratios (``ratio_vs_set_to_none_loop``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

from bench._host_cost_env import Env, _buffer_state, _stats, _us_since
from bench._paired import MONITOR, paired_ratios
from bench._te_model import TEModel

TARGET_RATIO = MONITOR


def ratio(env: Env, a: argparse.Namespace, layers: int, hidden: int, seq: int, batch: int) -> dict[str, Any]:
    """Plain FP8 step against monitored step (grad norm: the monitor's default, and foreach where
    the default is the table), blocks of each mode in an order rotating every round, in one process."""
    m = env.model(layers, hidden, seq, batch)
    m.step()
    env.sync()
    keep_cost = _keep_cost(env, a, m) if env.keep_grads else None
    monitor = env.monitor(m)
    own = monitor._grad_norm
    norms = {"monitor": own, "monitor_foreach": env.foreach_norm(m) if own.backend == "table" else None}
    modes = ["plain", *(k for k, v in norms.items() if v is not None)]
    for mode in modes:
        if mode != "plain":
            monitor._grad_norm = norms[mode]
        for _ in range(a.warmup):
            m.step(None if mode == "plain" else monitor)
    env.sync()
    per_step: dict[str, list[float]] = {k: [] for k in modes}
    host_us: dict[str, list[float]] = {k: [] for k in modes if k != "plain"}
    for r in range(a.rounds):
        if r >= 4 and time.perf_counter() > a.deadline:
            break  # the whole call must end inside the device's per-command limit
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            if mode != "plain":
                monitor._grad_norm = norms[mode]
            if a.gc_between_blocks:
                gc.collect()
                gc.disable()
            env.sync()
            t0 = time.perf_counter()
            for _ in range(a.block):
                if mode == "plain":
                    m.step()
                    continue
                loss = m.forward_backward()
                m.opt.step()
                c0 = time.perf_counter()
                monitor.step(loss)
                host_us[mode].append(_us_since(c0))
                m.zero_grad()
            env.sync()
            per_step[mode].append(_us_since(t0) / 1e3 / a.block)
            gc.enable()
    monitor._grad_norm = norms["monitor"]
    plain = statistics.median(per_step["plain"])
    result: dict[str, Any] = {
        "layers": layers, "hidden": hidden, "seq": seq, "batch": batch, "params_M": m.params_m,
        "columns": len(monitor.tensors), "rounds": len(per_step["plain"]), "block": a.block,
        "modes": modes, "plain_ms_per_step": round(plain, 3),
        "plain_block_ms_min_max": [round(min(per_step["plain"]), 3), round(max(per_step["plain"]), 3)],
        "target_ratio_max": TARGET_RATIO, "gc_between_blocks": bool(a.gc_between_blocks),
    }
    for mode in modes[1:]:
        ms = statistics.median(per_step[mode])
        paired = sorted(x / p for x, p in zip(per_step[mode], per_step["plain"], strict=True))
        key = "" if mode == "monitor" else "foreach_"
        result.update({
            f"{key}monitor_ms_per_step": round(ms, 3), f"{key}ratio": round(ms / plain, 5),
            f"{key}paired_ratio_median": round(statistics.median(paired), 5),
            f"{key}paired_ratio_min_max": [round(paired[0], 5), round(paired[-1], 5)],
            # the rounds' ratios, the median's interval and the verdict against the target
            f"{key}paired": paired_ratios(per_step[mode], per_step["plain"], TARGET_RATIO),
            f"{key}monitor_block_ms_min_max": [round(min(per_step[mode]), 3), round(max(per_step[mode]), 3)],
            f"{key}monitor_step_host_us_in_loop": _stats(host_us[mode]),
            f"{key}meets_target": ms / plain <= TARGET_RATIO,
        })
    if keep_cost is not None:
        result["keep_cost"] = keep_cost
        result["ratio_vs_set_to_none_loop"] = round(result["ratio"] * keep_cost["ratio"], 5)
    result["sync_debug"] = _sync_check(env, m, monitor, a.sync_steps)
    result["grad_norm_backend"], result["grad_norm_repointed"] = own.backend, own.repointed
    result.update(_buffer_state(monitor))
    if norms["monitor_foreach"] is not None:
        monitor._grad_norm = norms["monitor_foreach"]
        result["foreach_sync_debug"] = _sync_check(env, m, monitor, a.sync_steps)
        monitor._grad_norm = own
    result["monitor_broken"] = bool(monitor._broken)
    monitor.close()
    del monitor, m, norms
    env.free()
    return result


def _keep_cost(env: Env, a: argparse.Namespace, m: TEModel) -> dict[str, Any]:
    """What keeping the gradients costs the loop itself, before any monitor: plain steps clearing
    them with ``set_to_none=False`` (a memset, then the backward accumulates into them) against
    ``set_to_none=True`` (the backward's gradients are taken as they are), blocks alternating in
    one process. ``ratio_vs_set_to_none_loop`` in the result is this times the monitor's ratio:
    the monitored loop with a buffer against the default loop without fp8guard."""
    per_step: dict[bool, list[float]] = {True: [], False: []}
    for r in range(max(4, a.rounds // 2)):
        for set_to_none in ((True, False) if r % 2 == 0 else (False, True)):
            m.set_to_none = set_to_none
            m.zero_grad()
            for _ in range(a.warmup if r == 0 else 0):
                m.step()
            env.sync()
            t0 = time.perf_counter()
            for _ in range(a.block):
                m.step()
            env.sync()
            per_step[set_to_none].append(_us_since(t0) / 1e3 / a.block)
    m.set_to_none = False
    m.zero_grad()
    none, keep = statistics.median(per_step[True]), statistics.median(per_step[False])
    paired = sorted(k / n for k, n in zip(per_step[False], per_step[True], strict=True))
    return {"set_to_none_ms_per_step": round(none, 3), "keep_ms_per_step": round(keep, 3),
            "ratio": round(keep / none, 5), "paired_ratio_median": round(statistics.median(paired), 5),
            "rounds": len(paired)}


def _sync_check(env: Env, m: TEModel, monitor: Any, steps: int) -> dict[str, Any] | None:
    """Monitored steps under ``set_sync_debug_mode("error")`` (a sync raises)."""
    if not env.cuda or steps <= 0:
        return None
    torch = env.torch
    out: dict[str, Any] = {"steps": steps, "raised": None}
    for i in range(steps):
        torch.cuda.set_sync_debug_mode("error")
        try:
            m.step(monitor)
        except RuntimeError as exc:
            out["raised"] = {"at_step": i, "error": str(exc).splitlines()[0][:300],
                             "where": [f"{Path(f.filename).name}:{f.lineno} {f.name}"
                                       for f in traceback.extract_tb(exc.__traceback__)[-6:]]}
            m.zero_grad()
            break
        finally:
            torch.cuda.set_sync_debug_mode(0)
    env.sync()
    return out
