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

1. ``sweep``: for 12, 24, 48 and 96 layers (hidden 1024, sequence 1024, batch 8): attach time
   (synchronised), the device memory attach allocates and the transient peak of one
   ``monitor.step``, then the host microseconds of ``monitor.step`` in a training loop that
   never syncs (GPU busy) and with the GPU idle (synchronised before the call), and the idle host
   time of its two parts: the grad norm and the TE source's read.
   Also the GPU time and bandwidth of the grad norm, the table kernel (the default) and
   ``GradNorm(backend="foreach")``, their difference from a float64 norm, and how often the
   table was re-pointed at new gradient addresses during the sweep.
2. ``ratios``: plain FP8 step against monitored step, for the 604M model (12 layers, hidden 2048,
   sequence 2048, batch 8) and the 48-layer hidden-1024 model: ``--rounds`` rounds of one block
   of ``--block`` steps per mode (plain; monitor (its default, the table norm); monitor with the
   foreach grad norm), the order
   rotating every round, in one process; a block is synchronise, steps, synchronise. Ratio of
   medians and median of per-round ratios. Then ``--sync-steps`` monitored steps (each norm)
   under ``torch.cuda.set_sync_debug_mode("error")``. With ``--grads keep``, first (before the
   monitor attaches) what zeroing in place costs the plain loop against ``set_to_none=True``
   (``keep_cost``), and the product of the two ratios (``ratio_vs_set_to_none_loop``).

Prints one JSON summary line; writes the full result to ``--out`` (a file, or a folder that gets
``gpu_host_cost.json``). Without CUDA/TE/FP8 it prints a skip line and exits 0, unless
``--smoke``: tiny sizes on the CPU over the TE stand-in (tests/fake_te.py, through the TE
source's seam), which proves the script runs, not any GPU figure.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._te_model import Records, Shape, TEModel, require_te

BENCH = "gpu_host_cost"
TARGET_RATIO = 1.005


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
    p.add_argument("--rounds", type=int, default=12, help="ratio rounds (one block per mode each)")
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
    a.deadline = time.perf_counter() + a.budget_s + 40.0
    if a.smoke:
        a.layers, a.hidden, a.seq, a.batch = "2,4,8", 32, 8, 2
        a.steps, a.idle_steps, a.rounds, a.block, a.warmup, a.sync_steps = 4, 3, 2, 2, 1, 0
        a.profile_steps = min(a.profile_steps, 2)
    return a


class Env:
    """torch, the TE handles and the device: the real ones, or the CPU stand-in under ``--smoke``."""

    def __init__(self, smoke: bool, grads: str = "none") -> None:
        self.smoke = smoke
        self.keep_grads = grads == "keep"
        self._stack = contextlib.ExitStack()
        if smoke:
            import torch

            from fp8guard.agent.sources import te_access
            from tests import fake_te

            self.torch, self.te, self.recipes, self.device = torch, fake_te, fake_te, "cpu"
            self._stack.enter_context(te_access.substitute(fake_te))
            self.versions = {"torch": torch.__version__, "transformer_engine": "stand-in (tests/fake_te.py)"}
        else:
            torch, te = require_te(BENCH)
            import transformer_engine
            import transformer_engine.common.recipe as recipes

            self.torch, self.te, self.recipes, self.device = torch, te, recipes, "cuda"
            self.versions = {"torch": torch.__version__, "transformer_engine": transformer_engine.__version__,
                             "device": torch.cuda.get_device_name()}

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def allocated(self) -> int:
        return int(self.torch.cuda.memory_allocated()) if self.cuda else 0

    def model(self, layers: int, hidden: int, seq: int, batch: int) -> TEModel:
        m = TEModel(Shape(layers=layers, hidden=hidden, seq=seq, batch=batch), te=self.te, recipes=self.recipes,
                    device=self.device)
        m.set_to_none = not self.keep_grads
        return m

    def monitor(self, m: TEModel) -> Any:
        from fp8guard.agent import Monitor, MonitorConfig, NullTransport

        return Monitor(MonitorConfig(url=None, sources=["te"], flush_interval_steps=50, count_interval_steps=0,
                                     grad_buffer=self.keep_grads), transport=NullTransport()).attach(m.model, m.opt)

    def foreach_norm(self, m: TEModel) -> Any:
        """``GradNorm(backend="foreach")``: the comparison to the monitor's default."""
        from fp8guard.agent.telemetry import GradNorm

        return GradNorm(m.model.parameters(), backend="foreach")

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def close(self) -> None:
        self._stack.close()


def _stats(xs: list[float], nd: int = 1) -> dict[str, Any]:
    s = sorted(xs)
    return {"median": round(statistics.median(s), nd), "p90": round(s[int(0.9 * (len(s) - 1))], nd),
            "min": round(s[0], nd), "n": len(s)} if s else {"n": 0}


def _us_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e6


def _monitor_buffers(monitor: Any, device_type: str) -> int:
    """Bytes of the ``device_type`` tensors the monitor and its sources keep (TE's own tensors and
    the model's parameters are left out)."""
    torch = sys.modules["torch"]
    seen: set[int] = set()
    storages: set[int] = set()
    total = 0
    not_ours = {"_params", "_columns", "entries", "_hists", "_scales", "_gather", "_switchable", "_metas", "_te"}

    def walk(obj: Any, depth: int) -> None:
        nonlocal total
        if depth > 5 or id(obj) in seen or isinstance(obj, (type, torch.nn.Module, str, bytes, int, float)):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if obj.device.type == device_type and storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, depth + 1)
        elif not callable(obj):
            names = list(getattr(obj, "__dict__", {})) + list(getattr(type(obj), "__slots__", ()))
            for name in names:
                if name not in not_ours:
                    walk(getattr(obj, name, None), depth + 1)

    not_ours.add("buffer")  # the gradient buffer holds the gradients themselves: reported on its own
    for part in (monitor._ring, monitor._grad_norm, monitor._tripwire, *monitor.sources):
        walk(part, 0)
    return total


def depth_point(env: Env, a: argparse.Namespace, layers: int) -> dict[str, Any]:
    """Attach cost and monitor.step host time for one depth."""
    torch = env.torch
    m = env.model(layers, a.hidden, a.seq, a.batch)
    for _ in range(a.warmup):
        m.step()
    env.sync()
    plain: list[float] = []
    for _ in range(a.warmup + 2):
        env.sync()
        t0 = time.perf_counter()
        m.step()
        env.sync()
        plain.append(_us_since(t0) / 1e3)
    before = env.allocated()
    t0 = time.perf_counter()
    monitor = env.monitor(m)
    env.sync()
    attach_ms = _us_since(t0) / 1e3
    attached = env.allocated() - before
    for _ in range(a.warmup):
        m.step(monitor)
    env.sync()
    in_loop: list[float] = []
    for _ in range(a.steps):
        loss = m.forward_backward()
        m.opt.step()
        t0 = time.perf_counter()
        monitor.step(loss)
        in_loop.append(_us_since(t0))
        m.zero_grad()
    idle: list[float] = []
    norm_us: list[float] = []
    read_us: list[float] = []
    peak = 0
    src = monitor.sources[0]
    buf = torch.zeros(4, len(monitor.tensors), device=env.device)
    for _ in range(a.idle_steps):
        loss = m.forward_backward()
        m.opt.step()
        env.sync()
        base = env.allocated()
        if env.cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        monitor.step(loss)
        idle.append(_us_since(t0))
        env.sync()
        if env.cuda:
            peak = max(peak, int(torch.cuda.max_memory_allocated()) - base)
        t0 = time.perf_counter()
        monitor.grad_norm()
        norm_us.append(_us_since(t0))
        env.sync()
        t0 = time.perf_counter()
        src.read(buf)
        read_us.append(_us_since(t0))
        env.sync()
        m.zero_grad()
    norm_gpu = _norm_gpu_probe(env, m, monitor)
    tripwire_us = _tripwire_probe(env, monitor, a.idle_steps)
    profile = _profile_step(env, m, monitor, a.profile_steps) if a.profile_steps else None
    walks = _grad_walks(env, m)
    delayed = getattr(src, "_delayed", None)
    point = {
        "grad_norm_gpu": norm_gpu,
        "grad_norm_backend": monitor._grad_norm.backend, "grad_norm_repointed": monitor._grad_norm.repointed,
        **_buffer_state(monitor),
        "te_read": "triton gather" if delayed is not None and delayed._table is not None else "torch ops",
        "layers": layers, "hidden": a.hidden, "seq": a.seq, "batch": a.batch, "params_M": m.params_m,
        "columns": len(monitor.tensors), "gradients": sum(1 for p in m.model.parameters() if p.requires_grad),
        "plain_step_ms": _stats(plain, 2), "attach_ms": round(attach_ms, 1),
        "attach_allocated_bytes": attached, "monitor_buffers_bytes": _monitor_buffers(monitor, env.device),
        "step_transient_peak_bytes": peak,
        "monitor_step_host_us_in_loop": _stats(in_loop), "monitor_step_host_us_idle": _stats(idle),
        "grad_norm_host_us_idle": _stats(norm_us), "te_read_host_us_idle": _stats(read_us),
        "tripwire_backend": monitor._tripwire.backend if monitor._tripwire is not None else None,
        "tripwire_check_host_us_idle": tripwire_us,
        "monitor_broken": bool(monitor._broken),
        "monitor_step_profile": profile,
        "grad_walk_us": walks,
    }
    monitor.close()
    del monitor, m, src, buf
    env.free()
    return point


def _buffer_state(monitor: Any) -> dict[str, Any]:
    """The gradient buffer (``--grads keep``): whether it held, its size (it replaces the gradients:
    not the monitor's memory), the steps that walked every gradient and the times it was put back."""
    buf = monitor._grad_norm.buffer
    if buf is None:
        return {"grad_buffer": None}
    return {"grad_buffer": {"state": buf.state, "bytes": sum(b.numel() * b.element_size() for b in buf.buffers),
                            "full_checks": buf.full_checks, "readopted": buf.readopted}}


def _grad_walks(env: Env, m: TEModel, repeats: int = 15) -> dict[str, Any]:
    """Host microseconds of each C-level walk over the gradients that GradNorm makes per call
    (the reads) and per re-pointing (the checks), median of ``repeats``: what a per-gradient cost is
    made of on this host."""
    import operator

    torch = env.torch
    m.zero_grad()
    m.forward_backward()
    params = [p for p in m.model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    walks: dict[str, Callable[[], object]] = {
        "grad": lambda: list(map(operator.attrgetter("grad"), params)),
        "data_ptr": lambda: list(map(torch.Tensor.data_ptr, grads)),
        "is_contiguous": lambda: all(map(torch.Tensor.is_contiguous, grads)),
        "numel": lambda: list(map(torch.Tensor.numel, grads)),
        "dtype": lambda: list(map(operator.attrgetter("dtype"), grads)),
        "get_device": lambda: list(map(torch.Tensor.get_device, grads)),
    }
    out: dict[str, Any] = {"gradients": len(grads)}
    for name, walk in walks.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            walk()
            times.append(_us_since(t0))
        out[name] = round(statistics.median(times), 1)
    m.zero_grad()
    return out


def _tripwire_probe(env: Env, monitor: Any, calls: int) -> dict[str, Any] | None:
    """Host microseconds of the tripwire's check alone (GPU idle: synchronised before each call),
    per backend where it runs: the one-launch kernel and the torch ops, each on a fresh tripwire
    of the monitor's configuration, over the monitor's ring slot 0 (loss, grad norm, saturation)."""
    from fp8guard.agent.kernels import triton_available
    from fp8guard.agent.tripwire import Tripwire

    own = monitor._tripwire
    if own is None:
        return None
    ring = monitor._ring
    loss, norm, sat = ring.scalars[0, 0], ring.scalars[0, 1], ring.saturation(0)
    out: dict[str, Any] = {}
    backends = ["triton", "torch"] if triton_available(env.torch.device(env.device)) else ["torch"]
    for backend in backends:
        w = Tripwire(own.device, loss_factor=own.loss_factor, grad_factor=own.grad_factor, saturation=own.saturation,
                     warmup_steps=own.warmup_steps, lag_steps=own.lag_steps, early_loss_rise=own.early_loss_rise,
                     early_grad_factor=own.early_grad_factor, early_steps=own.early_steps, backend=backend)
        times: list[float] = []
        for i in range(3 + max(calls, 5)):
            env.sync()
            t0 = time.perf_counter()
            w.check(i, loss=loss, grad_norm=norm, saturation=sat)
            if i >= 3:  # the first calls compile and cache
                times.append(_us_since(t0))
            w.fired()
        env.sync()
        out[backend] = _stats(times)
    return out


def _profile_step(env: Env, m: TEModel, monitor: Any, steps: int) -> dict[str, Any]:
    """Where ``monitor.step``'s host time goes at this depth: cProfile over ``steps`` calls, each
    after a training step and a synchronise (GPU idle), functions sorted by their own time."""
    from bench._host_profile import profile_host

    held: list[Any] = [None]

    def body() -> None:
        m.zero_grad()
        held[0] = m.forward_backward()
        m.opt.step()
        env.sync()

    report = profile_host(env.torch, lambda: monitor.step(held[0]), steps=steps, before=body, top=20,
                          sort="tottime")
    m.zero_grad()
    return report


def _norm_gpu_probe(env: Env, m: TEModel, monitor: Any, repeats: int = 5) -> dict[str, Any] | None:
    """GPU time (CUDA events, idle GPU) of the grad norm, the monitor's (table where Triton runs)
    and foreach, on the gradients of one step; their bandwidth and agreement."""
    if not env.cuda:
        return None
    torch = env.torch
    m.forward_backward()
    grads = [p.grad for p in m.model.parameters() if p.grad is not None]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    out: dict[str, Any] = {"grad_bytes_GB": round(nbytes / 1e9, 3)}
    values: dict[str, float] = {}
    own = monitor._grad_norm
    own_name = "buffer" if own.buffer is not None and own.buffer.adopted else own.backend
    for name, fn in ((own_name, own), ("foreach", env.foreach_norm(m))):
        if name in values:
            continue
        fn()  # warm-up (Triton compiles)
        torch.cuda.synchronize()
        ms: list[float] = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            value = fn()
            end.record()
            torch.cuda.synchronize()
            ms.append(start.elapsed_time(end))
        values[name] = float(value)
        out[name] = {"ms": round(statistics.median(ms), 4), "GBps": round(nbytes / 1e6 / statistics.median(ms))}
    reference = float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads])))
    out["rel_diff_vs_float64"] = {k: abs(v - reference) / reference for k, v in values.items()}
    m.zero_grad()
    return out


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
