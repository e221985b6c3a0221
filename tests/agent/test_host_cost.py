"""The monitor's per-step host work does not grow with model depth: a CPU proxy.

On a GPU, ``Monitor.step``'s host cost is its kernel launches plus its Python. Timing is for
bench/gpu_host_cost.py; here the two are counted, at 2, 4 and 8 layers: the device ops it
dispatches that are not views (each would be at least one kernel launch on a GPU; a view is
host-only metadata) and, over the TE source, the Python and C function calls it makes, at 4 and
32 layers. Over the TE stand-in (tests/fake_te.py, through the source's seam) and over
fp8guard's emulated FP8. Under Triton's CPU interpreter (``TRITON_INTERPRET=1``, a fresh
process) the same for the GPU's own paths: the table grad norm and the TE read as Triton
launches over device tables, counted with the torch ops; and their values against the torch
paths. The gradient norm's foreach path keeps its value bit for bit.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from fp8guard.agent import Monitor, MonitorConfig, NullTransport, emulate_fp8  # noqa: E402
from fp8guard.agent.sources import te_access  # noqa: E402
from fp8guard.agent.telemetry import GradNorm  # noqa: E402
from fp8guard.nanogpt import GPT, GPTConfig  # noqa: E402
from tests import fake_te  # noqa: E402
from tests.agent.interpreted import run_interpreted  # noqa: E402


class _Launches(TorchDispatchMode):
    """Counts the non-view device ops dispatched inside."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _per_step(monitor: Monitor, forward_backward: Callable[[], Any], opt: Any, steps: int = 3) -> tuple[list[str], int]:
    """(ops dispatched, Python/C calls made) by the last of ``steps`` monitor.step calls."""
    ops: list[str] = []
    calls = 0
    counter = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            counter[0] += 1

    for _ in range(steps):
        loss = forward_backward()
        counter[0] = 0
        with _Launches() as launches:
            sys.setprofile(profile)
            try:
                monitor.step(loss)
            finally:
                sys.setprofile(None)
        ops, calls = launches.ops, counter[0]
        opt.step()
        opt.zero_grad()
    assert not monitor._broken
    monitor.close()
    return ops, calls


def _config(**kw: Any) -> MonitorConfig:
    # no flush, no counting, no probe during the counted steps: the every-step path only
    return MonitorConfig(flush_interval_steps=1000, flush_interval_s=1e6, count_interval_steps=0,
                         harm_interval_steps=0, **kw)


def _te_step_cost(layers: int, recipe: Any, norm: str = "auto", tripwire: str = "auto") -> tuple[list[str], int]:
    fake_te.reset()
    with te_access.substitute(fake_te):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[fake_te.TransformerLayer(16, 32) for _ in range(layers)])
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def forward_backward() -> Any:
            with fake_te.autocast(enabled=True, recipe=recipe):
                loss = model(torch.randn(4, 16)).pow(2).mean()
            loss.backward()
            return loss

        forward_backward()
        opt.zero_grad()
        monitor = Monitor(_config(sources=["te"], tripwire_backend=tripwire), transport=NullTransport()).attach(model, opt)
        assert monitor._tripwire is not None
        if norm != "auto":  # the CUDA default ("table") where the interpreter runs Triton on the CPU
            monitor._grad_norm = GradNorm(model.parameters(), backend=norm)
        assert len(monitor.tensors) >= 6 * layers
        return _per_step(monitor, forward_backward, opt)


@pytest.mark.parametrize("recipe", [fake_te.DelayedScaling(amax_history_len=8), fake_te.DelayedScaling(amax_history_len=1),
                                    fake_te.Float8CurrentScaling()], ids=["delayed", "delayed_len1", "current"])
def test_te_source_step_op_and_call_counts_are_independent_of_depth(recipe: Any) -> None:
    """Dispatched ops and Python calls, over the TE stand-in on the CPU: a guard against per-layer
    Python creeping into the step. Not the GPU's launch count (a foreach op launches per chunk) nor
    its host time, which still grows with depth on the H200 (docs/gpu.md)."""
    costs = {layers: _te_step_cost(layers, recipe) for layers in (4, 32)}
    ops = {layers: c[0] for layers, c in costs.items()}
    calls = {layers: c[1] for layers, c in costs.items()}
    assert ops[4] == ops[32], {k: len(v) for k, v in ops.items()}
    assert ops[4].count("aten._foreach_norm.Scalar") == 1
    assert calls[4] == calls[32], calls


def test_emulated_fp8_step_launches_are_independent_of_depth() -> None:
    def cost(layers: int) -> list[str]:
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=16, n_layer=layers, n_head=2, n_embd=16))
        fp8 = emulate_fp8(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randint(0, 50, (2, 16))

        def forward_backward() -> Any:
            _, loss = model(x, x)
            loss.backward()
            fp8.update()
            return loss

        monitor = Monitor(_config(), transport=NullTransport()).attach(model, opt)
        return _per_step(monitor, forward_backward, opt)[0]

    ops = {layers: cost(layers) for layers in (2, 4, 8)}
    assert ops[2] == ops[4] == ops[8], {k: len(v) for k, v in ops.items()}


def _reference_norm(grads: list[Any]) -> Any:
    """The monitor's grad norm before the depth-independent rewrite (its CPU path), verbatim."""
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.float32, torch.bfloat16, torch.float16)],
                         ids=["one_group", "three_groups"])
def test_grad_norm_is_bitwise_the_previous_value(dtypes: tuple[Any, ...]) -> None:
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(17 + i, generator=gen).to(dtypes[i % len(dtypes)]) * 10 ** (i % 5 - 2))
              for i in range(23)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype) * p.detach()
    norm = GradNorm(params)
    got = norm()
    assert got is not None and got.dtype == torch.float32
    assert torch.equal(got, _reference_norm([p.grad for p in params]))
    for i in (0, 5, 6, 22):  # parameters without a gradient this step
        params[i].grad = None
    assert torch.equal(norm(), _reference_norm([p.grad for p in params if p.grad is not None]))
    for p in params:
        p.grad = None
    assert norm() is None


_INTERPRETED = textwrap.dedent("""
    import collections, json, sys, torch
    from fp8guard.agent import kernels
    from fp8guard.agent.kernels import history_gather, table_norm, tripwire_check
    from fp8guard.agent.sources import te_access
    from fp8guard.agent.sources.base import AMAX, HISTORY_MAX, SCALE, STATS
    from tests import fake_te
    from tests.agent import test_host_cost as h

    assert kernels.triton_available(torch.device("cpu"))
    launches = collections.Counter()
    real = (table_norm._kernel(), history_gather._kernel(), tripwire_check._kernel())

    class Counted:  # the real kernel, launched as it is; each launch counted
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launches[self.name] += 1
            return self.kernel[grid]

    counted = (Counted("table_sumsq", real[0]), Counted("history_gather", real[1]),
               Counted("tripwire_check", real[2]))
    table_norm._kernel = lambda: counted[0]
    history_gather._kernel = lambda: counted[1]
    tripwire_check._kernel = lambda: counted[2]
    result = {}
    for layers in (4, 32):
        launches.clear()
        ops, calls = h._te_step_cost(layers, fake_te.DelayedScaling(amax_history_len=8), norm="table",
                                     tripwire="triton")
        result[layers] = {"ops": ops, "launches": dict(launches)}

    # the table read against the torch read, over the same TE state: lengths 8 and 1, a NaN row,
    # a module in BF16 fallback
    values = []
    for length in (8, 1):
        fake_te.reset()
        with te_access.substitute(fake_te):
            from fp8guard.agent.sources import te
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[fake_te.TransformerLayer(16, 32, name=f"l{i}") for i in range(3)])
            recipe = fake_te.DelayedScaling(amax_history_len=length)

            def train(k):
                with fake_te.autocast(enabled=True, recipe=recipe):
                    loss = model(torch.randn(4, 16, generator=torch.Generator().manual_seed(k)) * (k + 1)).pow(2).mean()
                loss.backward()

            train(0)
            table, plain = te.discover(model, required=True), te.discover(model, required=True)
            assert table._delayed._table is not None
            plain._delayed._table = None  # this one reads through the torch ops
            table.set_fp8(["1.layernorm_mlp"], False)
            plain.set_fp8(["1.layernorm_mlp"], False)
            for k in range(1, 4):
                train(k)
                if k == 2 and length > 1:
                    model[0].self_attention.proj.fp8_meta["scaling_fwd"].amax_history[1, 0] = float("nan")
                outs = []
                for src in (table, plain):
                    out = torch.full((len(STATS), len(src.tensors())), -7.0)
                    src.read(out)
                    outs.append(out)
                rows = [AMAX, SCALE, HISTORY_MAX]
                values.append({"length": length, "equal": bool(torch.equal(outs[0][rows].nan_to_num(-1.0),
                                                                            outs[1][rows].nan_to_num(-1.0))),
                               "nans": int(outs[0][rows].isnan().sum()), "nans_plain": int(outs[1][rows].isnan().sum()),
                               "zeros": int((outs[0][AMAX] == 0).sum())})
    result["values"] = values
    print(json.dumps(result))
""")


@pytest.mark.slow
def test_gpu_paths_launch_a_fixed_number_of_kernels_under_the_interpreter() -> None:
    """The CUDA path of monitor.step (table grad norm, TE read through HistoryGather, the
    tripwire's one-launch check) run by Triton's CPU interpreter: at 4 and 32 fake TE layers the
    same torch ops and the same Triton launches (one sum-of-squares launch, one history gather,
    one tripwire check), and the gather's values equal the torch read's, NaN and BF16 fallback
    included."""
    got = run_interpreted(_INTERPRETED, timeout=900)
    shallow, deep = got["4"], got["32"]
    assert shallow["ops"] == deep["ops"], (len(shallow["ops"]), len(deep["ops"]))
    # three steps: one sum-of-squares launch, one history gather and one tripwire check each
    assert shallow["launches"] == deep["launches"] == {"table_sumsq": 3, "history_gather": 3, "tripwire_check": 3}
    assert "aten._foreach_norm.Scalar" not in shallow["ops"] and "aten.cat.default" not in shallow["ops"]
    assert all(v["equal"] for v in got["values"]), got["values"]
    assert any(v["nans"] > 0 and v["nans"] == v["nans_plain"] for v in got["values"])  # the NaN row went through
    assert all(v["zeros"] > 0 for v in got["values"])  # the module in fallback reads 0
