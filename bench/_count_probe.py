"""The counting kernels alone, on a step's worth of operands: both variants compared operand by
operand against TE's formulas, timed eagerly and replayed from a CUDA graph, and the host time to
enqueue them through Triton's JIT dispatch and through the cached compiled-kernel handle.

Used by ``bench/gpu_counts.py time`` (the operands one counted step of the TE model handed to
``inspect_tensor``, copied at that moment) and ``bench/gpu_counts.py kernels`` (synthetic operands
of the same 144 shapes, no TE needed, with a sweep of launch shapes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from fp8guard.agent.fp8 import Fp8Format, count_from_cast, count_overflow_underflow
from fp8guard.agent.kernels import counts as kernels
from fp8guard.agent.kernels._launch import launch_shape, triton_available

ROLE = {"activation": ("fprop input (and wgrad)", "fwd"), "weight": ("fprop weight (and dgrad)", "fwd"),
        "gradient": ("dgrad/wgrad grad output", "bwd")}


@dataclass
class Operand:
    """One cast: the values, the cast's bytes (or None), the scale it used and its scale_inv,
    all copied when the cast was inspected (TE and the optimizer change them in place later)."""

    layer: str
    tensor: str
    recipe: str
    x: torch.Tensor
    q: torch.Tensor | None
    scale: torch.Tensor | None
    scale_inv: torch.Tensor
    fmt: Fp8Format
    extra: dict[str, Any] = field(default_factory=dict)

    def name(self) -> dict[str, Any]:
        role, direction = ROLE.get(self.tensor, (self.tensor, "?"))
        return {"module": self.layer, "tensor": self.tensor, "gemm_role": role, "pass": direction,
                "dtype": str(self.x.dtype).replace("torch.", ""), "fp8": self.fmt.value, "recipe": self.recipe,
                "numel": self.x.numel()}


ROW_BY_ROW_TRIED = 8
"""``kernels.ROW_BY_ROW`` in the ``bytes_row_by_row`` variant: a quarter of a 32-row tile; the
flagged tiles of the model's operands have one or two flagged rows, a dense tile takes the tile path."""

SETTINGS: dict[str, dict[str, Any]] = {
    "bytes_bytewise": {"BYTES_IN_WORDS": False},
    "bytes_row_by_row": {"ROW_BY_ROW": ROW_BY_ROW_TRIED},
    "bytes_two_ahead": {"TILES_AHEAD": 2},
    "bytes_two_ahead_row_by_row": {"TILES_AHEAD": 2, "ROW_BY_ROW": ROW_BY_ROW_TRIED},
}
"""The FP8-bytes variant with some of the count module's settings changed: the bytes tested one by
one (as unaligned bytes are; since the tenth session a flagged tile's bytes are loaded once there,
not twice), a flagged tile's flagged rows read one by one, two tiles' words loading while one is
tested, both."""

VARIANTS = ("hp", "bytes", *SETTINGS)
"""The high-precision variant, the FP8-bytes variant as it runs (bytes tested four to a word), and
the candidates of :data:`SETTINGS` (the sweep times them all)."""
TIMED = ("hp", "bytes", "bytes_bytewise")
"""The variants :func:`timing` times eagerly, from a graph and for host time (the ones a run can use)."""


def _run(ops: list[Operand], dst: torch.Tensor, variant: str) -> None:
    if variant in SETTINGS:
        before = {name: getattr(kernels, name) for name in SETTINGS[variant]}
        for name, value in SETTINGS[variant].items():
            setattr(kernels, name, value)
        try:
            _run(ops, dst, "bytes")
        finally:
            for name, value in before.items():
                setattr(kernels, name, value)
        return
    for i, op in enumerate(ops):
        if variant == "bytes" and op.q is None:
            continue
        if variant == "hp" and op.scale is None:
            continue
        kernels.count_cast_into(dst[i], op.x, scale=op.scale if op.scale is not None else op.scale_inv,
                                scale_inv=op.scale_inv, fmt=op.fmt, fp8_bytes=op.q if variant == "bytes" else None)


def compare(ops: list[Operand]) -> dict[str, Any]:
    """Per operand: the high-precision variant, the FP8-bytes variant, and TE's formulas on the
    bytes (``count_from_cast``; without bytes, ``count_overflow_underflow`` with the cast's
    scale). Every disagreement is listed by name."""
    n = len(ops)
    device = ops[0].x.device if ops else torch.device("cuda")
    hp = torch.zeros(n, 2, dtype=torch.int64, device=device)
    by = torch.zeros_like(hp)
    _run(ops, hp, "hp")
    _run(ops, by, "bytes")
    te = torch.stack([count_from_cast(op.x, op.q, op.scale_inv, op.fmt) if op.q is not None else
                      count_overflow_underflow(op.x, op.scale.reshape(()), op.fmt,
                                               scale_inv=op.scale_inv.reshape(())) if op.scale is not None else
                      torch.full((2,), -1, dtype=torch.int64, device=device) for op in ops]) if ops else hp
    hp_h, by_h, te_h = hp.cpu().tolist(), by.cpu().tolist(), te.cpu().tolist()
    bad = []
    for i, op in enumerate(ops):
        got = {"te": te_h[i]}
        if op.scale is not None:
            got["hp"] = hp_h[i]
        if op.q is not None:
            got["bytes"] = by_h[i]
        if len({tuple(v) for v in got.values()}) > 1:
            bad.append({**op.name(), **got})
    return {"operands": n, "with_bytes": sum(op.q is not None for op in ops),
            "with_scale": sum(op.scale is not None for op in ops), "disagreeing": len(bad),
            "disagreements": bad[:40], "agree": not bad,
            "total_te": [sum(r[0] for r in te_h), sum(r[1] for r in te_h)]}


def _best_ms(body: Any, dst: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        dst.zero_()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        body()
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1))
    return best


def replay_ms(body: Any, dst: torch.Tensor, repeats: int) -> float:
    """``body`` captured once in a CUDA graph, then the best of ``repeats`` replays (ms)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    ms = _best_ms(graph.replay, dst, repeats)
    del graph
    return ms


def _graph_ms(ops: list[Operand], dst: torch.Tensor, variant: str, repeats: int) -> float:
    return replay_ms(lambda: _run(ops, dst, variant), dst, repeats)


def host_us_per_launch(ways: dict[str, Any], launches: int, passes: int) -> dict[str, Any]:
    """Host microseconds per launch of each way (a body enqueueing ``launches`` launches): passes
    in one process, the ways' order rotated each pass so that none always follows another, the
    first pass (warm-up) dropped; the median and the range of each way's passes."""
    names = list(ways)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(passes + 1):
        for name in names[r % len(names):] + names[:r % len(names)]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ways[name]()
            t = time.perf_counter() - t0
            if r:
                times[name].append(t / max(1, launches) * 1e6)
    torch.cuda.synchronize()
    out: dict[str, Any] = {}
    for name, v in times.items():
        v.sort()
        out[name] = round(v[len(v) // 2], 2)
        out[f"{name}_min_max"] = [round(v[0], 2), round(v[-1], 2)]
    return out


def _host_us_per_launch(ops: list[Operand], dst: torch.Tensor, variant: str, fast: bool) -> float:
    """Host time to enqueue the operands' launches (median of 5 passes), per launch."""
    kernels._LAUNCH.fast = fast
    try:
        _run(ops, dst, variant)  # compiles / fills the handle cache
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            _run(ops, dst, variant)
            times.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        times.sort()
        return times[2] / max(1, len(ops)) * 1e6
    finally:
        kernels._LAUNCH.fast = True


def timing(ops: list[Operand], repeats: int = 5) -> dict[str, Any]:
    """GPU time of each variant (eager and graph), the bytes each reads, and host enqueue cost."""
    dst = torch.zeros(len(ops), 2, dtype=torch.int64, device="cuda")
    out: dict[str, Any] = {"kernel_calls": len(ops), "elements": sum(op.x.numel() for op in ops)}
    max_code = {Fp8Format.E4M3: 0x7E, Fp8Format.E5M2: 0x7B}
    fetched = 0
    for op in ops:
        if op.q is not None:
            mag = op.q.view(torch.uint8) & 0x7F
            need = (mag == 0) | (mag >= max_code[op.fmt])
            rows = need.reshape(-1)[: need.numel() // 64 * 64].reshape(-1, 64).any(dim=1)
            fetched += int(rows.sum()) * 64
    hp_bytes = sum(op.x.numel() * op.x.element_size() for op in ops if op.scale is not None)
    by_bytes = sum(op.x.numel() for op in ops if op.q is not None) + 2 * fetched
    for variant, nbytes in (("hp", hp_bytes), *((v, by_bytes) for v in TIMED if v != "hp")):
        try:
            eager = _best_ms(lambda v=variant: _run(ops, dst, v), dst, repeats)
        except Exception as exc:  # one variant's failure must not lose the others' figures
            out[variant] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            continue
        try:
            graph = _graph_ms(ops, dst, variant, repeats)
            err = None
        except Exception as exc:  # capture can fail on some stacks; eager figures remain
            graph, err = float("nan"), f"{type(exc).__name__}: {exc}"[:200]
        out[variant] = {"GB": round(nbytes / 1e9, 3), "eager_ms": round(eager, 3),
                        "eager_GBps": round(nbytes / 1e6 / eager), "graph_ms": round(graph, 3),
                        "graph_GBps": round(nbytes / 1e6 / graph) if graph == graph else None, "graph_error": err,
                        "host_us_per_launch_jit": round(_host_us_per_launch(ops, dst, variant, False), 2),
                        "host_us_per_launch_cached_handle": round(_host_us_per_launch(ops, dst, variant, True), 2)}
    if "eager_ms" in out.get("bytes", {}):
        out["bytes"]["rows_fetched_fraction"] = round(fetched / max(1, out["elements"]), 6)
    out["cached_handle_in_use"] = bool(kernels._LAUNCH.fast and kernels._LAUNCH.cached)
    timed = [v for v in TIMED if "eager_ms" in out[v]]
    out["fastest"] = min(timed, key=lambda v: out[v]["graph_ms"] if out[v]["graph_ms"] == out[v]["graph_ms"]
                         else out[v]["eager_ms"], default=None)
    return out


def ceiling(ops: list[Operand], repeats: int = 5) -> dict[str, Any]:
    """Two references for the FP8-bytes variant on these shapes, graph-replayed: the same launches
    with every byte mid-range (no tile read again: the word test and its branch alone), and torch
    reading the same bytes (``amax`` over each operand's bytes as 32-bit words, a reduction and a
    one-element copy per operand), neither of them a peak read; then a plain streaming read of the
    same bytes (``bench/_stream_read.py``: one Triton launch per operand doing nothing but load and
    fold, at a few launch shapes, and all the bytes in one launch), the bound of a one-read pass."""
    with_bytes = [op for op in ops if op.q is not None]
    nbytes = sum(op.q.numel() for op in with_bytes if op.q is not None)
    dst = torch.zeros(len(with_bytes), 2, dtype=torch.int64, device="cuda")
    clean = [Operand(op.layer, op.tensor, op.recipe, op.x, torch.full_like(op.q, 0x30), op.scale, op.scale_inv,
                     op.fmt) for op in with_bytes if op.q is not None]
    _run(clean, dst, "bytes")
    no_flags = _graph_ms(clean, dst, "bytes", repeats)
    assert int(dst.sum()) == 0  # nothing to count in mid-range bytes
    del clean
    words = [op.q.view(torch.int32) for op in with_bytes if op.q is not None and op.q.numel() % 4 == 0]
    sink = torch.zeros(len(words), dtype=torch.int32, device="cuda")

    def read() -> None:
        for i, w in enumerate(words):
            sink[i] = torch.amax(w)

    read()
    torch_ms = replay_ms(read, dst, repeats)
    words_bytes = sum(w.numel() * 4 for w in words)
    from bench import _stream_read  # Triton at import: the GPU host only

    try:  # new in the tenth session, not yet run on a GPU: its failure must not lose the rest
        stream = _stream_read.measure(words, lambda body: replay_ms(body, dst, repeats))
    except Exception as exc:
        stream = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"GB": round(nbytes / 1e9, 3), "bytes_variant_no_flagged_tiles_ms": round(no_flags, 3),
            "bytes_variant_no_flagged_tiles_GBps": round(nbytes / 1e6 / no_flags),
            "torch_amax_read_ms": round(torch_ms, 3), "torch_amax_read_GBps": round(words_bytes / 1e6 / torch_ms),
            "stream_read": stream}


def legacy_count_cast_into(out: torch.Tensor, x: torch.Tensor, *, scale: torch.Tensor, scale_inv: torch.Tensor,
                           fmt: Fp8Format, fp8_bytes: torch.Tensor | None = None) -> None:
    """``count_cast_into``'s launch path before the seventh session (docs/gpu.md): the grid,
    the constants and the handle's key derived on every launch (the same kernel, the same key)."""
    if x.numel() == 0:
        return
    if not triton_available(x.device) or x.dtype not in kernels._HP_KIND or not x.is_contiguous() or (
            fp8_bytes is not None and not fp8_bytes.is_contiguous()):
        out.add_(kernels._torch_counts(x, scale=scale, scale_inv=scale_inv, fmt=fmt, fp8_bytes=fp8_bytes))
        return
    kernel = kernels._kernel()
    rows, cols, per_sm, warps = kernels.COUNT_SHAPES["bytes" if fp8_bytes is not None else "hp"]
    n = x.numel()
    grid, iters = launch_shape(n, x.device, rows * cols, per_sm=per_sm)
    q = fp8_bytes if fp8_bytes is not None else x
    words = fp8_bytes is not None and kernels.BYTES_IN_WORDS and q.data_ptr() % 4 == 0
    consts = kernels.kernel_consts(fmt, x.dtype, fp8_bytes is not None, rows, cols, iters, words,
                                   kernels.ROW_BY_ROW if words else 0, kernels.TILES_AHEAD if words else 1)
    kernels._launch_count(kernel, grid, warps, x, q, scale, scale_inv, out, n, consts)


def launch_path_ab(ops: list[Operand], passes: int = 9) -> dict[str, Any]:
    """Host time per launch of the current launch path against :func:`legacy_count_cast_into`,
    passes alternating in one process (the bytes variant, through the cached handle and through
    the JIT), and whether both paths counted the same."""
    dst = torch.zeros(len(ops), 2, dtype=torch.int64, device="cuda")
    paths = {"current": kernels.count_cast_into, "legacy": legacy_count_cast_into}

    def enqueue(fn: Any) -> None:
        for i, op in enumerate(ops):
            fn(dst[i], op.x, scale=op.scale_inv, scale_inv=op.scale_inv, fmt=op.fmt, fp8_bytes=op.q)

    out: dict[str, Any] = {"passes": passes}
    for fast in (True, False):
        kernels._LAUNCH.fast = fast
        try:
            times = host_us_per_launch({name: lambda f=fn: enqueue(f) for name, fn in paths.items()},
                                       len(ops), passes)
        finally:
            kernels._LAUNCH.fast = True
        label = "cached_handle" if fast else "jit"
        for name in paths:
            out[f"host_us_per_launch_{label}_{name}"] = times[name]
            out[f"host_us_per_launch_{label}_{name}_min_max"] = times[f"{name}_min_max"]
    a = torch.zeros(len(ops), 2, dtype=torch.int64, device="cuda")
    b = torch.zeros_like(a)
    for i, op in enumerate(ops):
        kernels.count_cast_into(a[i], op.x, scale=op.scale_inv, scale_inv=op.scale_inv, fmt=op.fmt, fp8_bytes=op.q)
        legacy_count_cast_into(b[i], op.x, scale=op.scale_inv, scale_inv=op.scale_inv, fmt=op.fmt, fp8_bytes=op.q)
    out["same_counts"] = bool(torch.equal(a, b))
    return out


def synthetic_operands(layers: int = 12, hidden: int = 2048, tokens: int = 16384, seed: int = 0,
                       device: str = "cuda") -> list[Operand]:
    """The 144 operand shapes of bench/_te_model.py's model (12 per TransformerLayer: input,
    weight and grad output of the QKV, projection, FC1 and FC2 GEMMs), BF16 values of a few
    decades of spread, cast the way TE does (E4M3 forward, E5M2 gradients, scale from the amax)."""
    from fp8guard.agent.fp8 import quantize

    g = torch.Generator(device=device).manual_seed(seed)
    h = hidden
    per_layer = [("qkv", "activation", (tokens, h)), ("qkv", "weight", (3 * h, h)), ("qkv", "gradient", (tokens, 3 * h)),
                 ("proj", "activation", (tokens, h)), ("proj", "weight", (h, h)), ("proj", "gradient", (tokens, h)),
                 ("fc1", "activation", (tokens, h)), ("fc1", "weight", (4 * h, h)), ("fc1", "gradient", (tokens, 4 * h)),
                 ("fc2", "activation", (tokens, 4 * h)), ("fc2", "weight", (h, 4 * h)), ("fc2", "gradient", (tokens, h))]
    ops = []
    for i in range(layers):
        for module, tensor, shape in per_layer:
            fmt = Fp8Format.E5M2 if tensor == "gradient" else Fp8Format.E4M3
            x = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
            x.mul_(2.0 ** (-6 if tensor == "gradient" else -1))
            # a stale amax of 4.5 standard deviations: a few values in 10**5 clip, and rows of 64
            # holding a zero or maximum byte are about as rare as on the TE model (0.035 %)
            amax = 4.5 * 2.0 ** (-6 if tensor == "gradient" else -1)
            scale = torch.tensor([fmt.fp8_max / amax], device=device)
            q = quantize(x, scale[0], fmt).view(torch.uint8)
            ops.append(Operand(f"layer{i}.{module}", tensor, "synthetic", x, q, scale, torch.reciprocal(scale), fmt))
    return ops


SWEEP = [(32, 64, 32, 2), (16, 128, 32, 4), (64, 64, 16, 4), (64, 64, 32, 2), (32, 64, 16, 4), (32, 64, 32, 4), (16, 64, 32, 2),
         (32, 128, 16, 4), (64, 64, 32, 4), (16, 256, 8, 4), (32, 128, 32, 2), (16, 64, 32, 1)]
"""(rows, cols, programs per SM, warps) tried by ``kernels``; the first two are the current defaults
(FP8-bytes, high-precision). Three 8-warp shapes of earlier sweeps (the slowest for both variants,
docs/gpu-results/gpu_counts_kernels.2026-12-04.json) gave way to 2- and 1-warp ones: a tile's
flag test is a reduction over the program, which one warp does without shared memory."""


def sweep(ops: list[Operand], repeats: int = 3) -> dict[str, Any]:
    """Graph-replayed GPU time of each launch shape in :data:`SWEEP`, per variant."""
    dst = torch.zeros(len(ops), 2, dtype=torch.int64, device="cuda")
    ref = torch.zeros_like(dst)
    saved = dict(kernels.COUNT_SHAPES)
    hp_bytes = sum(op.x.numel() * op.x.element_size() for op in ops)
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    try:
        for variant in VARIANTS:
            kernels.COUNT_SHAPES.update(saved)
            # each variant's own reference at the default shape (the kernels accumulate); the
            # bytes tested one by one, or rows read one by one, must count what the words count
            _run(ops, ref.zero_(), "bytes" if variant in SETTINGS else variant)
            for shape in SWEEP:
                kernels.COUNT_SHAPES["hp" if variant == "hp" else "bytes"] = shape
                try:
                    _run(ops, dst.zero_(), variant)  # compile outside the graph
                    same = bool(torch.equal(dst, ref))
                    ms = _graph_ms(ops, dst, variant, repeats)
                    row = {"shape": list(shape), "graph_ms": round(ms, 3), "same_counts": same}
                    if variant == "hp":
                        row["GBps"] = round(hp_bytes / 1e6 / ms)
                except Exception as exc:
                    row = {"shape": list(shape), "error": f"{type(exc).__name__}: {exc}"[:200]}
                results[variant].append(row)
    finally:
        kernels.COUNT_SHAPES.clear()
        kernels.COUNT_SHAPES.update(saved)
    best = {v: min((r for r in rows if "graph_ms" in r and r["same_counts"]), key=lambda r: r["graph_ms"],
                   default=None) for v, rows in results.items()}
    return {"shapes": results, "best": best}
