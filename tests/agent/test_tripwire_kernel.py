"""The tripwire's check as one Triton launch, against its torch ops bit for bit.

Under Triton's CPU interpreter (a fresh process: ``TRITON_INTERPRET=1`` is read when Triton is
imported) both paths run side by side over random runs (tests/agent/tripwire_sequences.py): the
state (checks counted, baselines, early references and runs), the verdict word and the host
verdict must be identical at every step. The same on CUDA, compiled. And the check's cost in
launches: one kernel launch and the verdict's host copy, against some forty torch ops.
"""

from __future__ import annotations

import textwrap

import pytest

torch = pytest.importorskip("torch")

from fp8guard.agent import MonitorConfig  # noqa: E402
from fp8guard.agent.errors import ConfigError  # noqa: E402
from fp8guard.agent.tripwire import Tripwire  # noqa: E402
from tests.agent import tripwire_sequences  # noqa: E402
from tests.agent.interpreted import run_interpreted  # noqa: E402

_ARGS = {"loss_factor": 1.3, "grad_factor": 5.0, "saturation": 8.0, "warmup_steps": 5}

_COMPARE = textwrap.dedent("""
    import json, sys, torch
    from tests.agent import tripwire_sequences
    seeds = range(int(sys.argv[1]), int(sys.argv[2]))
    print(json.dumps([tripwire_sequences.run(seed, torch.device("cpu")) for seed in seeds]))
""")


def _compare(first: int, last: int) -> list[dict[str, object]]:
    code = f"import sys; sys.argv = ['-', '{first}', '{last}']\n" + _COMPARE
    runs: list[dict[str, object]] = run_interpreted(code, timeout=900)
    return runs


def _tally(runs: list[dict[str, object]]) -> dict[str, int]:
    keys = runs[0]["tally"].keys()  # type: ignore[attr-defined]
    return {k: sum(r["tally"][k] for r in runs) for k in keys}  # type: ignore[index]


@pytest.mark.slow
def test_kernel_equals_torch_ops_bit_for_bit_over_many_random_runs_under_the_interpreter() -> None:
    """60 runs of 40 steps: every trip kind, missing inputs, NaN and inf, the early bounds."""
    runs = _compare(0, 60)
    bad = [r["mismatch"] for r in runs if r["mismatch"]]
    assert not bad, bad[:2]
    tally = _tally(runs)
    # the runs exercised what they are meant to (counts of steps)
    assert tally["shared"] > 100 and tally["local"] > 100 and tally["saturation"] > 50, tally
    assert tally["early"] > 20 and tally["missing"] > 100, tally
    assert 0 < tally["fallback"] < tally["steps"] // 2, tally  # float64 losses: the torch ops, same state


_LAUNCHES = textwrap.dedent("""
    import json, math, torch
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    from fp8guard.agent.kernels import tripwire_check
    from fp8guard.agent.tripwire import Tripwire

    launches = [0]
    real = tripwire_check._kernel()

    class Counted:  # the real kernel, launched as it is; each launch counted, the interpreter's
        def __getitem__(self, grid):  # own tensor copies (its stand-in for device memory) not
            launches[0] += 1
            run = real[grid]

            def launch(*args, **kwargs):
                with _disable_current_modes():
                    return run(*args, **kwargs)

            return launch

    tripwire_check._kernel = lambda: Counted()

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    result = {}
    for backend in ("triton", "torch"):
        for what in ("all", "no_loss", "no_norm", "nothing"):
            w = Tripwire(torch.device("cpu"), loss_factor=1.3, grad_factor=5.0, saturation=8.0, warmup_steps=2,
                         backend=backend)
            loss, norm, sat = torch.tensor(3.0), torch.tensor(1.0), torch.full((300,), 2.0)
            per_step = []
            for step in range(4):
                launches[0] = 0
                with Ops() as ops:
                    w.check(step, loss=None if what == "no_loss" else loss, grad_norm=None if what == "no_norm" else norm,
                            saturation=sat if what != "nothing" else None)
                per_step.append({"ops": ops.ops, "launches": launches[0]})
            result[f"{backend}/{what}"] = per_step
    tripwire_check._kernel = lambda: real
    from tests.agent import tripwire_sequences
    result["runs"] = [tripwire_sequences.run(seed, torch.device("cpu")) for seed in range(4)]
    print(json.dumps(result))
""")


def test_the_check_is_one_launch_and_the_verdict_copy() -> None:
    """Under the interpreter: per check, one Triton launch and one torch op (the non-blocking copy
    of the verdict to its host word), whatever is passed; the torch path dispatches ~40 ops. And
    a few random runs (one process for both: the interpreter's start is most of the time) with
    the kernel's state and verdicts equal to the torch ops' at every step."""
    got = run_interpreted(_LAUNCHES, timeout=600)
    runs = got["runs"]
    assert [r["mismatch"] for r in runs] == [None] * 4, next(r["mismatch"] for r in runs if r["mismatch"])
    tally = _tally(runs)
    assert tally["shared"] and tally["local"] and tally["steps"] > tally["fallback"], tally
    for what in ("all", "no_loss", "no_norm", "nothing"):
        steps = got[f"triton/{what}"]
        assert all(s == {"ops": ["aten.copy_.default"], "launches": 1} for s in steps), (what, steps)
    torch_ops = [len(s["ops"]) for s in got["torch/all"]]
    assert all(s["launches"] == 0 for s in got["torch/all"])
    assert min(torch_ops) > 30, torch_ops


def test_backend_choice() -> None:
    """``auto`` takes the kernel only on CUDA with Triton (never on the CPU: this process is not
    interpreting); ``triton`` without it is an error, not a silent fallback."""
    assert Tripwire(torch.device("cpu"), **_ARGS).backend == "torch"  # type: ignore[arg-type]
    assert Tripwire(torch.device("cpu"), backend="torch", **_ARGS).backend == "torch"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs Triton"):
        Tripwire(torch.device("cpu"), backend="triton", **_ARGS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend"):
        Tripwire(torch.device("cpu"), backend="numpy", **_ARGS)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tripwire_backend"):
        MonitorConfig(tripwire_backend="numpy")
    if torch.cuda.is_available():
        from fp8guard.agent.kernels import triton_available

        expected = "triton" if triton_available(torch.device("cuda")) else "torch"
        assert Tripwire(torch.device("cuda"), **_ARGS).backend == expected  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_equals_torch_ops_bit_for_bit_on_cuda() -> None:
    """The compiled kernel (fused multiply-adds off) against the torch ops' CUDA kernels."""
    from fp8guard.agent.kernels import triton_available

    if not triton_available(torch.device("cuda")):
        pytest.skip("needs Triton on the GPU")
    runs = [tripwire_sequences.run(seed, torch.device("cuda")) for seed in range(60)]
    bad = [r["mismatch"] for r in runs if r["mismatch"]]
    assert not bad, bad[:2]
    assert _tally(runs)["steps"] > _tally(runs)["fallback"]
