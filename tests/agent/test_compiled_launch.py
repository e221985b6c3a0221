"""Kernel launches through the compiled handle (``kernels._launch.CompiledLaunch``).

On the CPU: what the handle is keyed on, and the fall-back to the JIT when a handle fails. On a
CUDA GPU (skipped elsewhere): each fixed-argument kernel run through its cached handle (Triton's C
launcher called directly) gives the bits the JIT gives, also when a later call's tensors sit at an
alignment the first call's did not.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from fp8guard.agent.kernels._launch import CompiledLaunch, specialization_key, triton_modules  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available() or triton_modules() is None, reason="needs a CUDA GPU and Triton")


def test_the_key_follows_what_triton_specialises_on() -> None:
    base = torch.zeros(64)
    aligned, offset = base[4:], base[1:]  # 16 bytes in, 4 bytes in
    assert specialization_key([aligned]) == specialization_key([base])
    assert specialization_key([offset]) != specialization_key([aligned])
    assert specialization_key([base.to(torch.bfloat16)]) != specialization_key([base])
    assert specialization_key([32]) == specialization_key([48]) != specialization_key([33])
    assert specialization_key([1]) != specialization_key([17])  # 1 is specialised as a constant
    assert specialization_key([2**31]) != specialization_key([16])  # 64-bit argument
    assert specialization_key([True]) == specialization_key([False])  # bools are constants, passed as such


class _Handle:
    """What a compiled kernel's ``__getitem__`` gives; this one's launcher refuses its arguments."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def __getitem__(self, grid: tuple[int, int, int]) -> Any:
        def run(*args: Any) -> None:
            self.calls.append("handle")
            raise TypeError("launcher signature changed")
        return run


def test_a_failing_handle_falls_back_to_the_jit_for_good(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls: list[str] = []
    launch = CompiledLaunch()

    def jit() -> _Handle:
        calls.append("jit")
        return _Handle(calls)

    for _ in range(4):
        launch(1, (torch.zeros(4), 8), (True,), jit)
    # compiled once, the handle tried once (it failed: the JIT ran that launch), then the JIT only
    assert calls == ["jit", "handle", "jit", "jit", "jit"]
    assert not launch.fast and launch.cached == 0


class _Compiled:
    """A compiled kernel as Triton 3.6 has it after its first launch: the runner (``[grid]``) and
    the C launcher (``run``) with its function and packed metadata; ``refuse`` makes the C
    launcher raise as one of another signature would."""

    def __init__(self, calls: list[Any], refuse: bool = False) -> None:
        self.calls, self.refuse = calls, refuse
        self.function, self.packed_metadata = "function", "metadata"

    def __getitem__(self, grid: tuple[int, int, int]) -> Any:
        return lambda *args: self.calls.append(("runner", grid, args))

    def run(self, *args: Any) -> None:
        if self.refuse:
            raise TypeError("function takes exactly 20 arguments")
        self.calls.append(("c_launcher", *args))


@pytest.fixture
def no_gpu_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """The current stream as 77 (this machine has no CUDA stream to look up)."""
    from fp8guard.agent.kernels import _launch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(_launch, "_stream_lookup", lambda: lambda: 77)


@pytest.mark.usefixtures("no_gpu_stream")
def test_the_c_launcher_is_called_directly_while_no_launch_hook_is_set() -> None:
    """With Triton's hook chains empty, a cached handle's C launcher gets what Triton's runner
    would hand it less the launch metadata and the hooks; with a hook set (a profiler), the
    runner runs, so the hook sees the launch."""
    pytest.importorskip("triton")
    from triton import knobs

    from fp8guard.agent.kernels._launch import launch_hooks_off

    calls: list[Any] = []
    launch = CompiledLaunch()
    x = torch.zeros(4)
    jit_calls: list[str] = []
    compiled = _Compiled(calls)
    launch(3, (x, 8), (True, 64), lambda: jit_calls.append("jit") or compiled)  # compiles, keeps the handle
    assert launch_hooks_off()
    launch(3, (x, 8), (True, 64), lambda: jit_calls.append("jit") or compiled)
    assert jit_calls == ["jit"]
    assert calls == [("c_launcher", 3, 1, 1, 77, "function", "metadata", None, None, None, x, 8, True, 64)]

    def hook(metadata: Any) -> None:
        return None

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert not launch_hooks_off()
        launch(3, (x, 8), (True, 64), lambda: jit_calls.append("jit") or compiled)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert calls[-1] == ("runner", (3, 1, 1), (x, 8, True, 64)) and launch_hooks_off()


@pytest.mark.usefixtures("no_gpu_stream")
def test_a_c_launcher_of_another_signature_leaves_triton_s_runner() -> None:
    """A C launcher that refuses its arguments (another Triton's) is not called again: that
    launch and the later ones go through Triton's runner, the handle still used."""
    pytest.importorskip("triton")
    calls: list[Any] = []
    launch = CompiledLaunch()
    compiled = _Compiled(calls, refuse=True)
    for _ in range(3):
        launch(2, (torch.zeros(4),), (), lambda: compiled)
    assert [c[0] for c in calls] == ["runner", "runner"] and not launch.direct and launch.fast


def test_under_the_interpreter_every_call_goes_through_the_jit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls: list[str] = []
    launch = CompiledLaunch()
    for _ in range(3):
        launch(1, (torch.zeros(4),), (), lambda: calls.append("jit") or _Handle(calls))
    assert calls == ["jit"] * 3 and launch.cached == 0


@gpu
def test_table_norm_through_the_handle_equals_the_jit() -> None:
    from fp8guard.agent.kernels.table_norm import TableSumOfSquares

    g = torch.Generator(device="cuda").manual_seed(3)
    numels = [4096 * 3 + 5, 77, 1, 50_000]
    cached = TableSumOfSquares(numels, torch.bfloat16, torch.device("cuda"))
    jit_only = TableSumOfSquares(numels, torch.bfloat16, torch.device("cuda"))
    jit_only._launch.fast = False
    for step in range(4):
        grads = [torch.randn(n, generator=g, device="cuda").to(torch.bfloat16) * (step + 1) for n in numels]
        ptrs = [t.data_ptr() for t in grads]
        assert cached.point(ptrs) and jit_only.point(ptrs)
        got, want = cached(), jit_only()
        assert got is not None and want is not None
        assert torch.equal(got, want), step
        ref = sum(float(t.double().square().sum()) for t in grads)
        assert float(got) == pytest.approx(ref, rel=1e-5)
    assert cached._launch.fast and cached._launch.cached == 1
    assert cached._launch.direct  # Triton's C launcher took the arguments (no fall-back to its runner)


@gpu
def test_history_gather_through_the_handle_equals_the_jit() -> None:
    from fp8guard.agent.kernels.history_gather import HistoryGather

    n, length = 40, 16
    g = torch.Generator(device="cuda").manual_seed(4)
    history = torch.rand(length, n, generator=g, device="cuda") * 100
    history[3, 5] = float("nan")
    scales = torch.rand(n, generator=g, device="cuda") + 0.5
    at = [history.data_ptr() + 4 * c for c in range(n)]
    scale_at = [scales.data_ptr() + 4 * c for c in range(n)]
    gathers = [HistoryGather([448.0] * n, [1.0] * n, torch.device("cuda")) for _ in range(2)]
    gathers[1]._launch.fast = False
    for gather in gathers:
        assert gather.point(at, [length] * n, [n] * n, scale_at)
    ring = torch.zeros(2, 5, 3 * n + 1, device="cuda")  # row views at two alignments
    for step, offset in enumerate((0, 1, 0, 1)):
        outs = []
        for k, gather in enumerate(gathers):
            in_use = torch.full((n,), float(step + 1), device="cuda")
            keep = torch.ones(n, device="cuda")
            out = ring[k, :3, offset:offset + n]
            gather(out, in_use=in_use, keep=keep, rows=(0, 1, 2))
            outs.append(out.clone())
        assert torch.equal(outs[0].nan_to_num(-1.0), outs[1].nan_to_num(-1.0)), step
        history.mul_(1.5)
    assert gathers[0]._launch.fast and gathers[0]._launch.cached == 2  # one handle per alignment
    assert gathers[0]._launch.direct


@gpu
def test_counts_through_the_plan_equal_the_jit_at_each_alignment() -> None:
    """The count kernel's planned launch (a plan per operand shape, the key's alignment per
    launch) against every launch through Triton's JIT, on the same casts at two alignments."""
    from fp8guard.agent.fp8 import Fp8Format, count_from_cast, quantize
    from fp8guard.agent.kernels import counts

    g = torch.Generator(device="cuda").manual_seed(5)
    base = torch.randn(70_000 + 8, generator=g, device="cuda") * 300
    results = {}
    for fast in (True, False):
        counts._LAUNCH.fast = fast
        try:
            got = []
            for offset in (0, 1, 0, 1):  # bf16 elements: 0 or 2 bytes off a 16-byte boundary
                x = base.to(torch.bfloat16)[offset:offset + 70_000]
                for fmt in (Fp8Format.E4M3, Fp8Format.E5M2):
                    scale = torch.tensor([fmt.fp8_max / 200.0], device="cuda")
                    q = quantize(x, scale, fmt).view(torch.uint8)
                    for fp8_bytes in (q, None):
                        out = torch.zeros(2, dtype=torch.int64, device="cuda")
                        counts.count_cast_into(out, x, scale=scale, scale_inv=torch.reciprocal(scale), fmt=fmt,
                                               fp8_bytes=fp8_bytes)
                        got.append(out.tolist())
                        want = count_from_cast(x, q, torch.reciprocal(scale).reshape(()), fmt).tolist()
                        assert out.tolist() == want, (fast, offset, fmt, fp8_bytes is None)
            results[fast] = got
        finally:
            counts._LAUNCH.fast = True
    assert results[True] == results[False]
    assert counts._PLANS and counts._LAUNCH.cached >= 2 and counts._LAUNCH.direct
