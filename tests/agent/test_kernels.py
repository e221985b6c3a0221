"""The fused kernels against the torch reference: exact counts, same sum of squares.

The Triton path runs under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set before Triton
is imported, hence a fresh interpreter per check); the GPU runs the same kernels compiled (see
docs/gpu.md). The torch path is checked here against a brute-force element loop.
"""

from __future__ import annotations

import math
import os
import textwrap

import pytest

torch = pytest.importorskip("torch")

from fp8guard.agent import kernels  # noqa: E402
from fp8guard.agent.fp8 import Fp8Format, count_overflow_underflow, quantize  # noqa: E402
from tests.agent.interpreted import run_interpreted  # noqa: E402

FORMATS = [Fp8Format.E4M3, Fp8Format.E5M2]
EDGES = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, -1e-40, 3e38]


def _tensor(dtype: torch.dtype, fmt: Fp8Format, n: int = 6000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-34, 22, (n,), generator=g).float())
    x = torch.cat([torch.tensor(EDGES), x]).to(dtype)
    scale = torch.tensor([fmt.fp8_max / 700.0])
    # values right at the thresholds: the overflow threshold fp8_max * scale_inv and half the
    # smallest subnormal over the scale, and their float32 neighbours
    thr = float(torch.reciprocal(scale)[0] * fmt.fp8_max)
    half = fmt.smallest_subnormal / 2 / float(scale[0])
    near = [thr, math.nextafter(thr, math.inf), math.nextafter(thr, 0), half, math.nextafter(half, math.inf),
            math.nextafter(half, 0)]
    x = torch.cat([x, torch.tensor(near + [-v for v in near]).to(dtype)])
    return x, scale


def counted(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, fp8_bytes: torch.Tensor | None,
            backend: str) -> list[int]:
    """``[overflows, underflows]`` of one ``count_cast_into`` call into a fresh buffer."""
    out = torch.zeros(2, dtype=torch.int64)
    kernels.count_cast_into(out, x, scale=scale, scale_inv=torch.reciprocal(scale), fmt=fmt, fp8_bytes=fp8_bytes,
                            backend=backend)
    return [int(v) for v in out.tolist()]


def _brute(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, q: torch.Tensor) -> list[int]:
    """Element by element: TE's overflow threshold; underflow = nonzero value, zero FP8 byte."""
    thr = float(torch.reciprocal(scale)[0] * fmt.fp8_max)
    over = under = 0
    for v, b in zip(x.float().tolist(), q.view(torch.uint8).tolist(), strict=True):
        if not math.isnan(v) and abs(v) > thr:
            over += 1
        if v != 0.0 and (b & 0x7F) == 0:
            under += 1
    return [over, under]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_torch_path_equals_brute_force(fmt: Fp8Format, dtype: torch.dtype) -> None:
    x, scale = _tensor(dtype, fmt)
    q = quantize(x, scale[0], fmt)
    expected = _brute(x, scale, fmt, q)
    assert count_overflow_underflow(x, scale[0], fmt).tolist() == expected
    for fp8_bytes in (None, q):
        out = torch.zeros(2, dtype=torch.int64)
        kernels.count_cast_into(out, x, scale=scale, scale_inv=torch.reciprocal(scale), fmt=fmt, fp8_bytes=fp8_bytes,
                                backend="torch")
        out2 = out.clone()
        kernels.count_cast_into(out2, x, scale=scale, scale_inv=torch.reciprocal(scale), fmt=fmt, fp8_bytes=fp8_bytes)
        assert out.tolist() == expected and out2.tolist() == [2 * v for v in expected]  # it adds


def test_mismatched_bytes_are_refused() -> None:
    with pytest.raises(ValueError, match="elements"):
        kernels.count_cast_into(torch.zeros(2, dtype=torch.int64), torch.ones(4), scale=torch.ones(1),
                                scale_inv=torch.ones(1), fmt=Fp8Format.E4M3, fp8_bytes=torch.zeros(3, dtype=torch.uint8))


def test_no_triton_on_cpu_without_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter mode is on in this process")
    assert not kernels.triton_available(torch.device("cpu"))


_INTERPRETED = textwrap.dedent("""
    import json, torch
    from fp8guard.agent import kernels
    from fp8guard.agent.fp8 import Fp8Format, quantize
    from tests.agent.test_kernels import _tensor, counted
    assert kernels.triton_available(torch.device("cpu"))
    results = []
    for fmt in (Fp8Format.E4M3, Fp8Format.E5M2):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            # 3 blocks of 4096 and a tail: several programs, several loop iterations, masking
            x, scale = _tensor(dtype, fmt, n=3 * 4096 + 123, seed=1)
            q = quantize(x, scale[0], fmt)
            results.append([counted(x, scale, fmt, fp8_bytes, backend)
                            for fp8_bytes in (None, q) for backend in ("triton", "torch")])
    print(json.dumps({"counts": results}))
""")


@pytest.mark.slow
def test_triton_kernels_under_the_interpreter() -> None:
    got = run_interpreted(_INTERPRETED, timeout=600)
    for row in got["counts"]:
        # [hp path triton, hp path torch, bytes path triton, bytes path torch]: all four agree
        assert row[0] == row[1] == row[2] == row[3], row
        assert row[0][0] > 0 and row[0][1] > 0  # both counts exercised


_SPARSE = textwrap.dedent("""
    import json, torch
    from fp8guard.agent.fp8 import Fp8Format, quantize
    from tests.agent.test_kernels import counted
    # Tiles of 64 x 64: most hold only mid-range bytes (the FP8-bytes variant skips them), a few
    # hold one element that overflows or underflows, at a tile's first and last element, in the
    # tail, and next to a skipped tile. Lengths: a multiple of 4 (every byte in a 32-bit word of
    # the word test), and not (the last byte in no word); bytes 4-byte aligned (the word test)
    # and not (a view one byte in: the byte-by-byte test).
    out = []
    for fmt in (Fp8Format.E4M3, Fp8Format.E5M2):
        for dtype, n, offset in ((torch.bfloat16, 7 * 4096 + 77, 0), (torch.float16, 7 * 4096 + 77, 0),
                                 (torch.float32, 7 * 4096 + 77, 0), (torch.bfloat16, 7 * 4096 + 68, 0),
                                 (torch.bfloat16, 7 * 4096 + 77, 1), (torch.float32, 7 * 4096 + 68, 1)):
            x = torch.full((n,), 0.75, dtype=dtype)
            # thresholds fp8_max / scale: 4 (E4M3), 57344 (E5M2); 1e-6 casts to a zero byte in both
            scale = torch.tensor([fmt.fp8_max / 4.0 if fmt is Fp8Format.E4M3 else 1.0])
            for at in (4096, 3 * 4096 - 1, 5 * 4096 + 64, n - 1):
                x[at] = 100.0 if fmt is Fp8Format.E4M3 else 60000.0
            for at in (2 * 4096 + 5, 6 * 4096, n - 2):
                x[at] = 1e-6
            q = quantize(x, scale[0], fmt)
            if offset:  # the same bytes, one byte into a larger buffer
                q = torch.cat([torch.zeros(1, dtype=q.dtype), q])[1:]
            assert (q.view(torch.uint8).data_ptr() % 4 == 0) == (offset == 0)
            out.append([[4, 3]] + [counted(x, scale, fmt, q, backend) for backend in ("triton", "torch")])
        # the only counts of the last tile in the 3 bytes past the last whole word
        n = 2 * 4096 + 3
        x = torch.full((n,), 0.75)
        scale = torch.tensor([fmt.fp8_max / 4.0 if fmt is Fp8Format.E4M3 else 1.0])
        x[n - 1], x[n - 3] = (100.0 if fmt is Fp8Format.E4M3 else 60000.0), 1e-6
        q = quantize(x, scale[0], fmt)
        out.append([[1, 1]] + [counted(x, scale, fmt, q, backend) for backend in ("triton", "torch")])
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_bytes_variant_skips_tiles_with_nothing_to_count() -> None:
    """The FP8-bytes variant skips a tile whose bytes are all mid-range; tiles with one count
    beside skipped ones, at tile edges and in the tail, count exactly as the torch path."""
    for expected, triton_counts, torch_counts in run_interpreted(_SPARSE, timeout=600):
        assert triton_counts == torch_counts == expected


_TABLE = textwrap.dedent("""
    import json, torch
    from fp8guard.agent.telemetry import GradNorm, norm_of_grads
    g = torch.Generator().manual_seed(5)
    shapes = [(3, 4096 + 5), (0,), (77,), (4096,), (2, 33), (5000,)]
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.bfloat16, torch.float32, torch.bfloat16]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in zip(shapes, dtypes)]
    norm = GradNorm(params, backend="table")
    held = []  # earlier gradients stay alive: new ones cannot reuse their addresses
    out = []
    for step in range(7):
        if step in (0, 2, 5):  # new gradient tensors, as after zero_grad(set_to_none=True)
            for p in params:
                held.append(p.grad)
                p.grad = (torch.randn(p.shape, generator=g) * (step + 1)).to(p.dtype)
        elif step == 1:  # the same tensors, new values (zero_grad(set_to_none=False), then backward)
            for p in params:
                p.grad.mul_(3)
        elif step == 3:  # a non-contiguous gradient: that call takes the foreach path
            held.append(params[4].grad)
            params[4].grad = torch.randn(33, 2, generator=g).t()
        elif step == 4:  # a parameter without a gradient: the foreach path over the others
            params[4].grad = None
        else:  # a parameter changed dtype after the tables were built (p.data = ...): foreach
            held.append(params[0].grad)
            params[0].data = params[0].data.float()
            params[0].grad = torch.randn(params[0].shape, generator=g)
        grads = [p.grad for p in params if p.grad is not None]
        ref = sum(float(t.double().square().sum()) for t in grads) ** 0.5
        out.append({"table": float(norm()), "ref": ref, "foreach": float(norm_of_grads(grads)),
                    "repointed": norm.repointed})
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_table_grad_norm_under_the_interpreter() -> None:
    """GradNorm's one-launch-per-dtype Triton path over device tables built once, re-pointed only
    when the gradients move."""
    steps = run_interpreted(_TABLE, timeout=600)
    for s in steps:
        assert s["table"] == pytest.approx(s["ref"], rel=1e-6), s
    # re-pointed at the first call and when the gradients moved, not when only their values changed
    assert [s["repointed"] for s in steps] == [1, 1, 2, 2, 2, 3, 3]
    for fallback in (3, 4, 6):  # non-contiguous, missing, and a parameter whose dtype changed
        assert steps[fallback]["table"] == steps[fallback]["foreach"]
    assert len({s["ref"] for s in steps}) == 7


_CONFIGS = textwrap.dedent("""
    import json, torch
    from fp8guard.agent.kernels import TableSumOfSquares
    g = torch.Generator().manual_seed(9)
    # sizes around the entry's span (block x sub): shorter, equal, one over, several entries, empty
    numels = [1, 63, 64, 65, 128, 129, 300, 0, 1000]
    tensors = [torch.randn(n, generator=g).to(torch.bfloat16) for n in numels]
    ref = sum(float(t.double().square().sum()) for t in tensors)
    out = []
    for block, sub, warps, per_sm in [(64, 1, 4, 8), (64, 2, 4, 1), (32, 3, 2, 2), (16, 8, 4, 4), (128, 4, 8, 1)]:
        table = TableSumOfSquares(numels, torch.bfloat16, torch.device("cpu"), block=block, sub=sub, warps=warps,
                                  per_sm=per_sm)
        table.point([t.data_ptr() for t in tensors])
        out.append({"config": [block, sub, warps, per_sm], "sum": float(table()), "ref": ref,
                    "entries": table.n_blocks})
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_table_sum_of_squares_over_launch_configurations() -> None:
    """Entries of several blocks (``sub``), any warps and programs per SM: the same sum, tensors
    ending inside an entry's span included."""
    rows = run_interpreted(_CONFIGS, timeout=600)
    for row in rows:
        assert row["sum"] == pytest.approx(row["ref"], rel=1e-6), row
    assert [r["entries"] for r in rows] == [
        sum(-(-n // (b * s)) for n in [1, 63, 64, 65, 128, 129, 300, 0, 1000])
        for b, s, _, _ in [r["config"] for r in rows]]


def test_table_sum_of_squares_refuses_a_bad_configuration() -> None:
    from fp8guard.agent.kernels import TableSumOfSquares

    with pytest.raises(ValueError, match="positive"):
        TableSumOfSquares([4], torch.bfloat16, torch.device("cpu"), sub=0)


# -- every way the two variants could differ, pinned against TE's formulas on the cast's bytes --


def edge_results(backends: tuple[str, ...]) -> list[dict]:
    """Per case: TE's formulas on the bytes, then each variant on each backend."""
    from bench._count_edges import cast_bytes, edge_cases
    from fp8guard.agent.fp8 import count_from_cast

    rows = []
    for case in edge_cases():
        x, s, fmt = case["x"], case["scale"], case["fmt"]
        scale = torch.tensor([s], dtype=torch.float32)
        scale_inv = torch.reciprocal(scale)
        q = cast_bytes(x, s, fmt, case["cast"])
        row = {"name": case["name"], "te": count_from_cast(x, q, scale_inv, fmt).tolist(),
               "reference_hp": count_overflow_underflow(x, scale[0], fmt, scale_inv=scale_inv[0]).tolist()}
        for backend in backends:
            for variant, fp8_bytes in (("hp", None), ("bytes", q)):
                out = torch.zeros(2, dtype=torch.int64)
                kernels.count_cast_into(out, x, scale=scale, scale_inv=scale_inv, fmt=fmt, fp8_bytes=fp8_bytes,
                                        backend=backend)
                row[f"{variant}_{backend}"] = out.tolist()
        rows.append(row)
    return rows


def test_edge_cases_torch_paths_equal_te() -> None:
    rows = edge_results(("torch",))
    assert len(rows) > 40
    for row in rows:
        assert row["te"] == row["reference_hp"] == row["hp_torch"] == row["bytes_torch"], row
    # the cases are not vacuous: each kind of count occurs
    assert sum(r["te"][0] for r in rows) > 20 and sum(r["te"][1] for r in rows) > 40
    ties = [r for r in rows if r["name"].startswith("float32 product ties")]  # bench/_count_edges.py
    assert len(ties) == 18 and all(r["te"][1] >= 2 for r in ties), ties  # each tie and its negative underflow


def test_a_stale_scale_moves_only_the_high_precision_variant() -> None:
    """Delayed scaling updates the quantizer's scale in place after the pass: a kernel enqueued
    after that update (a replay, a deferred launch) reads a scale the cast never used. The bytes
    variant needs no scale and stays equal to TE; the high-precision one does not."""
    from fp8guard.agent.fp8 import count_from_cast

    fmt = Fp8Format.E4M3
    x, scale = _tensor(torch.bfloat16, fmt, n=4000, seed=3)
    q = quantize(x, scale[0], fmt).view(torch.uint8)
    te = count_from_cast(x, q, torch.reciprocal(scale), fmt).tolist()
    updated = scale * 2.0  # the next step's scale
    out_bytes, out_hp = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    kernels.count_cast_into(out_bytes, x, scale=updated, scale_inv=torch.reciprocal(scale), fmt=fmt, fp8_bytes=q,
                            backend="torch")
    kernels.count_cast_into(out_hp, x, scale=updated, scale_inv=torch.reciprocal(scale), fmt=fmt, backend="torch")
    assert out_bytes.tolist() == te
    assert out_hp[1] != te[1]  # fewer underflows under the doubled scale


_EDGES_INTERPRETED = textwrap.dedent("""
    import json
    from tests.agent.test_kernels import edge_results
    print(json.dumps(edge_results(("triton", "torch"))))
""")


@pytest.mark.slow
def test_edge_cases_triton_variants_equal_te_under_the_interpreter() -> None:
    rows = run_interpreted(_EDGES_INTERPRETED, timeout=600)
    assert len(rows) > 40
    for row in rows:
        assert row["te"] == row["hp_triton"] == row["bytes_triton"] == row["hp_torch"] == row["bytes_torch"], row


def test_the_bench_probe_names_the_operand_whose_variants_disagree() -> None:
    """bench/_count_probe.py's comparison (used by ``gpu_counts.py time`` and ``kernels``) on CPU
    operands of the model's layout: all agree; a stale scale on one operand is named."""
    from bench._count_probe import compare, synthetic_operands

    ops = synthetic_operands(layers=1, hidden=64, tokens=96, device="cpu")
    assert len(ops) == 12
    ops[3].x[0, :3] = torch.tensor([1e3, -1e3, 1e-30])  # layer0.proj's input: two overflows, an underflow
    ops[3].q = quantize(ops[3].x, ops[3].scale[0], ops[3].fmt).view(torch.uint8)
    first = compare(ops)
    assert first["agree"] and first["operands"] == 12 and first["disagreeing"] == 0
    assert first["total_te"][0] > 0 and first["total_te"][1] > 0  # both counts occur in the synthetic data
    ops[5].scale = ops[5].scale * 2.0**-30  # layer0.proj's gradient, replayed with a later scale
    second = compare(ops)
    assert not second["agree"] and second["disagreeing"] == 1
    bad = second["disagreements"][0]
    assert (bad["module"], bad["tensor"], bad["pass"], bad["fp8"], bad["dtype"]) == \
        ("layer0.proj", "gradient", "bwd", "e5m2", "bfloat16")
    assert bad["bytes"] == bad["te"] != bad["hp"]


def test_count_launch_plans_stay_bounded_when_operand_sizes_keep_changing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan per operand size is reused while sizes repeat; a run whose sizes change every step
    (varying sequence lengths) never holds more than ``MAX_PLANS`` of them."""
    from fp8guard.agent.kernels import counts

    monkeypatch.setattr(counts, "_PLANS", {})
    monkeypatch.setattr(counts, "launch_shape", lambda n, device, block, per_sm: (1, 1))  # no GPU here
    first = counts._plan(4096, torch.bfloat16, Fp8Format.E4M3, True, 0)
    assert counts._plan(4096, torch.bfloat16, Fp8Format.E4M3, True, 0) is first
    for n in range(1, 3 * counts.MAX_PLANS):
        counts._plan(n * 16, torch.bfloat16, Fp8Format.E4M3, True, 0)
        assert len(counts._PLANS) <= counts.MAX_PLANS


_ALIGNMENT = textwrap.dedent("""
    import json, torch
    from fp8guard.agent.fp8 import Fp8Format, quantize
    from fp8guard.agent.kernels import counts
    # which launches read the bytes as 32-bit words: only bytes at a 4-byte-aligned address (a
    # misaligned word load faults on the GPU; the interpreter would not notice)
    seen = []
    real = counts._launch_count
    def spy(kernel, grid, warps, x, q, scale, scale_inv, out, n, consts):
        seen.append([q.data_ptr() % 4, consts[9]])  # WORDS
        return real(kernel, grid, warps, x, q, scale, scale_inv, out, n, consts)
    counts._launch_count = spy
    x = torch.randn(4096 + 9)
    scale = torch.tensor([1.0])
    q = quantize(x, scale[0], Fp8Format.E4M3).view(torch.uint8)
    base = torch.zeros(q.numel() + 8, dtype=torch.uint8)
    for offset in range(4):
        qq = base[offset:offset + 4096].copy_(q[:4096])
        counts.count_cast_into(torch.zeros(2, dtype=torch.int64), x[:4096], scale=scale,
                               scale_inv=torch.reciprocal(scale), fmt=Fp8Format.E4M3, fp8_bytes=qq)
    print(json.dumps(seen))
""")


@pytest.mark.slow
def test_bytes_are_read_as_words_only_at_aligned_addresses() -> None:
    seen = run_interpreted(_ALIGNMENT, timeout=600)
    assert [misaligned for misaligned, _ in seen] == [0, 1, 2, 3]
    assert [words for _, words in seen] == [True, False, False, False]


def test_operands_past_the_kernels_offsets_take_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above MAX_KERNEL_ELEMENTS the kernel's 32-bit offsets could wrap: the torch path counts."""
    from fp8guard.agent.kernels import counts

    monkeypatch.setattr(counts, "MAX_KERNEL_ELEMENTS", 100)
    monkeypatch.setattr(counts, "_kernel", lambda: pytest.fail("the kernel was used"))
    x, scale = _tensor(torch.bfloat16, Fp8Format.E4M3, n=300)
    q = quantize(x, scale[0], Fp8Format.E4M3)
    got = counted(x, scale, Fp8Format.E4M3, q, "triton")
    assert got == _brute(x, scale, Fp8Format.E4M3, q)


_STREAM_READ = textwrap.dedent("""
    import json, torch
    from bench import _stream_read
    # bench/_stream_read.py's read-only kernel (the bound the count kernel is held against) must
    # load every word: its fold equals torch's max, at any grid, with the maximum anywhere
    out = []
    for n, at in ((3 * 1024 + 77, 5), (3 * 1024 + 77, 3 * 1024 + 76), (4096, 2048)):
        w = torch.randint(-2**31, -2**20, (n,), dtype=torch.int32)  # all negative: nothing is 0
        w[at] = -7
        for block, iters in ((1024, 1), (1024, 4), (256, 2)):
            sink = torch.full((1,), -2**31, dtype=torch.int32)
            grid = -(-n // (block * iters))
            _stream_read._read_kernel[(grid,)](w, sink, n, BLOCK=block, ITERS=iters)
            out.append(int(sink[0]))
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_stream_read_reference_loads_every_word() -> None:
    assert run_interpreted(_STREAM_READ, timeout=300) == [-7] * 9
