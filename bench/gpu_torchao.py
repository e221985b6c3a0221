"""torchao float8 training on one GPU (real FP8 GEMMs): the torchao source's values against
torchao's own, the monitor's overhead side by side, and a BF16 fallback and re-promotion of one
``Float8Linear`` through the real Remediator while training runs.

    python bench/gpu_torchao.py --out DIR          # on the GPU host (bash bench/gpu_suite.sh torchao)
    python bench/gpu_torchao.py --parts values,overhead --out DIR   # values and overhead only, ~2.5 min
                                                   # (bash bench/gpu_suite.sh torchao-overhead)
    python bench/gpu_torchao.py --cpu-smoke --out DIR   # same code paths, emulate=True, tiny, CPU

The model: ``--layers`` transformer-like blocks (LayerNorm, a fused qkv ``nn.Linear``, causal
SDPA, an output projection, a 4x MLP with a biased ``fc1``), bf16 parameters, converted with
``convert_to_float8_training`` (every ``nn.Linear``) under each recipe of ``--recipes``
(``tensorwise``, ``rowwise``); AdamW (fused on CUDA), loss MSE to a fixed target, eager mode.
Per recipe, the parts of ``--parts``, each in its own try/except (a failure is recorded, the
other parts still run):

* ``values``: for ``--value-steps`` steps, every column of the source (input, weight and
  grad_output amax and scale of each ``Float8Linear``) against what torchao itself computed:
  its ``tensor_to_amax`` result and the ``_scale`` of the ``Float8TrainingTensor`` it cast with,
  captured by wrapping those two functions (the first cast of each role; rowwise: the largest
  per-row amax and the smallest per-row scale, which is the one of that row). Compared
  **exactly** (bitwise float32 equality); the largest relative difference is reported too. Both
  ways of the source: torchao's amaxes read back (``measure: torchao``, the default) and the
  hooks fallback (``hooks``); then one forward and backward with a NaN in the input, which
  the first column must show. On the GPU also under CUDA autocast with float32 parameters
  (tensorwise; part ``autocast``, once).
* ``overhead``: modes ``plain``, ``monitor`` (``monitor.step(loss)``, own grad norm),
  ``plain_clip`` and ``monitor_clip`` (the loop clips and passes the norm) in blocks of
  ``--block`` steps, rotating the order every round, in one process. A block is timed as
  synchronize, the steps, synchronize (throughput of a loop that never syncs); the figure is the
  median per-step time of each mode and the ratio monitored / plain. During plain blocks the
  source is off (module hooks detached, torchao's functions unwrapped), so ``plain`` is torchao
  alone. Then the device activities (kernels, copies) of one profiled plain and one monitored
  step (GPU).
* ``heal``: ``--heal-steps`` more training steps split in three phases; a ``fallback`` command
  for one ``Float8Linear`` arrives through ``monitor.receive_commands`` (the path the service's
  commands take) at the end of phase 1, a ``promote`` at the end of phase 2; the Remediator is
  ``Remediator(model=model)``. Checked per step: torchao's casts of that module (counted in
  torchao's own cast function: none while in BF16), its output against ``F.linear`` of its
  input (equal only in BF16), the ``aten::_scaled_mm`` calls of one profiled step per phase
  (GPU: 3 fewer in BF16) and the loss (finite, training goes on).
* ``sync`` (GPU only, last): ``--sync-steps`` plain and then monitored steps under
  ``torch.cuda.set_sync_debug_mode("error")``, and no error in the agent's log.

Writes ``gpu_torchao.json`` into ``--out`` and prints a one-line summary. Without CUDA, torchao
or an FP8-capable GPU (compute capability >= 8.9) it prints ``{"skipped": reason}`` and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._te_model import Records, skip
from bench._torchao_casts import TorchaoCasts

BENCH = "gpu_torchao"
MODES = ("plain", "monitor", "plain_clip", "monitor_clip")
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


# -- the model ---------------------------------------------------------------------------------------


def _build(torch: Any, float8: Any, a: argparse.Namespace, recipe: str, device: str,
           dtype: Any) -> tuple[Any, Any, Any, Any]:
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self, h: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.qkv, self.proj = nn.Linear(h, 3 * h, bias=False), nn.Linear(h, h, bias=False)
            self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h, bias=False)

        def forward(self, x: Any) -> Any:
            b, s, h = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
            x = x + self.proj(att)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    torch.manual_seed(0)
    model = nn.Sequential(*[Block(a.hidden, a.heads) for _ in range(a.layers)]).to(device=device, dtype=dtype)
    cfg = float8.Float8LinearConfig.from_recipe_name(recipe)
    if device == "cpu":
        cfg = dataclasses.replace(cfg, emulate=True)
    float8.convert_to_float8_training(model, config=cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, **({"fused": True} if device == "cuda" else {}))
    x = torch.randn(a.batch, a.seq, a.hidden, device=device, dtype=dtype)
    y = 0.5 * torch.randn(a.batch, a.seq, a.hidden, device=device, dtype=dtype)
    return model, opt, x, y


class Loop:
    """One model and the steps of every mode; ``step`` never syncs."""

    def __init__(self, torch: Any, model: Any, opt: Any, x: Any, y: Any, autocast: bool = False) -> None:
        self.torch, self.model, self.opt, self.x, self.y, self.autocast = torch, model, opt, x, y, autocast
        self.monitor: Any = None

    def forward_backward(self) -> Any:
        torch = self.torch
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()
        with ctx:
            out = self.model(self.x)
        loss = torch.nn.functional.mse_loss(out.float(), self.y.float())
        loss.backward()
        return loss

    def step(self, mode: str = "plain", step: int | None = None) -> Any:
        loss = self.forward_backward()
        norm = None
        if mode.endswith("_clip"):
            norm = self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        if mode.startswith("monitor"):
            self.monitor.step(loss, grad_norm=norm, step=step)
        self.opt.zero_grad(set_to_none=True)
        return loss


@contextlib.contextmanager
def source_off(model: Any) -> Iterator[None]:
    """torchao alone for a plain block: every module hook (the source's count hooks, or its hooks
    fallback) detached and torchao's functions unwrapped (no amax read back); all back after."""
    from fp8guard.agent.sources.torchao_capture import unwrapped

    saved = [(m, m._forward_pre_hooks, m._backward_pre_hooks) for m in model.modules()]
    for m, _, _ in saved:
        m._forward_pre_hooks, m._backward_pre_hooks = type(m._forward_pre_hooks)(), type(m._backward_pre_hooks)()
    try:
        with unwrapped():
            yield
    finally:
        for m, fwd, bwd in saved:
            m._forward_pre_hooks, m._backward_pre_hooks = fwd, bwd


# -- the parts ---------------------------------------------------------------------------------------


def part_values(torch: Any, loop: Loop, steps: int) -> dict[str, Any]:
    """Both ways of the source: torchao's amaxes read back (the default) and the hooks fallback."""
    res = _values(torch, loop, steps, "torchao")
    res["hooks"] = _values(torch, loop, steps, "hooks")
    res["ok"] = res["ok"] and res["hooks"]["ok"]
    return res


def _values(torch: Any, loop: Loop, steps: int, measure: str) -> dict[str, Any]:
    from fp8guard.agent.sources import torchao as tsrc
    from fp8guard.agent.sources.base import AMAX, SCALE, STATS

    found = [(n, m) for n, m in loop.model.named_modules() if isinstance(m, tsrc.Float8Linear)]
    source = tsrc.TorchaoSource(found, capture=measure == "torchao")
    specs = source.tensors()
    first_role = {"fwd_input": "INPUT", "fwd_weight": "WEIGHT", "bwd_grad_output": "GRAD_OUTPUT"}
    compared = amax_equal = scale_equal = consistent = 0
    rel_amax = rel_scale = 0.0
    mismatches: list[dict[str, Any]] = []
    try:
        with TorchaoCasts(loop.model) as casts:
            for _ in range(steps):
                loop.step()
                out = torch.zeros(len(STATS), len(specs), device=loop.x.device)
                source.read(out)
                records = casts.take()
                for col, spec in enumerate(specs):
                    mine = [r for r in records if r["module"] == spec.module and r["role"] == first_role[spec.role]]
                    if not mine:
                        mismatches.append({"column": spec.name, "error": "torchao made no such cast"})
                        continue
                    # every cast of a role in one step sees the same tensor: the same tensor-wide amax
                    consistent += len({float(r["amax"].float().max()) for r in mine}) == 1
                    want_amax = mine[0]["amax"].float().max()
                    want_scale = mine[0]["scale"].min()
                    got_amax, got_scale = out[AMAX, col], out[SCALE, col]
                    compared += 1
                    a_ok, s_ok = bool(got_amax == want_amax), bool(got_scale == want_scale)
                    amax_equal += a_ok
                    scale_equal += s_ok
                    rel_amax = max(rel_amax, float((got_amax - want_amax).abs() / want_amax.abs().clamp(min=1e-30)))
                    rel_scale = max(rel_scale, float((got_scale - want_scale).abs() / want_scale.abs()))
                    if not (a_ok and s_ok) and len(mismatches) < 8:
                        mismatches.append({"column": spec.name, "amax": [float(got_amax), float(want_amax)],
                                           "scale": [float(got_scale), float(want_scale)]})
        nan_visible = _nan_visible(torch, loop, source)
    finally:
        source.close()
    return {"measure": source.measure, "capture_unavailable": source.capture_unavailable,
            "comparison": "exact (bitwise float32 equality)", "steps": steps, "columns": len(specs),
            "compared": compared, "amax_equal": amax_equal, "scale_equal": scale_equal,
            "same_amax_in_every_cast_of_a_role": consistent, "max_rel_diff_amax": rel_amax,
            "max_rel_diff_scale": rel_scale, "mismatches": mismatches, "nan_visible": nan_visible,
            "ok": (source.measure == measure and compared == len(specs) * steps and amax_equal == compared
                   and scale_equal == compared and nan_visible)}


def _nan_visible(torch: Any, loop: Loop, source: Any) -> bool:
    """One forward and backward (no optimizer step) with a NaN in the input: the first column's
    amax is NaN, as torchao's own (device reductions: vector_norm, _foreach_max, the gather)."""
    from fp8guard.agent.sources.base import AMAX, STATS

    x = loop.x.clone()
    x.view(-1)[0] = float("nan")
    loop.model(x).float().sum().backward()
    loop.opt.zero_grad(set_to_none=True)
    out = torch.zeros(len(STATS), len(source.tensors()), device=loop.x.device)
    source.read(out)
    return bool(torch.isnan(out[AMAX, 0]))


def part_overhead(torch: Any, loop: Loop, a: argparse.Namespace, deadline: float) -> dict[str, Any]:
    cuda = loop.x.is_cuda
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    for mode in MODES:
        with source_off(loop.model) if mode.startswith("plain") else contextlib.nullcontext():
            for _ in range(a.warmup):
                loop.step(mode)
    per_step: dict[str, list[float]] = {m: [] for m in MODES}
    gc_ms: dict[str, dict[int, list[float]]] = {m: {0: [], 1: [], 2: []} for m in MODES}
    current = [MODES[0]]
    gc_t0 = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:  # Python's collections, timed per mode
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            gc_ms[current[0]][info["generation"]].append((time.perf_counter() - gc_t0[0]) * 1e3)

    gc.callbacks.append(on_gc)
    host_us: list[float] = []
    slow: list[tuple[float, int, float]] = []  # (whole step's host us, monitor step, monitor.step's host us)
    rounds = 0
    for r in range(a.rounds):
        if r >= 2 and time.perf_counter() > deadline:
            break
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        for mode in order:
            current[0] = mode
            with source_off(loop.model) if mode.startswith("plain") else contextlib.nullcontext():
                sync()
                t0 = time.perf_counter()
                for _ in range(a.block):
                    if mode == "monitor":  # the host time of monitor.step itself, in the timed loop
                        s0 = time.perf_counter()
                        at = loop.monitor.next_step
                        loss = loop.forward_backward()
                        loop.opt.step()
                        c0 = time.perf_counter()
                        loop.monitor.step(loss)
                        c1 = time.perf_counter()
                        host_us.append((c1 - c0) * 1e6)
                        loop.opt.zero_grad(set_to_none=True)
                        slow.append(((time.perf_counter() - s0) * 1e6, at, (c1 - c0) * 1e6))
                    else:
                        loop.step(mode)
                sync()
            per_step[mode].append((time.perf_counter() - t0) / a.block * 1e3)
        rounds += 1
    gc.callbacks.remove(on_gc)
    ms = {m: statistics.median(v) for m, v in per_step.items()}
    launches = {m: _launches(torch, loop, m) for m in ("plain", "monitor")} if cuda else None
    res: dict[str, Any] = {
        "ok": True, "rounds": rounds, "block": a.block, "ms_per_step": ms, "device_launches_per_step": launches,
        "ratio_monitor": ms["monitor"] / ms["plain"], "ratio_monitor_clip": ms["monitor_clip"] / ms["plain_clip"],
        "paired_ratio_monitor_median": statistics.median(
            m / p for m, p in zip(per_step["monitor"], per_step["plain"], strict=True)),
        "monitor_step_host_us_median": statistics.median(host_us) if host_us else None,
        "flush_interval_steps": a.flush_steps,
        # the monitored steps whose host time (the whole step, not synchronised) was longest: where a
        # stall sits, and whether it falls on the flush cadence (step % flush_interval_steps)
        "slowest_monitored_steps": [{"step": at, "step_host_ms": round(us / 1e3, 2), "monitor_step_host_ms": round(m / 1e3, 2),
                                     "step_mod_flush": at % a.flush_steps if a.flush_steps else None}
                                    for us, at, m in sorted(slow, reverse=True)[:8]],
        "monitored_step_host_ms_median": round(statistics.median(u for u, _, _ in slow) / 1e3, 2) if slow else None,
        "blocks_ms_per_step": per_step,
        # Python's garbage collections during each mode's timed blocks: count and longest, per generation
        "gc_per_mode": {m: {f"gen{g}": {"count": len(v), "max_ms": round(max(v), 1) if v else 0.0,
                                        "total_ms": round(sum(v), 1)} for g, v in gens.items()}
                        for m, gens in gc_ms.items()}}
    return res


def _launches(torch: Any, loop: Loop, mode: str) -> int:
    """Device activities (kernels, copies, memsets) of one whole step under the profiler: the
    monitor's share is the difference, and with torchao's amaxes read back it does not grow with
    the number of casts."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    with source_off(loop.model) if mode.startswith("plain") else contextlib.nullcontext():
        loop.step(mode)  # outside the profiler: a flush or lazy work of the first step after a switch
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            loop.step(mode)
            torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


def part_diagnose(torch: Any, loop: Loop, steps: int) -> dict[str, Any]:
    """Where ``monitor.step``'s host time goes (cProfile, allocator counters), after a warm-up."""
    from bench._host_profile import profile_host

    for _ in range(3):
        loop.step("monitor")
    held: dict[str, Any] = {}

    def body() -> None:
        held["loss"] = loop.forward_backward()
        loop.opt.step()

    def call() -> None:
        loop.monitor.step(held["loss"])
        loop.opt.zero_grad(set_to_none=True)

    return {"ok": True, **profile_host(torch, call, steps=steps, before=body)}


def part_sync(torch: Any, loop: Loop, steps: int, records: Records) -> dict[str, Any]:
    """Whole steps under sync debug 'error': plain first (is the check meaningful?), then
    monitored. The monitor swallows its own errors (and switches off), so its log is checked too:
    this part runs last."""
    out: dict[str, Any] = {}
    logged = len(records.messages)
    for mode in ("plain", "monitor"):
        torch.cuda.synchronize()
        raised = None
        done = 0
        with source_off(loop.model) if mode == "plain" else contextlib.nullcontext():
            try:
                for _ in range(steps):
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        loop.step(mode)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                    done += 1
            except Exception as exc:
                raised = f"{type(exc).__name__}: {exc}"[:400]
        torch.cuda.synchronize()
        loop.opt.zero_grad(set_to_none=True)  # a step cut short leaves its gradients
        out[mode] = {"steps": done, "raised": raised}
    out["monitor_log"] = records.messages[logged:][:5]
    out["ok"] = (out["monitor"]["raised"] is None and out["monitor"]["steps"] == steps
                 and not any(m.startswith(("ERROR", "CRITICAL")) for m in out["monitor_log"]))
    return out


def part_heal(torch: Any, loop: Loop, steps: int, remediator: Any, start: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from fp8guard.agent.sources.torchao import in_fp8

    names = [n for n, m in loop.model.named_modules() if hasattr(m, "linear_mm_config")]
    target = next((n for n in names if n.endswith("fc1") and n.startswith(f"{len(loop.model) // 2}.")), names[0])
    module = loop.model.get_submodule(target)
    seen: dict[str, Any] = {}

    def check_output(m: Any, args: Any, out: Any) -> None:  # before the optimizer moves the weight
        with torch.no_grad():
            plain = torch.nn.functional.linear(args[0].to(m.weight.dtype), m.weight, m.bias)
        seen.update(equal=bool(torch.equal(out, plain)), dtype=str(out.dtype))

    handle = module.register_forward_hook(check_output)
    outcomes: list[dict[str, Any]] = []
    apply = remediator.apply

    def recording_apply(command: Any, *, step: int) -> Any:
        outcome = apply(command, step=step)
        outcomes.append({"kind": str(command.kind), "step": step, "status": str(outcome.status),
                         "error": outcome.error, "details": outcome.details})
        return outcome

    remediator.apply = recording_apply
    phase_len = max(2, steps // 3)
    rows: list[dict[str, Any]] = []
    try:
        with TorchaoCasts(loop.model) as casts:
            for i in range(3 * phase_len):
                phase = ("fp8", "bf16", "fp8_again")[i // phase_len]
                s = start + i
                if i == phase_len - 1:
                    loop.monitor.receive_commands([{"id": 9001, "kind": "fallback", "modules": [target],
                                                    "reason": "gpu_torchao bench"}])
                if i == 2 * phase_len - 1:
                    loop.monitor.receive_commands([{"id": 9002, "kind": "promote", "modules": [target],
                                                    "reason": "gpu_torchao bench"}])
                was_fp8 = in_fp8(module)  # the precision this step's forward/backward ran in
                profiled = i % phase_len == 1
                if profiled:
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        loss = loop.step("monitor", step=s)
                    # aten::_scaled_mm (or a later variant of it): the FP8 GEMMs of the whole step
                    scaled_mm = sum(1 for e in prof.events() if "scaled_mm" in e.name)
                else:
                    loss = loop.step("monitor", step=s)
                    scaled_mm = None
                recs = casts.take()
                rows.append({"step": s, "phase": phase, "in_fp8": was_fp8, "loss": float(loss),
                             "target_casts": sum(1 for r in recs if r["module"] == target),
                             "all_casts": len(recs), "output_equals_plain_linear": seen["equal"],
                             "output_dtype": seen["dtype"], "scaled_mm_calls": scaled_mm})
    finally:
        handle.remove()
        remediator.apply = apply
    # a command received at a phase's last step applies after that step's backward: the next
    # phase is in its new precision from its first step
    by_phase = {p: [r for r in rows if r["phase"] == p] for p in ("fp8", "bf16", "fp8_again")}
    mm = {p: next((r["scaled_mm_calls"] for r in rs if r["scaled_mm_calls"] is not None), None)
          for p, rs in by_phase.items()}
    checks = {
        "fallback_applied": any(o["kind"] == "fallback" and o["status"] == "applied" for o in outcomes),
        "promote_applied": any(o["kind"] == "promote" and o["status"] == "applied" for o in outcomes),
        "fp8_casts_in_fp8": all(r["target_casts"] > 0 and not r["output_equals_plain_linear"]
                                and r["in_fp8"] for p in ("fp8", "fp8_again") for r in by_phase[p]),
        "no_casts_and_plain_gemm_in_bf16": all(r["target_casts"] == 0 and r["output_equals_plain_linear"]
                                               and not r["in_fp8"] for r in by_phase["bf16"]),
        "loss_finite": all(r["loss"] == r["loss"] and abs(r["loss"]) != float("inf") for r in rows),
    }
    if loop.x.is_cuda:
        # 3 GEMMs per Float8Linear (output, grad_input, grad_weight) leave FP8
        checks["fewer_scaled_mm_in_bf16"] = (
            None not in mm.values() and mm["fp8"] > mm["bf16"] and mm["fp8_again"] == mm["fp8"])
    return {"target": target, "phase_steps": phase_len, "outcomes": outcomes, "scaled_mm_per_step": mm,
            "checks": checks, "ok": all(checks.values()), "loss_first": rows[0]["loss"],
            "loss_last": rows[-1]["loss"], "steps": rows}


# -- driver ------------------------------------------------------------------------------------------


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


def run_autocast_values(torch: Any, float8: Any, a: argparse.Namespace) -> dict[str, Any]:
    """tensorwise, float32 parameters under CUDA autocast (bf16): Float8Linear casts its input to
    bf16 before measuring it; the source rounds the amax of the float32 input the same way."""
    model, opt, x, y = _build(torch, float8, a, "tensorwise", "cuda", torch.float32)
    loop = Loop(torch, model, opt, x, y, autocast=True)
    loop.step()
    return part_values(torch, loop, a.value_steps)


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
