"""Exact FP8 cast counts of every Transformer Engine GEMM operand, through TE's tensor-inspection
API (nvdlfw-inspect, which ships with TE's debug tools). The only module of fp8guard that
imports ``nvdlfw_inspect``; :class:`fp8guard.agent.sources.te.TESource` uses it when asked for
``exact_counts="inspect"``.

Why the inspection API: TE quantizes some GEMM operands inside fused kernels (the LayerNorm
output of ``LayerNormLinear``/``LayerNormMLP``, the MLP activation, the activation gradient), so
their high-precision values never reach a module hook. On an iteration where a debug feature
asks to inspect a tensor, TE materialises it in high precision, casts it with the module's own
quantizer and calls ``inspect_tensor(tensor, rowwise_quantized_tensor, quantizer, ...)``.
fp8guard's feature, ``Fp8GuardCounts``, hands each cast to
:class:`fp8guard.agent.sources.te_counts.InspectCounts`, which decides whether this step counts it
and counts it into the source's device buffer (no host sync).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fp8guard.agent.errors import ConfigError
from fp8guard.agent.sources.te_counts import InspectCounts

__all__ = ["FEATURE_NAME", "TENSOR_NAMES", "register_feature"]

log = logging.getLogger("fp8guard.agent")

FEATURE_NAME = "Fp8GuardCounts"
TENSOR_NAMES: dict[str, str] = {"fwd_input": "activation", "fwd_weight": "weight", "bwd_grad_output": "gradient"}
"""fp8guard's operand roles and the names TE's debug API gives the same tensors."""
_CONFIG_SECTION = "fp8guard_exact_counts"


# -- the nvdlfw-inspect feature ---------------------------------------------------------------


class _Slot:
    """The counter the registered feature talks to (the debug API instantiates features itself)."""

    counter: InspectCounts | None = None
    owned_session = False
    """fp8guard opened the current debug session (a later Monitor in the process owns it too)."""


def _enabled(layer_name: str, tensor_name: str, iteration: int) -> tuple[bool, int | None]:
    """fp8guard's answer to TE's ``inspect_tensor_enabled`` (the feature's and the direct one)."""
    counter = _Slot.counter
    if counter is None:
        return False, None
    return counter.enabled(iteration, layer_name, tensor_name)


def _inspect(layer_name: str, tensor_name: str, iteration: int, tensor: torch.Tensor | None, quantized: Any,
             quantizer: Any) -> None:
    """fp8guard's ``inspect_tensor``: count one cast (the feature's and the direct one)."""
    counter = _Slot.counter
    if counter is None:
        return
    try:
        counter.inspect(layer_name, tensor_name, tensor, quantized, quantizer, iteration)
    except Exception:  # monitoring never takes training down
        counter.active = False
        log.exception("fp8guard: exact counting failed and is now off; training continues")


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
            return _enabled(layer_name, tensor_name, iteration)

        @api_method  # type: ignore[untyped-decorator, unused-ignore]
        def inspect_tensor(self, config: dict[str, Any], layer_name: str, tensor_name: str, iteration: int,
                           tp_group: Any, tensor: torch.Tensor | None, rowwise_quantized_tensor: Any = None,
                           columnwise_quantized_tensor: Any = None, quantizer: Any = None,
                           tp_size: int = 1) -> None:
            _inspect(layer_name, tensor_name, iteration, tensor, rowwise_quantized_tensor, quantizer)

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
        if not answer_directly():
            log.warning("fp8guard: nvdlfw-inspect keeps TE's namespace API otherwise here; TE's debug "
                        "questions go through its routing (more host time per counted step)")
        elif not bind_namespace():
            log.warning("fp8guard: nvdlfw-inspect keeps its debug session otherwise here; TE's debug calls "
                        "go through its module __getattr__ (more host time per counted step)")
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


def _session_te_api(debug_api: Any) -> Any:
    """TE's namespace API object of the open debug session (None without one)."""
    apis = getattr(debug_api.DEBUG_MANAGER, "_namespace_apis", None)
    return apis.get("transformer_engine") if isinstance(apis, dict) else None


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
    api = _session_te_api(debug_api)
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


def _direct_inspect_tensor_enabled(*, layer_name: str, tensor_name: str, iteration: int,
                                   **_: Any) -> tuple[bool, int | None]:
    # (output, dgrad, wgrad are no counter target: (False, None), TE's default, as routed)
    return _enabled(layer_name, tensor_name, iteration)


def _direct_inspect_tensor(*, layer_name: str, tensor_name: str, iteration: int, tensor: torch.Tensor | None = None,
                           rowwise_quantized_tensor: Any = None, quantizer: Any = None, **_: Any) -> None:
    _inspect(layer_name, tensor_name, iteration, tensor, rowwise_quantized_tensor, quantizer)


def _te_default(**_: Any) -> tuple[bool, None]:
    return False, None


def _te_default_fp8_gemm(**_: Any) -> tuple[bool, None]:
    return True, None


DIRECT_ANSWERS: dict[str, Any] = {
    "inspect_tensor_enabled": _direct_inspect_tensor_enabled,
    "inspect_tensor": _direct_inspect_tensor,
    "inspect_tensor_postquantize_enabled": _te_default,
    "modify_tensor_enabled": _te_default,
    "fp8_gemm_enabled": _te_default_fp8_gemm,
}
"""What TE's debug quantizers ask (and ``inspect_tensor``), answered as nvdlfw-inspect's routing
answers them in a debug session fp8guard opened: its feature for the three operands it counts,
TE's defaults (``TEDefaultFeatures`` in TE 2.20.2's debug/features/api.py) for everything else.
``modify_tensor`` and ``inspect_tensor_postquantize`` are never called there (their questions
answer False) and stay routed."""


def answer_directly(on: bool = True) -> bool:
    """Answer TE's debug questions in a debug session fp8guard opened without nvdlfw-inspect's
    routing (:data:`DIRECT_ANSWERS`). Call it only for such a session.

    On a debug iteration each TE GEMM module builds 6 debug quantizers, which ask 27 routed
    questions (1,296 a counted step of the 604M model): each goes through nvdlfw-inspect's
    ``route_api`` (a cache key built as a string, two logged-call sets, TE's argument assertions,
    the feature call). In a session fp8guard opened every answer is known without routing: only
    fp8guard's feature is configured, for every layer. The direct answers sit as attributes of
    TE's namespace API object, which Python finds before the object's ``__getattr__`` that routes;
    ``on=False`` takes them away (the GPU bench's ``_routed`` modes). Returns False, changing
    nothing, where nvdlfw-inspect keeps its namespace APIs otherwise."""
    try:
        import nvdlfw_inspect.api as debug_api
    except Exception:
        return False
    api = _session_te_api(debug_api)
    state = getattr(api, "__dict__", None)
    if not isinstance(state, dict) or not callable(getattr(type(api), "route_api", None)):
        return False
    for name, answer in DIRECT_ANSWERS.items():
        if on:
            state[name] = answer
        else:
            state.pop(name, None)
    return True


@dataclass(frozen=True)
class _Binding:
    """What :func:`bind_namespace` replaced and what it put in their place, to put them back."""

    manager: Any
    log_message: Callable[..., None]
    """nvdlfw-inspect's ``log_message`` (or what replaced fp8guard's while it was bound)."""
    quiet: Callable[..., None]
    close: Callable[[], None]
    earlier_close: Callable[[], None] | None
    """The manager's own instance ``close``, if it had one."""


_binding: _Binding | None = None


def bind_namespace(on: bool = True) -> bool:
    """Let TE's debug calls in a debug session fp8guard opened reach TE's namespace API without
    nvdlfw-inspect's module ``__getattr__``, and drop the session's informational log messages.
    Call it only for such a session, after :func:`answer_directly`.

    TE reaches its namespace API as ``debug_api.transformer_engine``: a module attribute that
    does not exist, so each call runs nvdlfw-inspect's module ``__getattr__``, which reads the
    caller's frame and formats its file and line as the call site of routing keys and log
    messages. The direct answers need no routing key (the calls still routed, ``modify_tensor``
    and ``inspect_tensor_postquantize``, are never made in fp8guard's session, and their routes
    there do not depend on the call site). fp8guard binds the name to the session's namespace
    API object, and replaces ``log_message`` with one that drops messages under WARNING: TE logs
    each debug quantizer's plans at INFO, 288 messages per counted step of the 604M model, each
    reading two frames, into the log folder fp8guard made for its session, which nobody reads.
    Warnings and errors go on as nvdlfw-inspect's own ``log_message`` sends them (its body,
    with the call site read from the caller's frame). The session's ``close``
    (``debug_api.end_debug()``) undoes both first, so no later session sees them, and a copy of
    the replacement that outlives its binding passes every message on as nvdlfw-inspect's own
    does; ``on=False`` undoes them now. Returns False, changing nothing, where nvdlfw-inspect
    keeps its session otherwise or the direct answers are not in place."""
    try:
        import nvdlfw_inspect.api as debug_api
        from nvdlfw_inspect.utils import APICacheIdentifier, SingleMessageLogger
    except Exception:
        return False
    if not on:
        _unbind(debug_api)
        return True
    global _binding
    manager = debug_api.DEBUG_MANAGER
    api = _session_te_api(debug_api)
    current = debug_api.__dict__.get("log_message")
    # the function to put back: nvdlfw-inspect's (or whatever replaced fp8guard's since it bound)
    real_log = _binding.log_message if _binding is not None and current is _binding.quiet else current
    class_close = getattr(type(manager), "close", None)
    if (api is None or not callable(real_log) or not callable(class_close)
            or vars(api).get("inspect_tensor_enabled") is not _direct_inspect_tensor_enabled):
        return False  # (bound, nothing routed would find the call site nvdlfw-inspect's keys need)
    _unbind(debug_api)
    earlier_close = manager.__dict__.get("close")

    def log_message(msg: str, layer_name: str | None = None, level: int = logging.INFO,
                    extra_cachable_args: Any = None) -> None:
        bound = _binding is not None and _binding.quiet is log_message and debug_api.DEBUG_MANAGER is manager
        if bound and level < logging.WARNING:
            return
        # nvdlfw_inspect.api.log_message's body, here so that the call site read two frames up
        # from save_call_details is the caller's (also in a copy that outlived its binding)
        if debug_api.DEBUG_MANAGER is None:
            raise RuntimeError("[NVDLFW INSPECT ERROR] Debug manager not initialized. Call initialize first.")
        APICacheIdentifier.save_call_details()
        SingleMessageLogger.log_message_once(msg, layer_name, level, extra_cachable_args)

    def close() -> None:
        _unbind(debug_api)
        if callable(earlier_close):
            earlier_close()
        else:
            class_close(manager)

    _binding = _Binding(manager, real_log, log_message, close, earlier_close)
    debug_api.transformer_engine = api
    debug_api.log_message = log_message
    manager.close = close
    return True


def _unbind(debug_api: Any) -> None:
    global _binding
    b, _binding = _binding, None
    if b is None:
        return
    debug_api.__dict__.pop("transformer_engine", None)
    if debug_api.__dict__.get("log_message") is b.quiet:
        debug_api.log_message = b.log_message
    if b.manager.__dict__.get("close") is b.close:
        if b.earlier_close is None:
            del b.manager.close
        else:
            b.manager.close = b.earlier_close


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
