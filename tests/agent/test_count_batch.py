"""Several casts counted in one launch (``count_batch.CountBatch``, the batched count kernel) against
one launch each and the torch path, under Triton's CPU interpreter (each check in a fresh
interpreter: see tests/agent/interpreted.py); and where TE's inspection path flushes what it holds."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

pytest.importorskip("torch")

from tests.agent.interpreted import run_interpreted

_BATCHED = textwrap.dedent("""
    import json, torch
    from fp8guard.agent.fp8 import Fp8Format, quantize
    from fp8guard.agent.kernels import counts
    from fp8guard.agent.kernels.count_batch import CountBatch
    from tests.agent.test_kernels import _tensor, counted

    def aligned(t, shift=0):
        # a copy at a 64-byte boundary (plus shift bytes)
        size = t.numel() * t.element_size()
        buf = torch.empty(size + 128, dtype=torch.uint8)
        at = (-buf.data_ptr()) % 64 + shift
        v = buf[at:at + size].view(t.dtype)
        v.copy_(t.reshape(-1))
        return v

    # Operands of different lengths (one tile, many, a program's share and more), each with its own
    # counts, so that a program counting into another slot's row or reading another slot's bytes
    # changes some row; two that cannot be batched (a length not a multiple of 16, bytes off a
    # 16-byte boundary) are counted alone.
    lengths = [4096 * 3, 160, 4096 * 5 + 32, 2048, 4096 * 2 + 16 * 7, 64 * 1000, 48, 4096 * 9, 4096 + 16]
    out = []
    for limit, ahead, slots in SETTINGS:
        counts.ROW_BY_ROW, counts.TILES_AHEAD = limit, ahead
        for fmt in (Fp8Format.E4M3, Fp8Format.E5M2):
            for dtype in DTYPES:
                ops = []
                for i, n in enumerate(lengths):
                    x, scale = _tensor(dtype, fmt, n=n, seed=i)
                    x = aligned(x[:n])
                    q = aligned(quantize(x, scale[0], fmt).view(torch.uint8))
                    ops.append((x, scale, q))
                x, scale = _tensor(dtype, fmt, n=1000, seed=99)
                x = aligned(x[:1000 - 3])  # 997 elements
                ops.append((x, scale, aligned(quantize(x, scale[0], fmt).view(torch.uint8))))
                x, scale = _tensor(dtype, fmt, n=4096, seed=98)
                x = aligned(x[:4096])
                ops.append((x, scale, aligned(quantize(x, scale[0], fmt).view(torch.uint8), shift=4)))
                batch = CountBatch(slots)
                rows = torch.zeros(len(ops), 2, dtype=torch.int64)
                for j, (x, scale, q) in enumerate(ops):
                    batch.add(rows[j], x, scale=scale, scale_inv=torch.reciprocal(scale), fmt=fmt, fp8_bytes=q)
                held = len(batch)
                batch.flush()
                want = [counted(x, s, fmt, q, "torch") for x, s, q in ops]
                alone = [counted(x, s, fmt, q, "triton") for x, s, q in ops]
                out.append({"setting": [limit, ahead, slots, str(fmt), str(dtype)], "batched": rows.tolist(),
                            "torch": want, "alone": alone, "launches": batch.launches, "alone_count": batch.alone,
                            "held_before_flush": held, "held_after": len(batch)})
    print(json.dumps(out))
""")


_BOUNDED = textwrap.dedent("""
    import json, torch
    from fp8guard.agent.fp8 import Fp8Format, quantize
    from fp8guard.agent.kernels.count_batch import CountBatch
    from tests.agent.test_kernels import _tensor, counted

    fmt = Fp8Format.E4M3
    ops = []
    for i, n in enumerate([4096, 1024, 8192, 64, 2048]):  # 12, 3, 24, 0.19 and 6 KB held (BF16 + bytes)
        x, scale = _tensor(torch.bfloat16, fmt, n=n, seed=i)
        x = x[:n].clone()
        ops.append((x, scale, quantize(x, scale[0], fmt).view(torch.uint8)))
    batch = CountBatch(8, max_held_bytes=7 * 1024)
    rows = torch.zeros(len(ops), 2, dtype=torch.int64)
    held = []
    for j, (x, scale, q) in enumerate(ops):
        batch.add(rows[j], x, scale=scale, scale_inv=torch.reciprocal(scale), fmt=fmt, fp8_bytes=q)
        held.append(len(batch))
    batch.flush()
    print(json.dumps({"held": held, "launches": batch.launches, "rows": rows.tolist(),
                      "want": [counted(x, s, fmt, q, "torch") for x, s, q in ops]}))
""")


_LOW_ADDRESSES = textwrap.dedent("""
    import ctypes, json, mmap, torch
    from fp8guard.agent.fp8 import Fp8Format, quantize
    from fp8guard.agent.kernels.count_batch import CountBatch
    from tests.agent.test_kernels import _tensor, counted

    # Memory under 2**31, as a Python whose heap sits low hands out (a non-PIE build): Triton
    # types an int argument under 2**31 as 32 bits, so each address arrives as int32 there.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size, base = 1 << 20, None
    for want in (0x10000000, 0x20000000, 0x30000000, 0x40000000):
        got = libc.mmap(want, size, mmap.PROT_READ | mmap.PROT_WRITE,
                        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x100000, -1, 0)  # MAP_FIXED_NOREPLACE
        if got == want:
            base = got
            break
    if base is None:
        print(json.dumps(None))
        raise SystemExit(0)
    arena = torch.frombuffer((ctypes.c_uint8 * size).from_address(base), dtype=torch.uint8)
    used = 0

    def low(t):
        global used
        n = t.numel() * t.element_size()
        v = arena[used:used + n].view(t.dtype)
        v.copy_(t.reshape(-1))
        used += (n + 63) // 64 * 64
        return v

    fmt = Fp8Format.E4M3
    ops = []
    for i, n in enumerate([4096, 160, 8192 + 32]):
        x, scale = _tensor(torch.bfloat16, fmt, n=n, seed=i)
        x = low(x[:n])
        ops.append((x, scale, low(quantize(x, scale[0], fmt).view(torch.uint8))))
    rows = low(torch.zeros(len(ops), 2, dtype=torch.int64)).view(len(ops), 2)
    batch = CountBatch(8)
    for j, (x, scale, q) in enumerate(ops):
        batch.add(rows[j], x, scale=scale, scale_inv=low(torch.reciprocal(scale)), fmt=fmt, fp8_bytes=q)
    batch.flush()
    print(json.dumps({"top": base + used, "launches": batch.launches, "alone": batch.alone, "rows": rows.tolist(),
                      "want": [counted(x, s, fmt, q, "torch") for x, s, q in ops]}))
""")


def test_a_batch_of_tensors_at_low_addresses_counts_them() -> None:
    """Addresses under 2**31 reach the batched kernel as 32-bit integers (under the interpreter,
    from a Python whose heap sits low, as on the device machine's): they still make pointers (the
    kernel widens every address first). Failed there before the widening, with counting turned off."""
    out = run_interpreted(_LOW_ADDRESSES, timeout=300)
    if out is None:
        pytest.skip("no free address under 2**31 to map")
    assert out["top"] < 2**31
    assert out["launches"] == 1 and out["alone"] == 0
    assert out["rows"] == out["want"] and any(r != [0, 0] for r in out["rows"])


def test_a_bound_on_held_bytes_launches_a_group_early() -> None:
    """``max_held_bytes``: a group launches once its held tensors reach the bound, with the same
    counts; without a bound the same operands would wait for eight."""
    out = run_interpreted(_BOUNDED, timeout=300)
    assert out["held"] == [0, 1, 0, 1, 2] and out["launches"] == 3
    assert out["rows"] == out["want"]


def test_a_batch_refuses_a_bad_configuration() -> None:
    from fp8guard.agent.kernels.count_batch import CountBatch

    for bad in ({"slots": 1}, {"slots": 9}, {"max_held_bytes": 0}):
        with pytest.raises(ValueError):
            CountBatch(**bad)


_ALL = "SETTINGS = ((0, 1, 8), (0, 1, 2), (8, 2, 4), (8, 1, 8)); DTYPES = (torch.bfloat16, torch.float16, torch.float32)"
_QUICK = "SETTINGS = ((0, 1, 8),); DTYPES = (torch.bfloat16,)"


@pytest.mark.parametrize("which", [pytest.param(_QUICK, id="defaults"), pytest.param(_ALL, id="all", marks=pytest.mark.slow)])
def test_a_batched_launch_counts_what_one_launch_per_operand_counts(which: str) -> None:
    """Every slot's counts equal its own launch's and the torch path's, at two to eight operands
    a launch, with the word test's candidate settings; operands the batch cannot take are counted
    alone; a flush leaves nothing held (the default settings in the fast tier, all of them slow)."""
    results = run_interpreted(f"import torch\n{which}\n{_BATCHED}", timeout=600)
    assert len(results) == (4 * 2 * 3 if which == _ALL else 2)
    for r in results:
        assert r["batched"] == r["torch"] == r["alone"], r["setting"]
        assert all(over + under > 0 for over, under in r["torch"]), r["setting"]
        assert len({tuple(c) for c in r["torch"]}) == len(r["torch"])  # every row its own counts
        slots = r["setting"][2]
        assert r["alone_count"] == 2 and r["launches"] == -(-9 // slots), r["setting"]
        assert r["held_before_flush"] == 9 % slots and r["held_after"] == 0


_FLUSH_POINTS = textwrap.dedent("""
    import json, torch
    from types import SimpleNamespace
    from fp8guard.agent.fp8 import Fp8Format, quantize
    from fp8guard.agent.kernels.count_batch import CountBatch
    from fp8guard.agent.sources import te_counts

    scale = torch.tensor([Fp8Format.E4M3.fp8_max / 4.0])

    def cast(x):
        return SimpleNamespace(_data=quantize(x.detach(), scale[0], Fp8Format.E4M3).view(torch.uint8),
                               _scale_inv=torch.reciprocal(scale), _fp8_dtype="E4M3")

    targets = {("l0", "activation"): (0, Fp8Format.E4M3), ("l0", "weight"): (1, Fp8Format.E4M3),
               ("l0", "gradient"): (2, Fp8Format.E4M3)}
    counter = te_counts.InspectCounts(targets, torch.zeros(3, 2, dtype=torch.int64))
    counter.armed = True
    seen = {}

    class Gemm(torch.autograd.Function):
        # hands over its input and weight in the forward and the gradient in the backward, as TE does
        @staticmethod
        def forward(ctx, x, w, hand_gradient):
            counter.inspect("l0", "activation", x, cast(x), SimpleNamespace(), 0)
            counter.inspect("l0", "weight", w, cast(w), SimpleNamespace(), 0)
            seen.setdefault("held_in_forward", len(counter.batch))
            ctx.save_for_backward(x, w)
            ctx.hand_gradient = hand_gradient
            return x * w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            if ctx.hand_gradient:
                g = g.contiguous()
                counter.inspect("l0", "gradient", g, cast(g), SimpleNamespace(), 0)
                seen.setdefault("held_in_backward", len(counter.batch))
            return g * w, g * x, None

    class Module(torch.nn.Module):  # a TE module: its forward hands over its casts
        def __init__(self, hand_gradient):
            super().__init__()
            self.w = torch.nn.Parameter(torch.linspace(-300.0, 300.0, 16))
            self.hand_gradient = hand_gradient

        def forward(self, x):
            return Gemm.apply(x, self.w, self.hand_gradient)

    vals = torch.tensor([100.0, 1e-9, 1.0, -100.0] * 4)
    module = Module(True)
    # a forward hook the model had before fp8guard came (FSDP2's, which frees a gathered weight's
    # storage in place): it must find the module's casts counted already
    def earlier_hook(m, a, o):
        seen.setdefault("held_at_an_earlier_hook", len(counter.batch))

    module.register_forward_hook(earlier_hook)
    counter.modules = [module]
    counter.use_batch(CountBatch(8))
    x = vals.clone().requires_grad_(True)
    (module(x) * torch.full((16,), 1e-9)).sum().backward()
    seen["after_backward"] = [len(counter.batch), counter.counts.tolist()]
    # A backward that hands over no gradient (a session that counts the forward only), then an
    # optimizer step: the weight was counted at its module's forward end, before the step.
    counter.counts.zero_()
    module.hand_gradient = False
    (module(x) * torch.full((16,), 1e-9)).sum().backward()
    with torch.no_grad():
        module.w.zero_()
    counter.flush()
    seen["forward_only_then_step"] = counter.counts.tolist()
    # held, then dropped (a window a restart abandoned): nothing counted
    counter.counts.zero_()
    counter.inspect("l0", "activation", x, cast(x), SimpleNamespace(), 0)
    seen["held_outside_a_module"] = len(counter.batch)
    counter.drop()
    counter.flush()
    seen["after_drop"] = counter.counts.tolist()
    seen["launches"] = counter.batch.launches
    counter.use_batch(None)
    seen["hooks_after_release"] = len(module._forward_hooks)
    print(json.dumps(seen))
""")


def test_held_casts_are_counted_at_their_module_s_forward_end_and_at_the_backward_end() -> None:
    """With a batch, a module's forward casts (an activation, a weight) are held while its forward
    runs and counted at its end (a forward hook, ahead of the module's other forward hooks), so an
    optimizer step after a backward that hands over no gradient cannot change a held weight; gradients are counted when the backward ends; a
    dropped window counts nothing; releasing the batch removes the hooks."""
    seen = run_interpreted(_FLUSH_POINTS, timeout=300)
    activation = [8, 4]  # the threshold is 448 / 112 = 4: 100 and -100 overflow, 1e-9 underflows
    assert seen["held_in_forward"] == 2 and seen["held_in_backward"] == 1
    assert seen["held_at_an_earlier_hook"] == 0  # the flush runs first among the module's forward hooks
    held, rows = seen["after_backward"]
    assert held == 0 and rows[0] == activation and rows[1][0] > 0 and rows[2] == [0, 16]
    assert seen["forward_only_then_step"] == [activation, rows[1], [0, 0]]  # the weight as it was
    assert seen["held_outside_a_module"] == 1 and seen["after_drop"] == [[0, 0]] * 3
    assert seen["launches"] == 3 and seen["hooks_after_release"] == 1  # the model's own hook alone



_CHECKED = textwrap.dedent("""
    import json, torch
    from types import SimpleNamespace
    from bench._batch_check import batched_vs_at_once
    from fp8guard.agent.fp8 import Fp8Format, quantize
    from fp8guard.agent.kernels.count_batch import CountBatch
    from fp8guard.agent.sources import te_counts

    scale = torch.tensor([Fp8Format.E4M3.fp8_max / 4.0])

    def cast(x):
        return SimpleNamespace(_data=quantize(x.detach(), scale[0], Fp8Format.E4M3).view(torch.uint8),
                               _scale_inv=torch.reciprocal(scale), _fp8_dtype="E4M3")

    targets = {("l0", "activation"): (0, Fp8Format.E4M3), ("l1", "activation"): (1, Fp8Format.E4M3)}
    counter = te_counts.InspectCounts(targets, torch.zeros(2, 2, dtype=torch.int64))
    counter.armed = True
    counter.use_batch(CountBatch(8))
    vals = torch.tensor([100.0, 1e-9, 1.0, -100.0] * 4)
    reports = []
    with batched_vs_at_once() as clean:
        counter.inspect("l0", "activation", vals, cast(vals), SimpleNamespace(), 0)
        counter.flush()
    reports.append(clean)
    with batched_vs_at_once() as changed:
        x = vals.clone()
        counter.inspect("l0", "activation", x, cast(x), SimpleNamespace(), 0)
        y = vals.clone()
        counter.inspect("l1", "activation", y, cast(y), SimpleNamespace(), 0)
        y.mul_(1e-3)  # a held tensor changed before its launch: its +-100s no longer pass the threshold
        counter.flush()
        counter.inspect("l0", "activation", vals, cast(vals), SimpleNamespace(), 0)
        counter.drop()  # held, never launched: not compared
    reports.append(changed)
    reports.append(counter.counts.tolist())
    # Three slots, a byte bound of two large operands and two formats: the E4M3 group of large
    # operands launches at the bound (after 2), the E5M2 group of small ones when its slots fill
    # (after 3), and both at the flush. The shadow must launch at each of those moments, no later
    # (a tensor changed just after a launch would differ) and no earlier (one changed while the
    # run's batch still holds it would not).
    big = torch.tensor([100.0, 1e-9, 1.0, -100.0] * 16)
    e5 = SimpleNamespace(_data=quantize(vals, scale[0], Fp8Format.E5M2).view(torch.uint8),
                         _scale_inv=torch.reciprocal(scale), _fp8_dtype="E5M2")
    small = CountBatch(3, max_held_bytes=2 * big.numel() * 5)
    counter.use_batch(small)
    with batched_vs_at_once() as groups:
        for i in range(5):
            x = big.clone()
            counter.inspect("l0", "activation", x, cast(x), SimpleNamespace(), 0)
            y = vals.clone()
            counter.inspect("l1", "activation", y, e5, SimpleNamespace(), 0)
            if i == 1:
                x.zero_()  # launched already (the bound): a shadow that kept it would differ
            if i == 2:
                y.zero_()  # launched already (the slots filled): likewise
            if i == 3:
                y.zero_()  # held in the E5M2 group (launched at 3, then at the flush): changed before its launch
        z = torch.tensor([100.0, 1e-9] * 4)  # 8 elements: not batchable, counted at once by the batch itself
        counter.inspect("l0", "activation", z, cast(z), SimpleNamespace(), 0)
        counter.flush()
    reports.append([groups, small.launches])
    with batched_vs_at_once() as unlaunched:  # held when the block ends: the run never launched it inside
        counter.inspect("l0", "activation", vals, cast(vals), SimpleNamespace(), 0)
    counter.drop()
    reports.append(unlaunched)
    # a block that raises compares nothing and leaves CountBatch as it was
    originals = [te_counts.InspectCounts.inspect, CountBatch.add, CountBatch._flush_group, CountBatch.drop]
    try:
        with batched_vs_at_once() as failed:
            counter.inspect("l0", "activation", vals, cast(vals), SimpleNamespace(), 0)
            raise RuntimeError("the run failed")
    except RuntimeError:
        pass
    now = [te_counts.InspectCounts.inspect, CountBatch.add, CountBatch._flush_group, CountBatch.drop]
    reports.append([failed, all(a is b for a, b in zip(now, originals))])
    print(json.dumps(reports))
""")


def test_the_batch_check_finds_a_held_tensor_changed_before_its_launch() -> None:
    """``bench/_batch_check.py`` (``gpu_heal.py --check-batch``): each operand a batch takes is
    counted at once and again at the batch's launch; unchanged tensors agree, a held tensor
    written between its hand-over and its launch shows as a difference, and a dropped operand is
    not compared. The run's own counts are those of the batch alone."""
    clean, changed, counts, (groups, launches), unlaunched, (failed, restored) = run_interpreted(_CHECKED, timeout=300)
    assert clean["operands"] == 1 and clean["differing"] == 0
    assert clean["by_tensor"]["l0:activation"]["held"] == [8, 4]
    assert changed["operands"] == 2 and changed["differing"] == 1
    example, = changed["examples"]
    assert example["tensor"] == "l1:activation" and example["at_once"] == [8, 4] and example["held"] != [8, 4]
    assert counts[0] == [16, 8] and counts[1] == example["held"]
    # two groups, launches at the bound, the slots and the flush: exactly the one changed while held differs
    assert groups["operands"] == 10 and groups["differing"] == 1 and groups["alone"] == 1
    assert unlaunched["operands"] == 0 and unlaunched["still_held"] == 1
    assert groups["examples"][0]["tensor"] == "l1:activation" and launches == 5
    assert failed["aborted"] is True and failed["differing"] is None and restored


def _cuda_and_triton() -> bool:
    import torch

    from fp8guard.agent.kernels._launch import triton_modules

    return bool(torch.cuda.is_available()) and triton_modules() is not None


gpu = pytest.mark.skipif(not _cuda_and_triton(), reason="needs a CUDA GPU and Triton")


@gpu
def test_batched_counts_on_the_gpu_equal_one_launch_each_eagerly_in_a_graph_and_on_a_side_stream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU (compiled, through the compiled handle's C launcher): the 604M model's operand
    shapes at a quarter of the tokens, counted eight to a launch, equal one launch each; the same
    inside a CUDA graph; each launch on the stream its operands were held on."""
    import torch

    from bench._count_probe import synthetic_operands
    from fp8guard.agent.kernels import count_batch, count_cast_into
    from fp8guard.agent.kernels.count_batch import CountBatch

    ops = [op for op in synthetic_operands(layers=2, tokens=4096) if op.q is not None]
    want = torch.zeros(len(ops), 2, dtype=torch.int64, device="cuda")
    for i, op in enumerate(ops):
        count_cast_into(want[i], op.x, scale=op.scale_inv, scale_inv=op.scale_inv, fmt=op.fmt, fp8_bytes=op.q)
    got = torch.zeros_like(want)
    batch = CountBatch()

    def count_all() -> None:
        for i, op in enumerate(ops):
            batch.add(got[i], op.x, scale=op.scale_inv, scale_inv=op.scale_inv, fmt=op.fmt, fp8_bytes=op.q)
        batch.flush()

    count_all()  # compiles
    torch.cuda.synchronize()
    assert torch.equal(got, want) and int(want[:, 0].sum()) > 0 and int(want[:, 1].sum()) > 0
    per_format = [sum(op.fmt is fmt for op in ops) for fmt in {op.fmt for op in ops}]
    assert batch.alone == 0 and batch.launches == sum(-(-k // 8) for k in per_format) and count_batch._LAUNCH.direct
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got.zero_()
        with torch.cuda.graph(graph):
            count_all()
    torch.cuda.current_stream().wait_stream(side)
    got.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    # Launched on the stream the operands were made on, whichever stream flushes: held on a side
    # stream and flushed from the default one, and held on the default one (raw handle 0) and
    # flushed from a side stream.
    streams: list[int] = []
    real = count_batch._LAUNCH

    def recording(*args: Any, **kwargs: Any) -> None:
        streams.append(torch.cuda.current_stream().cuda_stream)
        real(*args, **kwargs)

    monkeypatch.setattr(count_batch, "_LAUNCH", recording)
    got.zero_()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i, op in enumerate(ops[:5]):
            batch.add(got[i], op.x, scale=op.scale_inv, scale_inv=op.scale_inv, fmt=op.fmt, fp8_bytes=op.q)
    batch.flush()
    for i, op in enumerate(ops[5:10], start=5):
        batch.add(got[i], op.x, scale=op.scale_inv, scale_inv=op.scale_inv, fmt=op.fmt, fp8_bytes=op.q)
    with torch.cuda.stream(side):
        batch.flush()
    torch.cuda.synchronize()
    assert torch.equal(got[:10], want[:10])
    default = torch.cuda.default_stream().cuda_stream
    assert streams and set(streams) == {side.cuda_stream, default}, (streams, side.cuda_stream, default)


def test_hooks_sit_only_on_the_modules_whose_casts_the_step_counts() -> None:
    """A batch's forward hooks run per module per forward: present only while the step counts
    that module (all of them when armed; under staggered counting those due at the step, the same
    ones TE's routing question is answered yes for), so uncounted steps run no per-module code."""
    import torch

    from fp8guard.agent.fp8 import Fp8Format
    from fp8guard.agent.kernels.count_batch import CountBatch
    from fp8guard.agent.sources import te_counts

    layers = [f"l{i}" for i in range(5)]
    modules = [torch.nn.Linear(2, 2) for _ in layers]
    counter = te_counts.InspectCounts({(layer, "activation"): (i, Fp8Format.E4M3) for i, layer in enumerate(layers)},
                                      torch.zeros(5, 2, dtype=torch.int64))
    counter.module_of = {layer: i for i, layer in enumerate(layers)}
    counter.modules = modules

    def hooked() -> list[int]:
        return [i for i, m in enumerate(modules) if m._forward_hooks]

    counter.use_batch(CountBatch(8))
    assert hooked() == []  # not armed: nothing counts
    counter.armed = True
    counter.sync_hooks()
    assert hooked() == [0, 1, 2, 3, 4]
    counter.armed, counter.owning, counter.every, counter.stagger_from = False, True, 3, 5
    # from the schedule's start at 5: nothing before its first whole window (steps 7-9), then due
    # modules at every step
    for step in range(5, 15):
        counter.step = step
        counter.sync_hooks()
        due = [i for i, layer in enumerate(layers) if counter.enabled(step, layer, "activation")[0]]
        assert hooked() == due and (due or step < 7)
        assert all(len(m._forward_hooks) <= 1 for m in modules)
    counter.use_batch(None)
    assert hooked() == []
