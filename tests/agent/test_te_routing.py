"""TE's debug calls routed through the real nvdlfw-inspect, with the routing keys fp8guard sets in
a debug session it opened; and forward casts TE hands over again inside a backward.

TE's namespace API and its debug quantizers' calls are copied from TE 2.20.2
(``bench/_te_namespace.py``): TE cannot be imported without CUDA. The GPU runs in docs/gpu.md use
TE's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nvdlfw_inspect")

from bench import te_routing  # noqa: E402
from bench._te_namespace import layer_names, run_iteration  # noqa: E402
from fp8guard.agent.fp8 import Fp8Format, quantize  # noqa: E402
from fp8guard.agent.sources import te_counts, te_inspect  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def session() -> Iterator[Any]:
    """Opens a debug session as bench/te_routing.py does; closes it and forgets the counter; and
    fails a test that left nvdlfw-inspect changed (its ``log_message``, a bound namespace)."""
    import nvdlfw_inspect.api as debug_api

    real_log = debug_api.log_message
    yield lambda way, layers=2: te_routing._session(way, layers)
    if debug_api.DEBUG_MANAGER is not None:
        debug_api.end_debug()
    te_inspect._Slot.counter = None
    left = debug_api.log_message is not real_log or "transformer_engine" in vars(debug_api) or te_inspect._binding is not None
    debug_api.log_message = real_log
    vars(debug_api).pop("transformer_engine", None)
    assert not left, "the test left nvdlfw-inspect changed"


def _schedule(debug_api: Any, names: list[str], iterations: list[int], stagger_from: int | None = None) -> list[Any]:
    counter = te_inspect._Slot.counter
    assert counter is not None
    counter.stagger_from = stagger_from
    counter.module_of = {n: i // 2 for i, n in enumerate(names)}
    return [run_iteration(debug_api, names, it) for it in iterations]


# counted steps, one that is not, then a rollback: the iteration goes back and forward again
ITERATIONS = [0, 10, 20, 23, 30, 40, 20, 30, 31, 40, 50]


@pytest.mark.parametrize("stagger_from", [None, 0])
def test_routes_keyed_without_the_iteration_answer_as_te_s_keys_do(session: Any, stagger_from: int | None) -> None:
    """Call by call the same answers (fp8guard's feature still gets each call's iteration: a
    staggered schedule answers differently per layer and iteration), and nvdlfw-inspect's routing
    cache and logged calls stop growing once every route was found."""
    debug_api, names = session("te_keys")
    expected = _schedule(debug_api, names, ITERATIONS, stagger_from)
    grown = te_routing._entries(debug_api)
    debug_api.end_debug()
    debug_api, names = session("fp8guard_keys")
    got = _schedule(debug_api, names, ITERATIONS[:3], stagger_from)
    held = te_routing._entries(debug_api)
    got += _schedule(debug_api, names, ITERATIONS[3:], stagger_from)
    assert got == expected
    assert any(a == (True, 20) for it in got for a in it)  # fp8guard's own answers are in there
    if stagger_from is not None:
        assert len({json.dumps(it) for it in got}) > 3  # answers differ from iteration to iteration
    assert te_routing._entries(debug_api) == held  # nothing new after the first iterations
    assert grown["routing_cache"] > 3 * held["routing_cache"]  # TE's keys: entries for every iteration


def test_te_s_keys_come_back_when_asked(session: Any) -> None:
    """``on=False`` (the GPU bench's ``counts_every_step_te_routes`` mode) puts TE's own keys back;
    on again, fp8guard's."""
    from bench._te_namespace import CACHE_KEYS

    debug_api, _ = session("fp8guard_keys")
    api = debug_api.DEBUG_MANAGER._namespace_apis["transformer_engine"]
    assert api._cacheable_api_kwargs_map["inspect_tensor_enabled"] == ["tensor_name"]
    assert te_inspect.cache_routes_across_iterations(False)
    assert api._cacheable_api_kwargs_map == CACHE_KEYS
    assert te_inspect.cache_routes_across_iterations(True)
    assert api._cacheable_api_kwargs_map == {**{k: [a for a in v if a != "iteration"] for k, v in CACHE_KEYS.items()},
                                             "fp8_gemm_enabled": ["gemm"]}


def test_no_session_or_another_shape_changes_nothing(session: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import nvdlfw_inspect.api as debug_api

    monkeypatch.setattr(debug_api, "DEBUG_MANAGER", None)
    assert te_inspect.cache_routes_across_iterations() is False
    monkeypatch.setattr(debug_api, "DEBUG_MANAGER", SimpleNamespace(_namespace_apis={"transformer_engine": object()}))
    assert te_inspect.cache_routes_across_iterations() is False


@pytest.mark.parametrize("way", ["fp8guard_direct", "fp8guard_bound"])
@pytest.mark.parametrize("stagger_from", [None, 0])
def test_direct_answers_are_the_routed_answers_without_routing(session: Any, stagger_from: int | None,
                                                               way: str) -> None:
    """In a session fp8guard opened, fp8guard answers TE's debug questions itself: call by call
    what nvdlfw-inspect's routing answers (TE's keys), and nothing routed, so nothing cached."""
    debug_api, names = session("te_keys")
    expected = _schedule(debug_api, names, ITERATIONS, stagger_from)
    debug_api.end_debug()
    debug_api, names = session(way)
    got = _schedule(debug_api, names, ITERATIONS, stagger_from)
    assert got == expected
    assert any(a == (True, 20) for it in got for a in it)
    assert te_routing._entries(debug_api) == {"routing_cache": 0, "logged_calls": 0}
    assert te_inspect.bind_namespace(False) and te_inspect.answer_directly(False)  # the bench's _routed modes
    assert _schedule(debug_api, names, ITERATIONS, stagger_from) == expected
    assert te_routing._entries(debug_api)["routing_cache"] > 0


@pytest.mark.parametrize("direct", [True, False])
def test_te_s_inspect_call_counts_the_same_answered_directly_or_routed(session: Any, direct: bool) -> None:
    """TE's ``inspect_tensor`` call, with TE's arguments, counts the cast either way; what
    fp8guard's feature is not routed (an output) counts nothing; an error inside switches
    counting off and never reaches training."""
    debug_api, names = session("fp8guard_keys")
    te_inspect.answer_directly(direct)
    counter = te_inspect._Slot.counter
    assert counter is not None
    counter.every = 0  # armed: every iteration counts
    x = torch.tensor([100.0, 1e-9, 1.0, -100.0, 0.0])  # 2 overflows, 1 underflow
    args = {"layer_name": names[0], "tp_group": None, "tp_size": 1, "columnwise_quantized_tensor": None,
            "quantizer": SimpleNamespace(), "iteration": 3}
    debug_api.transformer_engine.inspect_tensor(tensor=x, rowwise_quantized_tensor=_cast(x), tensor_name="activation",
                                                **args)
    debug_api.transformer_engine.inspect_tensor(tensor=x, rowwise_quantized_tensor=_cast(x), tensor_name="output",
                                                **args)
    assert counter.counts.sum(dim=0).tolist() == [2, 1] and counter.calls == 1
    broken = SimpleNamespace(_data=torch.zeros(5, dtype=torch.int32), _scale_inv=torch.ones(1))
    debug_api.transformer_engine.inspect_tensor(tensor=x, rowwise_quantized_tensor=broken, tensor_name="weight",
                                                **args)
    assert counter.active is False
    assert debug_api.transformer_engine.inspect_tensor_enabled(layer_name=names[0], tensor_name="activation",
                                                               iteration=4) == (False, None)


def _written(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """What nvdlfw-inspect's logger is given to write (after its once-per-call-site filter)."""
    from nvdlfw_inspect.logging import get_logger

    written: list[tuple[str, int]] = []
    monkeypatch.setattr(get_logger(), "log_message", lambda message, **kw: written.append((message, kw["level"])))
    return written


def test_the_bound_namespace_and_quiet_log_end_with_fp8guard_s_session(session: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``bind_namespace`` makes ``debug_api.transformer_engine`` the session's namespace API object
    (no module ``__getattr__``) and drops messages under WARNING; warnings and errors are written
    as nvdlfw-inspect writes them (once per call site, each site its own); the session's close, or
    ``on=False``, puts nvdlfw-inspect back as it was, so no later session sees either."""
    import logging
    import uuid

    real_log = debug_api_module().log_message
    debug_api, _ = session("fp8guard_bound")
    manager = debug_api.DEBUG_MANAGER
    api = manager._namespace_apis["transformer_engine"]
    assert debug_api.__dict__["transformer_engine"] is api
    written = _written(monkeypatch)
    layer = f"l{uuid.uuid4().hex}"  # nvdlfw-inspect remembers what it wrote for the process
    debug_api.log_message("Tensor: activation, gemm fprop - FP8 Quantize", layer_name=layer,
                          extra_cachable_args=("fprop", "activation"))
    debug_api.log_message("a first warning", layer_name=layer, level=logging.WARNING)
    debug_api.log_message("another warning", layer_name=layer, level=logging.WARNING)
    debug_api.log_message("an error", layer_name=layer, level=logging.ERROR)
    assert [(m.split(": ", 1)[1], lv) for m, lv in written] == [
        ("a first warning", logging.WARNING), ("another warning", logging.WARNING), ("an error", logging.ERROR)]
    assert te_inspect.bind_namespace(False)
    assert "transformer_engine" not in debug_api.__dict__ and debug_api.log_message is real_log
    assert debug_api.transformer_engine is api  # through nvdlfw-inspect's __getattr__ again
    assert te_inspect.bind_namespace() and te_inspect.bind_namespace()  # twice: bound once, undone once
    debug_api.end_debug()
    assert "transformer_engine" not in debug_api.__dict__ and debug_api.log_message is real_log
    assert "close" not in vars(manager) and te_inspect._binding is None
    with pytest.raises(RuntimeError, match="not initialized"):
        _ = debug_api.transformer_engine


def test_a_quiet_log_left_behind_passes_every_message_on(session: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of the quiet ``log_message`` that outlives its binding (here: a stub put in while
    bound, whose undo puts the quiet one back after the session closed) behaves as
    nvdlfw-inspect's own: no message is dropped, and with no session it raises."""
    import logging

    real_log = debug_api_module().log_message
    debug_api, names = session("fp8guard_bound")
    quiet = debug_api.log_message
    assert quiet is not real_log
    with monkeypatch.context() as m:
        m.setattr(debug_api, "log_message", lambda *a, **k: None)
        debug_api.end_debug()
    assert debug_api.log_message is quiet  # left behind by the stub's undo
    with pytest.raises(RuntimeError, match="not initialized"):
        quiet("an informational message", level=logging.INFO)
    debug_api, names = session("fp8guard_keys")  # a session fp8guard did not bind
    written = _written(monkeypatch)
    quiet("an informational message", layer_name=names[0], level=logging.INFO)
    quiet("a warning from here", layer_name=names[0], level=logging.WARNING)
    quiet("a warning from there", layer_name=names[0], level=logging.WARNING)  # another call site
    assert [lv for _, lv in written] == [logging.INFO, logging.WARNING, logging.WARNING]
    debug_api.log_message = real_log


def test_a_log_message_replaced_while_bound_is_what_comes_back(session: Any) -> None:
    """Whatever replaced fp8guard's ``log_message`` while bound counts as the one to put back:
    binding again and closing leave it, and never bring back what was there before."""
    real_log = debug_api_module().log_message

    def stub(*a: Any, **k: Any) -> None:
        return None

    debug_api_module().log_message = stub  # someone's, before the session
    try:
        debug_api, _ = session("fp8guard_bound")
        debug_api.log_message = real_log  # its owner puts nvdlfw-inspect's back, while bound
        assert te_inspect.bind_namespace()  # bound again (the GPU bench's mode switches do this)
        debug_api.end_debug()
        assert debug_api.log_message is real_log
    finally:
        debug_api_module().log_message = real_log


def test_attach_opens_a_session_that_answers_directly_and_binds(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """The session ``attach`` opens (TE's debug modules stood in for: TE needs CUDA) has
    fp8guard's routing keys, its direct answers and the bound namespace."""
    import nvdlfw_inspect.api as debug_api

    from bench import _te_namespace

    if debug_api.DEBUG_MANAGER is not None:
        debug_api.end_debug()
    real_log = debug_api.log_message
    _te_namespace.install()
    import types

    state = SimpleNamespace(debug_enabled=False)
    names = ["transformer_engine", "transformer_engine.debug", "transformer_engine.debug.pytorch",
             "transformer_engine.debug.pytorch.debug_state", "transformer_engine.debug.features"]
    modules = {n: types.ModuleType(n) for n in names}
    modules["transformer_engine.debug.pytorch.debug_state"].TEDebugState = state  # type: ignore[attr-defined]
    modules["transformer_engine.debug.features"].__file__ = str(tmp_path / "__init__.py")  # no TE features here
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    monkeypatch.setattr(te_inspect._Slot, "owned_session", False)
    monkeypatch.setattr(te_inspect._Slot, "counter", None)
    counter = te_counts.InspectCounts({("l0", "activation"): (0, Fp8Format.E4M3)}, torch.zeros(1, 2, dtype=torch.int64))
    te_inspect.attach(counter)
    try:
        api = debug_api.DEBUG_MANAGER._namespace_apis["transformer_engine"]
        assert counter.owning and te_inspect._Slot.owned_session and state.debug_enabled
        assert {k: vars(api)[k] for k in te_inspect.DIRECT_ANSWERS} == te_inspect.DIRECT_ANSWERS
        assert debug_api.__dict__["transformer_engine"] is api
        assert api._cacheable_api_kwargs_map["inspect_tensor_enabled"] == ["tensor_name"]
    finally:
        debug_api.end_debug()
    assert "transformer_engine" not in debug_api.__dict__ and debug_api.log_message is real_log


def debug_api_module() -> Any:
    import nvdlfw_inspect.api as debug_api

    return debug_api


def test_no_session_or_another_shape_answers_nothing_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    import nvdlfw_inspect.api as debug_api

    monkeypatch.setattr(debug_api, "DEBUG_MANAGER", None)
    assert te_inspect.answer_directly() is False and te_inspect.bind_namespace() is False
    monkeypatch.setattr(debug_api, "DEBUG_MANAGER", SimpleNamespace(_namespace_apis={"transformer_engine": object()}))
    assert te_inspect.answer_directly() is False
    assert te_inspect.bind_namespace() is False  # a manager that cannot close: nothing bound
    assert "transformer_engine" not in debug_api.__dict__ and te_inspect._binding is None


class _Twice(torch.autograd.Function):
    """Hands the counter an activation in its forward, and in its backward the same activation
    again (a recompute) and a gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counter: Any) -> torch.Tensor:
        ctx.counter = counter
        ctx.save_for_backward(x)
        counter.inspect("layer0.qkv", "activation", x, _cast(x), SimpleNamespace(), 0)
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        ctx.counter.inspect("layer0.qkv", "activation", x, _cast(x), SimpleNamespace(), 0)  # recomputed
        ctx.counter.inspect("layer0.qkv", "gradient", g, _cast(g), SimpleNamespace(), 0)
        return g * 2, None


def _cast(x: torch.Tensor) -> SimpleNamespace:
    scale = torch.tensor([Fp8Format.E4M3.fp8_max / 4.0])
    return SimpleNamespace(_data=quantize(x.detach(), scale[0], Fp8Format.E4M3).view(torch.uint8),
                           _scale_inv=torch.reciprocal(scale), _fp8_dtype="E4M3")


def test_a_forward_cast_handed_over_again_inside_a_backward_is_not_counted_twice() -> None:
    targets = {("layer0.qkv", "activation"): (0, Fp8Format.E4M3), ("layer0.qkv", "gradient"): (1, Fp8Format.E4M3)}
    counter = te_counts.InspectCounts(targets, torch.zeros(2, 2, dtype=torch.int64))
    counter.armed = True
    x = torch.tensor([100.0, 1e-9, 1.0, -100.0], requires_grad=True)  # 2 overflows, 1 underflow
    _Twice.apply(x, counter).mul(torch.tensor([1e-9, 1.0, 1.0, 100.0])).sum().backward()
    assert counter.counts[0].tolist() == [2, 1]  # once, from the forward
    assert counter.counts[1].tolist() == [1, 1]  # the gradient, counted inside the backward
    assert counter.calls == 2 and counter.repeats == 1


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_s_recompute_is_not_counted_again(reentrant: bool) -> None:
    """torch's checkpoint runs the forward again inside the backward: the activation it hands over
    there is not counted a second time (reentrant and not)."""
    from torch.utils.checkpoint import checkpoint

    targets = {("layer0.qkv", "activation"): (0, Fp8Format.E4M3)}
    counter = te_counts.InspectCounts(targets, torch.zeros(1, 2, dtype=torch.int64))
    counter.armed = True

    def block(x: torch.Tensor) -> torch.Tensor:
        counter.inspect("layer0.qkv", "activation", x, _cast(x), SimpleNamespace(), 0)
        return x.sin() * 2  # saves x: the backward needs it, so the forward runs again

    x = torch.tensor([100.0, 1e-9, 1.0, -100.0], requires_grad=True)
    checkpoint(block, x, use_reentrant=reentrant).sum().backward()
    assert counter.counts[0].tolist() == [2, 1] and counter.calls == 1 and counter.repeats == 1


@pytest.mark.slow
def test_routing_bench_runs_on_the_cpu(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "bench/te_routing.py", "--layers", "2", "--iterations", "20", "--rounds",
                           "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "te_routing.json").read_text())
    assert result["same_answers"] and result["answers_to_count"] > 0
    assert result["routed_calls_per_iteration"] == 8 * 27 and result["log_messages_per_iteration"] == 8 * 6
    assert result["entries_after"]["fp8guard_keys"]["routing_cache"] < result["entries_after"]["te_keys"]["routing_cache"]
    assert result["entries_after"]["fp8guard_direct"]["routing_cache"] == 0
    assert result["entries_after"]["fp8guard_bound"]["routing_cache"] == 0
    assert result["host_ms_loop_floor_median"] > 0
    assert result["held_kb_per_counted_iteration"]["te_keys"] > 10 * result["held_kb_per_counted_iteration"]["fp8guard_keys"]


def test_layer_names_follow_te_s_transformer_layer() -> None:
    assert layer_names(1) == ["layers.0.self_attention.layernorm_qkv", "layers.0.self_attention.proj",
                              "layers.0.layernorm_mlp.fc1", "layers.0.layernorm_mlp.fc2"]
