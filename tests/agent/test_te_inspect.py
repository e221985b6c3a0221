"""The exact-count feature for TE's tensor-inspection API, on the CPU.

nvdlfw-inspect (pure Python) is real here; Transformer Engine is not importable without CUDA, so
the quantized tensor TE would hand to ``inspect_tensor`` is stood in for by an object with the
same three attributes (``_data``, ``_scale_inv``, ``_fp8_dtype``). The GPU run in docs/gpu.md
checks the whole path against TE's own LogFp8TensorStats on a 604M-parameter model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nvdlfw_inspect")

from fp8guard.agent.fp8 import Fp8Format, count_overflow_underflow, quantize  # noqa: E402
from fp8guard.agent.sources import te_counts, te_inspect  # noqa: E402


def _counter() -> te_counts.InspectCounts:
    targets = {("layer0.qkv", "activation"): (0, Fp8Format.E4M3), ("layer0.mlp.fc2", "gradient"): (1, Fp8Format.E5M2)}
    return te_counts.InspectCounts(targets, torch.zeros(2, 2, dtype=torch.int64))


def test_schedule_owning_session_predicts_the_next_counted_step() -> None:
    c = _counter()
    c.owning, c.every = True, 10
    assert c.enabled(20, "layer0.qkv", "activation") == (False, 30)
    c.armed = True
    assert c.enabled(30, "layer0.qkv", "activation") == (True, 40)
    assert c.enabled(30, "layer9.other", "activation") == (False, None)  # not ours: never
    c.every = 0
    assert c.enabled(31, "layer0.qkv", "activation") == (True, 32)
    c.armed = False
    assert c.enabled(31, "layer0.qkv", "activation") == (False, None)
    c.active = False
    assert c.enabled(40, "layer0.qkv", "activation") == (False, None)


def test_layers_in_high_precision_are_never_counted_but_asked_again_on_schedule() -> None:
    c = _counter()
    c.owning, c.every, c.armed = True, 10, True
    c.high_precision = frozenset({"layer0.qkv"})
    assert c.enabled(30, "layer0.qkv", "activation") == (False, 40)  # asked again: it may be promoted
    assert c.enabled(30, "layer0.mlp.fc2", "gradient") == (True, 40)
    c.owning = False
    assert c.enabled(31, "layer0.qkv", "activation") == (False, 32)
    c.high_precision = frozenset()
    assert c.enabled(32, "layer0.qkv", "activation") == (True, 33)


def test_schedule_joined_session_asks_every_iteration() -> None:
    c = _counter()
    c.owning, c.every, c.armed = False, 10, True
    assert c.enabled(7, "layer0.qkv", "activation") == (True, 8)


def _te_modules_ask(c: te_counts.InspectCounts, modules: dict[str, list[str]], steps: range,
                    asks: dict[str, int] | None = None) -> dict[int, set[str]]:
    """What TE 2.20.2 does with the answers (``is_debug_iter``): a module asks at the first forward
    of an iteration at or after the next iteration its features named, and runs its debug path
    (every layer of it) when one of them is enabled. Returns step -> layers counted; ``asks``
    gets how many times each module asked."""
    asks = {} if asks is None else asks
    next_ask = {m: 0 for m in modules}
    counted: dict[int, set[str]] = {}
    for it in steps:
        for m, layers in modules.items():
            if next_ask[m] is None or it < next_ask[m]:
                continue
            asks[m] = asks.get(m, 0) + 1  # TE builds the module's debug quantizers to ask: the cost
            answers = [c.enabled(it, layer, "activation") for layer in layers]
            nexts = [n for _, n in answers if n is not None]
            next_ask[m] = min(nexts) if nexts else None
            for layer, (on, _) in zip(layers, answers, strict=True):
                if on:
                    counted.setdefault(it, set()).add(layer)
    return counted


@pytest.mark.parametrize(("every", "start"), [(10, 0), (10, 3), (4, 7), (1, 5), (3, 0)])
def test_staggered_schedule_counts_every_module_once_per_whole_window(every: int, start: int) -> None:
    modules = {f"m{k}": [f"m{k}.fc1", f"m{k}.fc2"] if k % 3 == 2 else [f"m{k}"] for k in range(7)}
    layers = [layer for names in modules.values() for layer in names]
    c = te_counts.InspectCounts({(layer, "activation"): (i, Fp8Format.E4M3) for i, layer in enumerate(layers)},
                                 torch.zeros(len(layers), 2, dtype=torch.int64))
    c.owning, c.every, c.stagger_from = True, every, start
    c.armed = every == 1  # one step a window: nothing to stagger, the Monitor arms every step
    c.module_of = {layer: k for k, names in enumerate(modules.values()) for layer in names}
    asks: dict[str, int] = {}
    counted = _te_modules_ask(c, modules, range(start, start + 6 * every + 3), asks)
    first = -(-(start + every - 1) // every) * every  # the first whole window's end
    ends = range(first, start + 6 * every + 3, every)
    assert len(ends) >= 5
    for end in ends:  # each module once in (end - every, end], all of its layers together
        window = [layer for it in range(end - every + 1, end + 1) for layer in sorted(counted.get(it, ()))]
        assert sorted(window) == sorted(layers), (end, window)
    assert not any(it <= first - every for it in counted)  # nothing before the first whole window
    # a module asks only when it counts (and once at the start): never on the steps between
    assert all(asks[m] <= 1 + sum(1 for layers in counted.values() if any(x.split(".")[0] == m for x in layers))
               for m in modules), asks
    per_step = [len({layer.split(".")[0] for layer in counted.get(it, ())}) for it in range(first - every + 1, first + 1)]
    assert max(per_step) <= -(-len(modules) // every)  # spread: at most ceil(modules / every) modules a step


def test_staggered_inspect_counts_only_at_the_layers_own_step() -> None:
    c = _counter()
    c.owning, c.every, c.stagger_from = True, 4, 0
    c.module_of = {"layer0.qkv": 1, "layer0.mlp.fc2": 2}
    x = torch.tensor([1e-9, 1e9])
    for it in range(4, 9):  # layer0.qkv's phase is 1: it counts at 7 only (window 5-8)
        c.inspect("layer0.qkv", "activation", x, _cast(x, 1.0, Fp8Format.E4M3), None, it)
    assert c.counts[0].tolist() == [1, 1] and c.calls == 1
    c.inspect("layer0.qkv", "activation", x, _cast(x, 1.0, Fp8Format.E4M3), None)  # no iteration: not counted
    assert c.calls == 1
    c.held = True  # a probe's forward inside the layer's own step: not the step's cast
    assert c.enabled(11, "layer0.qkv", "activation") == (False, 15)
    c.inspect("layer0.qkv", "activation", x, _cast(x, 1.0, Fp8Format.E4M3), None, 11)
    assert c.calls == 1
    c.held = False
    assert c.enabled(11, "layer0.qkv", "activation") == (True, 15)


def _cast(x: torch.Tensor, scale: float, fmt: Fp8Format) -> SimpleNamespace:
    q = quantize(x, scale, fmt)
    return SimpleNamespace(_data=q.view(torch.uint8), _scale_inv=torch.reciprocal(torch.tensor([scale])),
                           _fp8_dtype=f"DType.kFloat8{fmt.name}")


def test_inspect_counts_what_te_counts_and_only_when_armed() -> None:
    c = _counter()
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5000, generator=g) * torch.exp2(torch.randint(-30, 12, (5000,), generator=g).float())).bfloat16()
    scale = 448.0 / 200.0
    quantized = _cast(x, scale, Fp8Format.E4M3)
    quantizer = SimpleNamespace(scale=torch.tensor([scale]))
    c.inspect("layer0.qkv", "activation", x, quantized, quantizer)
    assert c.counts.sum() == 0 and c.calls == 0  # not armed
    c.armed = True
    c.inspect("layer0.qkv", "activation", x, quantized, quantizer)
    c.inspect("layer0.qkv", "activation", None, quantized, quantizer)  # FP8 primary weight: no values
    c.inspect("layer1.unknown", "activation", x, quantized, quantizer)
    c.inspect("layer0.qkv", "activation", x, SimpleNamespace(), quantizer)  # not a per-tensor FP8 cast
    ref = count_overflow_underflow(x, scale, Fp8Format.E4M3)
    assert c.counts[0].tolist() == ref.tolist() and c.calls == 1
    assert ref[0] > 0 and ref[1] > 0
    # the format comes from the cast (E5M2 gradient), not only from the column's default
    g2 = x.float() * 100
    s2 = 57344.0 / 1e5
    c.inspect("layer0.mlp.fc2", "gradient", g2, _cast(g2, s2, Fp8Format.E5M2), SimpleNamespace(scale=torch.tensor([s2])))
    assert c.counts[1].tolist() == count_overflow_underflow(g2, s2, Fp8Format.E5M2).tolist()
    # current scaling keeps no scale on the quantizer: counted from the FP8 bytes, same result
    c.counts.zero_()
    c.inspect("layer0.mlp.fc2", "gradient", g2, _cast(g2, s2, Fp8Format.E5M2), SimpleNamespace())
    assert c.counts[1].tolist() == count_overflow_underflow(g2, s2, Fp8Format.E5M2).tolist()


def test_registered_feature_routes_and_never_raises_into_training() -> None:
    from nvdlfw_inspect.registry import Registry

    had = "transformer_engine" in Registry.data
    feature_cls = te_inspect._make_feature()
    feature = feature_cls()
    cfg = {"enabled": True, "tensors": ["activation", "gradient"]}
    assert feature.parse_config_and_api(cfg, tensor_name="activation") == (True, None)
    assert feature.parse_config_and_api(cfg, tensor_name="weight") == (False, None)
    assert feature.parse_config_and_api({"enabled": False}, tensor_name="activation") == (False, None)
    c = _counter()
    c.owning, c.every, c.armed = True, 5, True
    old = te_inspect._Slot.counter
    te_inspect._Slot.counter = c
    try:
        assert feature.inspect_tensor_enabled(cfg, "layer0.qkv", "activation", 10) == (True, 15)
        # bytes that do not match the values and no scale to count from: skipped, nothing counted
        odd = SimpleNamespace(_data=torch.zeros(3, dtype=torch.uint8), _scale_inv=torch.ones(1))
        feature.inspect_tensor(cfg, "layer0.qkv", "activation", 10, None, torch.ones(4), odd, odd, SimpleNamespace())
        assert c.active and c.calls == 0
        # an internal error (here: an int tensor the kernel cannot read) switches counting off
        broken = SimpleNamespace(_data=torch.zeros(4, dtype=torch.int32), _scale_inv=torch.ones(1))
        feature.inspect_tensor(cfg, "layer0.qkv", "activation", 10, None, torch.ones(4), broken, broken,
                               SimpleNamespace())
        assert c.active is False  # switched off, logged, training goes on
        assert feature.inspect_tensor_enabled(cfg, "layer0.qkv", "activation", 11) == (False, None)
    finally:
        te_inspect._Slot.counter = old
    te_inspect.register_feature()
    te_inspect.register_feature()  # idempotent
    data = Registry.data["transformer_engine"]
    names = list(data.features) + [f.__name__ for f in data.deferred_features]
    assert names.count(te_inspect.FEATURE_NAME) == 1
    if not had:
        Registry.data.pop("transformer_engine")


def test_variant_choice_bytes_by_default_high_precision_on_request() -> None:
    """The default reads the cast's bytes; the high-precision variant reads ``x`` with the scale.
    Bytes that disagree with the values (here: all zero) tell which one ran."""
    x = torch.tensor([1e-6, 3.0, 5e-7, -2.0, 0.0]).bfloat16()
    scale = torch.tensor([1.0])
    zero_bytes = SimpleNamespace(_data=torch.zeros(5, dtype=torch.uint8), _scale_inv=torch.ones(1),
                                 _fp8_dtype="DType.kFloat8E4M3")
    hp = count_overflow_underflow(x, 1.0, Fp8Format.E4M3).tolist()  # the two tiny values underflow
    from_bytes = [0, 4]  # four nonzero values on zero bytes
    assert hp == [0, 2]
    for variant, quantizer, expected in (("auto", SimpleNamespace(scale=scale), from_bytes),
                                         ("hp", SimpleNamespace(scale=scale), hp),
                                         ("bytes", SimpleNamespace(scale=scale), from_bytes),
                                         ("hp", SimpleNamespace(), from_bytes),  # no scale: bytes anyway
                                         ("auto", SimpleNamespace(scale=torch.ones(3)), from_bytes),  # not a scale
                                         ("auto", None, from_bytes)):
        c = _counter()
        c.armed, c.variant = True, variant
        c.inspect("layer0.qkv", "activation", x, zero_bytes, quantizer)
        assert c.counts[0].tolist() == expected, (variant, quantizer)
    # neither bytes nor a scale: 1/scale_inv is not the cast's scale to the last bit, so no count
    c = _counter()
    c.armed = True
    c.inspect("layer0.qkv", "activation", x, SimpleNamespace(_scale_inv=torch.ones(1)), SimpleNamespace())
    assert c.calls == 0 and c.counts.sum() == 0


def test_format_from_the_quantizer_before_the_cast_tensor_and_the_default() -> None:
    """HYBRID casts gradients to E5M2: the quantizer's dtype decides, whatever the default says."""
    e5m2, e4m3 = SimpleNamespace(dtype="DType.kFloat8E5M2"), SimpleNamespace(dtype="DType.kFloat8E4M3")
    bare = SimpleNamespace()
    assert te_counts._format_of(bare, Fp8Format.E4M3, e5m2) is Fp8Format.E5M2
    assert te_counts._format_of(SimpleNamespace(_fp8_dtype="DType.kFloat8E5M2"), Fp8Format.E4M3, e4m3) \
        is Fp8Format.E4M3
    assert te_counts._format_of(SimpleNamespace(_fp8_dtype="DType.kFloat8E5M2"), Fp8Format.E4M3) is Fp8Format.E5M2
    assert te_counts._format_of(bare, Fp8Format.E5M2, None) is Fp8Format.E5M2


def test_counts_go_to_views_of_the_current_buffer() -> None:
    """The per-operand rows are views made once per count buffer: counts land in the buffer the
    source reads, also after the buffer is replaced."""
    c = _counter()
    c.armed = True
    x = torch.tensor([0.0, 1e-9, 1000.0, 1.0]).bfloat16()
    quantized = _cast(x, 1.0, Fp8Format.E4M3)
    quantizer = SimpleNamespace(scale=torch.tensor([1.0]))
    c.inspect("layer0.qkv", "activation", x, quantized, quantizer)
    first = c.counts
    assert first[0].tolist() == count_overflow_underflow(x, 1.0, Fp8Format.E4M3).tolist() != [0, 0]
    first.zero_()  # the source zeroes in place after a read: the views still point into it
    c.inspect("layer0.qkv", "activation", x, quantized, quantizer)
    assert first[0].tolist() == count_overflow_underflow(x, 1.0, Fp8Format.E4M3).tolist()
    c.counts = torch.zeros(2, 2, dtype=torch.int64)
    c.inspect("layer0.mlp.fc2", "gradient", x, quantized, quantizer)
    assert c.counts[1].sum() > 0 and c.counts[0].sum() == 0 and first[1].sum() == 0


class _Prepared:
    """A source that records what the Monitor's step driver tells it."""

    kind = "te"
    supports_counts = True

    def __init__(self, staggers: bool = True) -> None:
        self.staggers_counts = staggers
        self.calls: list[tuple[int, int, int | None]] = []
        self.armed: list[bool] = []

    def prepare_step(self, step: int, count_every: int, stagger_from: int | None = None) -> None:
        self.calls.append((step, count_every, stagger_from))

    def arm_counts(self, enabled: bool) -> None:
        self.armed.append(enabled)


def test_staggered_counts_are_read_only_at_the_end_of_whole_windows() -> None:
    from fp8guard.agent.source_steps import SourceSteps

    src = _Prepared()
    steps = SourceSteps([src])  # type: ignore[list-item]
    read = []
    for step in [*range(0, 25), *range(12, 36)]:  # a rollback from 24 to 12
        steps.arm_counts_for(step, every=10, reporting=True, stagger=True)
        if steps.counting:
            read.append(step)
    # 0 reads nothing (no whole window ends there); 10 and 20 do; after the jump back to 12 the
    # schedule restarts there: 20's window (11-20) began before it, so 30 is the next read
    assert read == [10, 20, 30]
    assert src.calls[0] == (0, 10, 0) and src.calls[24] == (24, 10, 0) and src.calls[25] == (12, 10, 12)
    steps.arm_counts_for(36, every=5, reporting=True, stagger=True)  # a new cadence restarts too
    assert src.calls[-1] == (36, 5, 36)
    unstaggered = SourceSteps([_Prepared()])  # type: ignore[list-item]
    assert [s for s in range(0, 25) if (unstaggered.arm_counts_for(s, every=10, reporting=True) or
                                        unstaggered.counting)] == [0, 10, 20]
    # a source that cannot stagger (the emulation, torchao, TE's hooks) ignores the setting: its
    # counts come at every multiple, the first one included, and it is never told a schedule start
    plain = _Prepared(staggers=False)
    cannot = SourceSteps([plain])  # type: ignore[list-item]
    assert [s for s in range(0, 25) if (cannot.arm_counts_for(s, every=10, reporting=True, stagger=True) or
                                        cannot.counting)] == [0, 10, 20]
    assert plain.calls[0] == (0, 10, None)
    # beside a source that cannot (a TE session the script opened, another library), none
    # staggers: every source counts at the multiples, so no report mixes windows and steps
    mixed = SourceSteps([_Prepared(), _Prepared(staggers=False)])  # type: ignore[list-item]
    assert [s for s in range(0, 25) if (mixed.arm_counts_for(s, every=10, reporting=True, stagger=True) or
                                        mixed.counting)] == [0, 10, 20]
    assert all(call[2] is None for call in mixed.sources[0].calls)  # type: ignore[attr-defined]


def test_fp8guard_staggers_only_in_a_debug_session_it_owns(monkeypatch: pytest.MonkeyPatch) -> None:
    """A debug session the training script opened keeps its own iterations: counting there is
    every module at the multiples, so the TE source does not offer to stagger."""
    debug_api = pytest.importorskip("nvdlfw_inspect.api")
    from fp8guard.agent.sources import te_inspect

    monkeypatch.setattr(debug_api, "DEBUG_MANAGER", None)
    assert te_inspect.owns_session()  # none open: attach would open it
    monkeypatch.setattr(debug_api, "DEBUG_MANAGER", object())
    monkeypatch.setattr(te_inspect._Slot, "owned_session", False)
    assert not te_inspect.owns_session()  # the script's
    monkeypatch.setattr(te_inspect._Slot, "owned_session", True)
    assert te_inspect.owns_session()  # fp8guard's, from an earlier Monitor
