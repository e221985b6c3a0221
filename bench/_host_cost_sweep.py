"""``bench/gpu_host_cost.py --parts sweep``: ``Monitor.step``'s host cost against model depth.

``sweep``: for 12, 24, 48 and 96 layers (hidden 1024, sequence 1024, batch 8): attach time
(synchronised), the device memory attach allocates and the transient peak of one
``monitor.step``, then the host microseconds of ``monitor.step`` in a training loop that
never syncs (GPU busy) and with the GPU idle (synchronised before the call), and the idle host
time of its two parts: the grad norm and the TE source's read.
Also the GPU time and bandwidth of the grad norm, the table kernel (the default) and
``GradNorm(backend="foreach")``, their difference from a float64 norm, and how often the
table was re-pointed at new gradient addresses during the sweep.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from bench._host_cost_env import Env, _buffer_state, _stats, _us_since
from bench._te_model import TEModel


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
