"""Exact FP8 cast counts of every Transformer Engine GEMM operand, through TE's tensor-inspection
API (nvdlfw-inspect, which ships with TE's debug tools). The only module of fp8guard that
imports ``nvdlfw_inspect``; :class:`fp8guard.agent.sources.te.TESource` uses it when asked for
``exact_counts="inspect"``.

Why the inspection API: TE quantizes some GEMM operands inside fused kernels (the LayerNorm
output of ``LayerNormLinear``/``LayerNormMLP``, the MLP activation, the activation gradient), so
their high-precision values never reach a module hook. On an iteration where a debug feature
asks to inspect a tensor, TE materialises it in high precision, casts it with the module's own
quantizer and calls ``inspect_tensor(tensor, rowwise_quantized_tensor, quantizer, ...)``.
fp8guard's feature, ``Fp8GuardCounts``, then launches one fused counting kernel
(:func:`fp8guard.agent.kernels.count_cast_into`) and adds the exact overflow and underflow counts
(TE's ``LogFp8TensorStats`` definitions) into the source's device buffer. No host sync, none of
TE's stats buffers (which sync on every feed).

Which kernel variant (:attr:`InspectCounts.variant`): the FP8-bytes one by default, the
fastest exact one measured. It reads the cast's own bytes (1 byte per element) and fetches the
high-precision value only for rows holding a 0 or maximum byte, so it needs no scale and cannot
read a stale one. On the H200 (2026-12-02, ``bench/gpu_counts.py kernels``/``time``,
docs/gpu.md) it counted the 604M model's 144 operands in 9.7 ms of GPU time against 13.4 ms for
the high-precision variant, whose float32 values and TE threshold are now formed from bits (so no
flush-to-zero path decides a subnormal: exact, but compute-heavier than its earlier 5.4 ms form).
Both agreed with TE on every operand. The high-precision variant (``x * quantizer.scale``, exact
because it is enqueued right after the cast, before TE updates the scale in place) is used where
the cast exposes no element-for-element bytes.

Cost model: on the iterations it counts, TE runs its debug path for the layer (unfused
LayerNorm+cast and activation+cast, as for any inspection feature); on the others
``inspect_tensor_enabled`` tells TE when counting comes next, so the layers take TE's normal
fused path and nothing is even constructed (TE: "the layer runs at normal speed").

Launches: one count launch per operand (144 a counted step of the 604M model), or, with
``count_batch.OPERANDS_PER_LAUNCH`` set, up to eight operands of one format a launch
(:class:`~fp8guard.agent.kernels.count_batch.CountBatch`; :meth:`InspectCounts.use_batch` says when
the held operands are counted). Not yet timed on a GPU, so off by default.

Iteration numbering: when fp8guard opens the debug session (the usual case) it keeps TE's
debug iteration equal to the monitor's step, so the schedule is exact and survives rollbacks.
When the training script opened it itself (to use TE's own debug features too), call
:func:`register_feature` before ``debug_api.initialize`` and add ``Fp8GuardCounts`` to the
config section that selects the layers (nvdlfw-inspect allows one section per layer)::

    fp8guard.agent.sources.te_inspect.register_feature()
    debug_api.initialize(config_file={"fp8": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"},
        "transformer_engine": {"Fp8GuardCounts": {"enabled": True, "tensors": ["activation", "weight", "gradient"]},
                               "LogFp8TensorStats": {...}}}}, feature_dirs=[TE_FEATURES_DIR])

The script then calls ``debug_api.step()`` itself; fp8guard cannot predict its numbering and asks
TE to re-check every iteration (a few milliseconds of host time per step, no GPU work).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fp8guard.agent.errors import ConfigError
from fp8guard.agent.fp8 import Fp8Format
from fp8guard.agent.kernels import count_batch, count_cast_into
from fp8guard.agent.source_steps import first_whole_window_end

__all__ = ["FEATURE_NAME", "TENSOR_NAMES", "InspectCounts", "register_feature"]

log = logging.getLogger("fp8guard.agent")

FEATURE_NAME = "Fp8GuardCounts"
TENSOR_NAMES: dict[str, str] = {"fwd_input": "activation", "fwd_weight": "weight", "bwd_grad_output": "gradient"}
"""fp8guard's operand roles and the names TE's debug API gives the same tensors."""
_FORWARD_TENSORS = frozenset({"activation", "weight"})
"""The tensors a step casts in its forward: one TE hands over again inside a backward (an
activation recomputed under checkpointing, Linear's ``save_original_input``, a weight
re-quantized for FSDP) is the same cast again, not another one."""
_CONFIG_SECTION = "fp8guard_exact_counts"


@dataclass(frozen=True, slots=True)
class _Target:
    index: int
    fmt: Fp8Format


class InspectCounts:
    """Routes TE's ``inspect_tensor`` calls into a ``[n, 2]`` int64 device count buffer.

    ``targets`` maps (TE layer name, TE tensor name) to the column. The schedule is plain state:
    :meth:`enabled` answers TE's routing question for an iteration from ``armed``, ``every``
    and whether fp8guard owns the iteration numbering.
    """

    def __init__(self, targets: Mapping[tuple[str, str], tuple[int, Fp8Format]], counts: torch.Tensor) -> None:
        self.targets = {k: _Target(i, f) for k, (i, f) in targets.items()}
        self.counts = counts
        self.armed = False
        self.every = 0
        """Count every this many steps (0: never): lets TE skip its debug path in between."""
        self.owning = False
        """Whether fp8guard opened the debug session and sets its iteration to the step."""
        self.active = True
        self.calls = 0
        """inspect_tensor calls that counted something (a host-side tally, for tests and benches)."""
        self.repeats = 0
        """Forward casts handed over again inside a backward, not counted (see :meth:`inspect`)."""
        self.high_precision: frozenset[str] = frozenset()
        """TE layer names whose module runs in high precision (fp8guard's BF16 fallback, or a
        probe's plan): never counted, so TE keeps them off its debug path. There is nothing to
        count (no FP8 cast), and TE 2.20.2's debug path does not cast a high-precision GEMM's
        input to torch autocast's dtype: on the H200 cuBLAS refused a BF16 weight with a float32
        input (``Input matrices types mismatch``) at the first counted step after a fallback."""
        self.variant = "auto"
        """``auto``: the FP8-bytes kernel where the cast has element-for-element bytes, else the
        high-precision kernel; ``hp`` or ``bytes`` force one (a forced variant that lacks its input
        falls back to the other)."""
        self._rows: list[torch.Tensor] = []
        self._rows_of: torch.Tensor | None = None
        self.stagger_from: int | None = None
        """Staggered counting (``MonitorConfig.count_stagger``; fp8guard owns the iteration
        numbering): the step the schedule started from. Each TE module is then counted once in
        every window of ``every`` steps that ends at a multiple of ``every`` (where the Monitor
        reads the counts), at its own step: ``module index mod every`` steps before the window's
        end, so a counted window's debug-path work is spread over its steps instead of falling on
        one. Only whole windows after ``stagger_from`` count. None: every module at the multiples."""
        self.held = False
        """Counting paused (a probe's forwards inside a step are not the step's casts): staggered
        counting's schedule does not read ``armed``, so the probe holds it with this."""
        self.module_of: dict[str, int] = {}
        """TE layer name -> the index of the TE module it belongs to (a LayerNormMLP's two GEMMs
        share one: TE takes its debug path per module)."""
        self.modules: list[torch.nn.Module] = []
        """The TE modules counted (the source sets them): with a batch, each one's forward end
        counts what its forward handed over (:meth:`use_batch`)."""
        self.batch: count_batch.CountBatch | None = None
        """Operands counted several to a launch (:meth:`use_batch`), or None: one launch each."""
        self._flushes_at: int | None = None
        """The autograd graph task whose end flushes the batch (one callback per backward)."""
        self._module_hooks: list[Any] = []

    def use_batch(self, batch: count_batch.CountBatch | None) -> None:
        """Count operands several to a launch with ``batch`` (None: one launch each, no hooks).

        What the batch holds is counted at the latest at: the end of the forward of the module
        that handed it over (a forward hook on each of :attr:`modules`: TE drops a forward cast's
        FP8 bytes there, FSDP may free a gathered weight right after, and an optimizer may change
        a weight in place once the backward is done), the end of the backward that handed over a
        gradient (an autograd engine callback; gradients are fresh tensors nobody writes), and
        whenever the source reads the counts or a step starts (:meth:`flush`)."""
        self.flush()
        for handle in self._module_hooks:
            handle.remove()
        self._module_hooks = []
        self.batch = batch
        if batch is not None:
            for module in self.modules:
                self._module_hooks.append(module.register_forward_hook(self._module_done, always_call=True))

    def _module_done(self, module: Any, args: Any, output: Any) -> None:
        if self.batch is not None and len(self.batch):
            self.flush()

    def enabled(self, iteration: int, layer_name: str, tensor_name: str) -> tuple[bool, int | None]:
        """(count on this iteration, next iteration TE must ask again; None: never)."""
        if not self.active or (layer_name, tensor_name) not in self.targets:
            return False, None
        if not self.owning:
            nxt: int | None = iteration + 1
        elif self.every <= 0:
            nxt = (iteration + 1) if self.armed else None
        elif self.staggered:
            due, nxt = self._staggered(iteration, layer_name)
            return due and not self.held and layer_name not in self.high_precision, nxt
        else:
            nxt = (iteration // self.every + 1) * self.every
        return self.armed and layer_name not in self.high_precision, nxt

    @property
    def staggered(self) -> bool:
        return self.stagger_from is not None and self.owning and self.every > 1

    def _staggered(self, iteration: int, layer_name: str) -> tuple[bool, int]:
        """(this layer counts at ``iteration``, the next iteration it counts at)."""
        assert self.stagger_from is not None
        every = self.every
        phase = self.module_of.get(layer_name, 0) % every
        first = first_whole_window_end(self.stagger_from, every)
        due = (iteration + phase) % every == 0 and iteration + phase >= first
        nxt = iteration + 1 + (-(iteration + 1 + phase)) % every
        return due, max(nxt, first - phase)

    def inspect(self, layer_name: str, tensor_name: str, tensor: torch.Tensor | None, quantized: Any,
                quantizer: Any, iteration: int | None = None) -> None:
        """Count one cast; skips what it cannot count exactly (FP8 primary weights, block scaling)."""
        if not self.active or tensor is None:
            return  # tensor is None for FP8 primary weights: no high-precision values exist
        if self.staggered:
            if self.held or iteration is None or not self._staggered(iteration, layer_name)[0]:
                return
        elif not self.armed:
            return
        target = self.targets.get((layer_name, tensor_name))
        if target is None:
            return
        task = torch._C._current_graph_task_id()
        if tensor_name in _FORWARD_TENSORS and task != -1:
            # A forward cast inside the autograd engine: activation checkpointing's recompute
            # (TE's, torch's, LayerNormMLP(checkpoint=True)), Linear's save_original_input cast
            # for wgrad, a weight re-quantized in backward. TE passes no marker (the same
            # iteration, the same arguments); the forward already counted these values.
            if not self.repeats:
                log.info("fp8guard: TE handed forward casts over again inside a backward (activation "
                         "recompute, save_original_input): not counted twice")
            self.repeats += 1
            return
        scale_inv = getattr(quantized, "_scale_inv", None)
        if not isinstance(scale_inv, torch.Tensor):
            return  # not a per-tensor FP8 cast (high-precision GEMM, block scaling)
        data = getattr(quantized, "_data", None)
        if not isinstance(data, torch.Tensor) or data.numel() != tensor.numel():
            data = None  # not the element-for-element rowwise bytes: count from the values instead
        scale = getattr(quantizer, "scale", None)
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
            scale = None
        if data is None and scale is None:
            # Neither the cast's bytes nor its scale: 1/scale_inv is not always the scale (one
            # rounding each way), so a count from it would not be exact. Not counted.
            return
        use_bytes = data is not None and (scale is None or self.variant != "hp")
        fmt = _format_of(quantized, target.fmt, quantizer)
        if self.batch is not None and use_bytes and data is not None:
            if task != -1 and task != self._flushes_at:
                self._flush_at_backward_end(task)
            self.batch.add(self._row(target.index), tensor.detach(), scale=scale if scale is not None else scale_inv,
                           scale_inv=scale_inv, fmt=fmt, fp8_bytes=data)
        else:
            count_cast_into(self._row(target.index), tensor.detach(),
                            scale=scale if scale is not None else scale_inv, scale_inv=scale_inv,
                            fmt=fmt, fp8_bytes=data if use_bytes else None)
        self.calls += 1

    def flush(self) -> None:
        """Enqueue the counting of every operand the batch holds (nothing without a batch)."""
        if self.batch is None or not len(self.batch):
            return
        try:
            self.batch.flush()
        except Exception:  # monitoring never takes training down
            self.active = False
            self.batch.drop()
            log.exception("fp8guard: exact counting failed and is now off; training continues")

    def drop(self) -> None:
        """Forget the operands the batch holds, uncounted (their window was abandoned)."""
        if self.batch is not None:
            self.batch.drop()

    def _flush_at_backward_end(self, task: int) -> None:
        """A backward's first held gradient: count what the batch holds when that backward ends."""
        self._flushes_at = task
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        except RuntimeError:  # not inside the engine after all: the next flush point counts them
            self._flushes_at = None

    def _backward_done(self) -> None:
        self._flushes_at = None
        self.flush()

    def _row(self, index: int) -> torch.Tensor:
        """``counts[index]``: the views are made once per count buffer (a step indexes the buffer
        once per operand: 144 views per counted step of the 604M model)."""
        if self._rows_of is not self.counts:
            self._rows = list(self.counts.unbind(0))
            self._rows_of = self.counts
        return self._rows[index]


def _format_of(quantized: Any, default: Fp8Format, quantizer: Any = None) -> Fp8Format:
    """The format the cast used: the quantizer's ``dtype`` (TE's ``tex.DType``), else the cast
    tensor's ``_fp8_dtype``, else ``default``: the layout's format for the operand (E5M2 for
    HYBRID's gradients). On the H200 with TE 2.20.2 (2026-12-02) neither attribute named E5M2 on
    the backward gradients as read here: ``bench/gpu_counts.py verify``, defaulting to E4M3, counted
    their E5M2 bytes against E4M3's range, while this feature, defaulting to the layout's E5M2,
    equalled TE on every operand. The layout's default is what makes it right there."""
    for name in (str(getattr(quantizer, "dtype", "")), str(getattr(quantized, "_fp8_dtype", ""))):
        if "E4M3" in name:
            return Fp8Format.E4M3
        if "E5M2" in name:
            return Fp8Format.E5M2
    return default


# -- the nvdlfw-inspect feature ---------------------------------------------------------------


class _Slot:
    """The counter the registered feature talks to (the debug API instantiates features itself)."""

    counter: InspectCounts | None = None
    owned_session = False
    """fp8guard opened the current debug session (a later Monitor in the process owns it too)."""


def _make_feature() -> type:
    from nvdlfw_inspect.registry import api_method

    class Fp8GuardCounts:
        """fp8guard: exact overflow/underflow counts into device buffers (no host sync).

        Config: ``Fp8GuardCounts: {enabled: True, tensors: [activation, weight, gradient]}``.
        """

        def parse_config_and_api(self, config: dict[str, Any], **kwargs: Any) -> tuple[bool, None]:
            name = kwargs.get("tensor_name")
            wanted = config.get("tensors", list(TENSOR_NAMES.values()))
            return bool(config.get("enabled", False)) and (name is None or name in wanted), None

        @api_method  # type: ignore[untyped-decorator, unused-ignore]
        def inspect_tensor_enabled(self, config: dict[str, Any], layer_name: str, tensor_name: str,
                                   iteration: int) -> tuple[bool, int | None]:
            counter = _Slot.counter
            if counter is None:
                return False, None
            return counter.enabled(iteration, layer_name, tensor_name)

        @api_method  # type: ignore[untyped-decorator, unused-ignore]
        def inspect_tensor(self, config: dict[str, Any], layer_name: str, tensor_name: str, iteration: int,
                           tp_group: Any, tensor: torch.Tensor | None, rowwise_quantized_tensor: Any = None,
                           columnwise_quantized_tensor: Any = None, quantizer: Any = None,
                           tp_size: int = 1) -> None:
            counter = _Slot.counter
            if counter is None:
                return
            try:
                counter.inspect(layer_name, tensor_name, tensor, rowwise_quantized_tensor, quantizer, iteration)
            except Exception:  # monitoring never takes training down
                counter.active = False
                log.exception("fp8guard: exact counting failed and is now off; training continues")

    return Fp8GuardCounts


def register_feature() -> None:
    """Register ``Fp8GuardCounts`` with nvdlfw-inspect (idempotent). Call it before your own
    ``debug_api.initialize`` when your script opens TE's debug session itself."""
    try:
        from nvdlfw_inspect.registry import Registry
    except Exception as exc:
        raise ConfigError(f"exact counts under Transformer Engine need nvdlfw-inspect "
                          f"(pip install 'fp8guard[te]'): {exc}") from exc
    data = Registry.data.get("transformer_engine")
    if data is not None and FEATURE_NAME in data.features:
        return
    if data is not None and any(f.__name__ == FEATURE_NAME for f in data.deferred_features):
        return
    Registry.register_feature(namespace="transformer_engine")(_make_feature())


def _te_features_dir() -> str:
    import transformer_engine.debug.features as features

    return str(os.path.dirname(features.__file__))


def owns_session() -> bool:
    """Whether :func:`attach` would leave fp8guard owning TE's debug session (none is open, or
    fp8guard opened it), without opening one; False without nvdlfw-inspect."""
    try:
        import nvdlfw_inspect.api as debug_api
    except Exception:  # attach would refuse: nothing to stagger
        return False
    return debug_api.DEBUG_MANAGER is None or _Slot.owned_session


def attach(counter: InspectCounts) -> None:
    """Route the debug API to ``counter``: open the debug session if nobody did, else join it.

    Raises :class:`ConfigError` when the script opened it without ``Fp8GuardCounts``.
    """
    try:
        import nvdlfw_inspect.api as debug_api
        from nvdlfw_inspect.logging import BaseLogger
        from transformer_engine.debug.pytorch.debug_state import TEDebugState
    except Exception as exc:
        raise ConfigError(f"exact counts under Transformer Engine need nvdlfw-inspect and TE's debug "
                          f"tools (pip install 'fp8guard[te]'): {exc}") from exc
    if debug_api.DEBUG_MANAGER is not None and _Slot.owned_session:
        counter.owning = True
    elif debug_api.DEBUG_MANAGER is None:
        register_feature()

        class _Quiet(BaseLogger):  # type: ignore[misc]
            """fp8guard keeps its counts itself: no statistics files from the debug session."""

            def log_scalar(self, name: str, value: float | int, iteration: int, **kwargs: Any) -> None:
                return None

        config = {_CONFIG_SECTION: {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"},
                                    "transformer_engine": {FEATURE_NAME: {
                                        "enabled": True, "tensors": list(TENSOR_NAMES.values())}}}}
        debug_api.initialize(config_file=config, feature_dirs=[_te_features_dir()], statistics_logger=_Quiet(),
                             log_dir=tempfile.mkdtemp(prefix="fp8guard-te-debug-"))
        if not cache_routes_across_iterations():
            log.warning("fp8guard: nvdlfw-inspect's routing cache has another shape here; TE's per-iteration "
                        "routing entries will grow with every counted step")
        counter.owning = True
        _Slot.owned_session = True
    else:
        from nvdlfw_inspect.registry import Registry

        data = Registry.data.get("transformer_engine")
        if data is None or FEATURE_NAME not in data.features:
            raise ConfigError(
                "TE's debug session was opened by the training script without fp8guard's feature: call "
                "fp8guard.agent.sources.te_inspect.register_feature() before debug_api.initialize and add "
                f"'{FEATURE_NAME}: {{enabled: True, tensors: [activation, weight, gradient]}}' to the config "
                "section that selects the layers (see the module docs)")
        counter.owning = False
    # Modules built before the session was opened saw debugging off; the flag is read per forward.
    if not TEDebugState.debug_enabled:
        TEDebugState.debug_enabled = True
    _Slot.counter = counter


def cache_routes_across_iterations(on: bool = True) -> bool:
    """Key nvdlfw-inspect's routing of TE's calls on what decides the route in a debug session
    fp8guard opened: the layer and tensor, not the iteration. Call it only for such a session.

    TE keys ``inspect_tensor_enabled`` and ``inspect_tensor_postquantize_enabled`` on the
    iteration too, and nvdlfw-inspect 0.2 keeps every routing entry and every logged call for
    good (``route_api`` in nvdlfw_inspect/base.py): each counted iteration adds one entry per call
    site, layer and tensor, 576 on the 604M model, and routes each of those calls from scratch
    with a debug log message. ``fp8_gemm_enabled`` has no cache key in TE's map at all (its entry
    is named ``fp8_gemm``): routed from scratch on every call. The iteration is in TE's key
    because a feature's route may depend on it (``LogTensorStats``' ``freq`` and start and end
    steps); in a session fp8guard opened only fp8guard's feature is configured, and its route
    depends on the tensor name alone, so a route found once holds for every iteration (the
    feature still gets each call's iteration: only which feature to call is cached). Measured
    with ``python3 bench/te_routing.py`` (docs/gpu.md). ``on=False`` puts TE's keys back (the GPU
    bench times both). Returns False, changing nothing, where nvdlfw-inspect or TE keep their
    routing otherwise."""
    try:
        import nvdlfw_inspect.api as debug_api
    except Exception:
        return False
    apis = getattr(debug_api.DEBUG_MANAGER, "_namespace_apis", None)
    api = apis.get("transformer_engine") if isinstance(apis, dict) else None
    # (the instance's own attributes: a namespace API answers any other name with a routed call)
    state = getattr(api, "__dict__", {})
    keys, cache = state.get("_cacheable_api_kwargs_map"), state.get("_api_cache")
    if not isinstance(keys, dict) or not isinstance(cache, dict):
        return False
    te_keys = state.setdefault("_fp8guard_te_keys", keys)
    routed = {name: [k for k in args if k != "iteration"] for name, args in te_keys.items()}
    routed.setdefault("fp8_gemm_enabled", ["gemm"])
    state["_cacheable_api_kwargs_map"] = routed if on else te_keys
    return True


def detach(counter: InspectCounts) -> None:
    counter.flush()
    counter.active = False
    counter.armed = False
    if _Slot.counter is counter:
        _Slot.counter = None


def set_iteration(step: int, modules: Sequence[tuple[str, Any]] = (), *, requery: bool = False) -> None:
    """Make TE's debug iteration ``step`` (fp8guard owns the session). After a jump backwards
    (a rollback) the modules must ask again: their cached 'next debug iteration' is in the
    abandoned future; ``requery`` makes them ask again in any case."""
    import nvdlfw_inspect.api as debug_api

    manager = debug_api.DEBUG_MANAGER
    if manager is None:
        return
    previous = manager._trainer_iteration_count
    manager.initialize_training_step(step)
    if step < previous or requery:
        for _, m in modules:
            if hasattr(m, "next_iter_when_debug_should_be_run"):
                m.next_iter_when_debug_should_be_run = step
                # ...and treat the next forward as a new iteration even at the same number
                m.debug_last_iteration = None


def requery(modules: Sequence[tuple[str, Any]]) -> None:
    """Make the modules ask TE's routing question again at their next forward, even within the
    iteration they already asked in (a module switched precision: whether it counts changed)."""
    import nvdlfw_inspect.api as debug_api

    manager = debug_api.DEBUG_MANAGER
    if manager is None:
        return
    step = manager._trainer_iteration_count
    for _, m in modules:
        if hasattr(m, "next_iter_when_debug_should_be_run"):
            m.next_iter_when_debug_should_be_run = step
            m.debug_last_iteration = None


def bump_iteration(modules: Sequence[tuple[str, Any]] = ()) -> None:
    """Advance TE's debug iteration by one and make the modules ask again (they then hear that
    nothing is ever due), so none of them stays on the debug path of a counted iteration."""
    import nvdlfw_inspect.api as debug_api

    manager = debug_api.DEBUG_MANAGER
    if manager is None:
        return
    step = manager._trainer_iteration_count + 1
    manager.initialize_training_step(step)
    for _, m in modules:
        if hasattr(m, "next_iter_when_debug_should_be_run"):
            m.next_iter_when_debug_should_be_run = step
            m.debug_last_iteration = None
