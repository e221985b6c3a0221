"""torchao float8 training on one GPU (real FP8 GEMMs): the torchao source's values against
torchao's own, the monitor's overhead side by side, and a BF16 fallback and re-promotion of one
``Float8Linear`` through the real Remediator while training runs.

    python bench/gpu_torchao.py --out DIR          # on the GPU host (bash bench/gpu_suite.sh torchao)
    python bench/gpu_torchao.py --parts values,overhead --out DIR   # values and overhead only, ~2.5 min
                                                   # (bash bench/gpu_suite.sh torchao-overhead)
    python bench/gpu_torchao.py --cpu-smoke --out DIR   # same code paths, emulate=True, tiny, CPU

The model: ``--layers`` transformer-like blocks converted with ``convert_to_float8_training``
under each recipe of ``--recipes`` (``tensorwise``, ``rowwise``), its training loop and the
switch that leaves torchao alone: bench/_torchao_model.py.
Per recipe, the parts of ``--parts``, each in its own try/except (a failure is recorded, the
other parts still run). Each part's implementation and its description: ``values`` (and
``autocast``, the values under CUDA autocast, once) bench/_torchao_values.py, ``overhead`` (and
``--diagnose-steps``) bench/_torchao_overhead.py, ``heal`` bench/_torchao_heal.py, ``sync`` (GPU
only, last) bench/_torchao_sync.py.

Writes ``gpu_torchao.json`` into ``--out`` and prints a one-line summary. Without CUDA, torchao
or an FP8-capable GPU (compute capability >= 8.9) it prints ``{"skipped": reason}`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._te_model import Records, skip
from bench._torchao_heal import part_heal
from bench._torchao_model import Loop, _build
from bench._torchao_overhead import part_diagnose, part_overhead
from bench._torchao_sync import part_sync
from bench._torchao_values import part_values, run_autocast_values

BENCH = "gpu_torchao"
PARTS = ("values", "overhead", "heal", "sync", "autocast")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_torchao.json")
    p.add_argument("--cpu-smoke", action="store_true", help="emulate=True on the CPU, tiny sizes, few steps")
    p.add_argument("--recipes", default="tensorwise,rowwise")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"which parts, of {','.join(PARTS)} (autocast: the values under CUDA autocast, once)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=12, help="overhead rounds (one block of each mode per round)")
    p.add_argument("--block", type=int, default=10, help="steps per block")
    p.add_argument("--warmup", type=int, default=5, help="steps of each mode before timing")
    p.add_argument("--value-steps", type=int, default=3)
    p.add_argument("--heal-steps", type=int, default=30)
    p.add_argument("--sync-steps", type=int, default=10)
    p.add_argument("--flush-steps", type=int, default=50,
                   help="the monitor's flush_interval_steps (the slow monitored blocks: flush-related or not)")
    p.add_argument("--budget-s", type=float, default=150.0, help="overhead rounds stop early past this share")
    p.add_argument("--diagnose-steps", type=int, default=0,
                   help="profile the host side of monitor.step over this many steps (bench/_host_profile.py)")
    a = p.parse_args()
    if a.cpu_smoke:
        for k, v in dict(layers=2, hidden=64, heads=4, seq=16, batch=2, rounds=2, block=2, warmup=1,
                         value_steps=2, heal_steps=6, sync_steps=0).items():
            setattr(a, k, v)
    return a


def _environment(cpu_smoke: bool) -> tuple[Any, Any]:
    """(torch, torchao.float8), or a skip line and exit 0."""
    try:
        import torch
    except ImportError as exc:
        skip(BENCH, f"torch not importable: {exc}")
    if not cpu_smoke:
        if not torch.cuda.is_available():
            skip(BENCH, "needs a CUDA GPU (torch.cuda.is_available() is False); --cpu-smoke runs on the CPU")
        cap = torch.cuda.get_device_capability()
        if cap < (8, 9):
            skip(BENCH, f"FP8 GEMMs need compute capability >= 8.9; this GPU ({torch.cuda.get_device_name()}) has {cap}")
    try:
        import torchao.float8 as float8
    except Exception as exc:
        skip(BENCH, f"torchao not importable: {type(exc).__name__}: {exc}"[:300])
    return torch, float8


def _guard(fn: Callable[[], dict[str, Any]], out: dict[str, Any] | None = None, name: str = "") -> dict[str, Any]:
    """``fn()``, or what it raised; into ``out[name]`` too, marked unfinished while it runs."""
    if out is not None:
        out[name] = {"ok": False, "error": "unfinished: the run ended during this part"}
    t0 = time.perf_counter()
    try:
        res = fn()
    except Exception as exc:
        res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600], "traceback": traceback.format_exc()[-3000:]}
    res["seconds"] = round(time.perf_counter() - t0, 2)
    if out is not None:
        out[name] = res
        print(f"[{BENCH}] {name}: ok={res.get('ok')} in {res['seconds']} s {res.get('error') or ''}",
              file=sys.stderr, flush=True)
    return res


def run_recipe(torch: Any, float8: Any, a: argparse.Namespace, recipe: str, device: str,
               deadline: float, records: Records, out: dict[str, Any]) -> dict[str, Any]:
    """Fills ``out`` part by part (so a killed run keeps the parts done); returns it."""
    from fp8guard.agent import Monitor, MonitorConfig, NullTransport
    from fp8guard.agent.remediation import Remediator

    model, opt, x, y = _build(torch, float8, a, recipe, device, torch.bfloat16)
    loop = Loop(torch, model, opt, x, y)
    loop.step()  # first step outside every part: lazy initialisation, kernels loaded
    out["params_m"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 1)
    out["float8_linears"] = sum(1 for m in model.modules() if hasattr(m, "linear_mm_config"))
    out["parts"] = a.parts
    parts = set(a.parts.split(","))
    if "values" in parts:
        _guard(lambda: part_values(torch, loop, a.value_steps), out, "values")
    remediator = Remediator(model=model)
    loop.monitor = Monitor(MonitorConfig(url=None, sources=["torchao"], flush_interval_steps=a.flush_steps,
                                         count_interval_steps=0), transport=NullTransport()).attach(
        model, opt, handler=remediator)
    try:
        if a.diagnose_steps:
            _guard(lambda: part_diagnose(torch, loop, a.diagnose_steps), out, "diagnose")
        if "overhead" in parts:
            _guard(lambda: part_overhead(torch, loop, a, deadline), out, "overhead")
        if "heal" in parts:
            _guard(lambda: part_heal(torch, loop, a.heal_steps, remediator, start=loop.monitor.next_step),
                   out, "heal")
        if "sync" in parts and device == "cuda" and a.sync_steps:
            _guard(lambda: part_sync(torch, loop, a.sync_steps, records), out, "sync")
        elif "sync" in parts:
            out["sync"] = {"skipped": "GPU only"}
    finally:
        loop.monitor.close()
        for src in loop.monitor.sources:
            src.close()
    return out


def main() -> None:
    a = _args()
    torch, float8 = _environment(a.cpu_smoke)
    # `timeout` sends SIGTERM: end through the finally below, which writes what was measured
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    import torchao

    records = Records()
    logging.getLogger("fp8guard").addHandler(records)
    device = "cpu" if a.cpu_smoke else "cuda"
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "bench": BENCH, "mode": "cpu_smoke" if a.cpu_smoke else "gpu", "command": " ".join(sys.argv),
        "torch": torch.__version__, "torchao": getattr(torchao, "__version__", "unknown"),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "shape": {k: getattr(a, k) for k in ("layers", "hidden", "heads", "seq", "batch")},
        "recipes": {}}
    recipes = [r for r in a.recipes.split(",") if r]
    try:
        for i, recipe in enumerate(recipes):
            # the overhead rounds of each recipe stop early past its share of the budget
            deadline = t_start + a.budget_s * (i + 1) / (len(recipes) + 0.5)
            print(f"[{BENCH}] recipe {recipe}", file=sys.stderr, flush=True)
            out: dict[str, Any] = result["recipes"].setdefault(recipe, {})
            out.update(_guard(lambda recipe=recipe, deadline=deadline, out=out: run_recipe(
                torch, float8, a, recipe, device, deadline, records, out)))
            _write(a.out, result)  # a later part that hangs or is killed keeps this one's results
            if device == "cuda":
                torch.cuda.empty_cache()
        if device == "cuda" and "autocast" in a.parts.split(","):
            _guard(lambda: run_autocast_values(torch, float8, a), result, "autocast_values")
    finally:
        result["seconds"] = round(time.perf_counter() - t_start, 1)
        result["agent_log"] = records.messages[-20:]
        _write(a.out, result)
        print(json.dumps(result["summary"], default=str), flush=True)


def _write(out: str | None, result: dict[str, Any]) -> None:
    result["summary"] = _summary(result)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{BENCH}.json").write_text(json.dumps(result, indent=1, default=str))


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {"bench": BENCH, "mode": result["mode"], "device": result["device"],
                         "torchao": result["torchao"], "seconds": result.get("seconds")}
    for recipe, r in result["recipes"].items():
        if "error" in r:
            s[recipe] = {"error": r["error"]}
            continue
        ov = r.get("overhead", {})
        s[recipe] = {
            "values_exact": r.get("values", {}).get("ok"), "values_error": r.get("values", {}).get("error"),
            "ms_plain": ov.get("ms_per_step", {}).get("plain"), "ratio_monitor": ov.get("ratio_monitor"),
            "ratio_monitor_clip": ov.get("ratio_monitor_clip"), "overhead_error": ov.get("error"),
            "measure": r.get("values", {}).get("measure"), "launches_per_step": ov.get("device_launches_per_step"),
            "sync_ok": r.get("sync", {}).get("ok"), "scaled_mm_per_step": r.get("heal", {}).get("scaled_mm_per_step"),
            "heal_ok": r.get("heal", {}).get("ok"), "heal_error": r.get("heal", {}).get("error")}
    if "autocast_values" in result:
        s["autocast_values_exact"] = result["autocast_values"].get("ok")
    return s


if __name__ == "__main__":
    main()
