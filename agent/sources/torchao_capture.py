"""torchao's own amaxes, read back instead of measured again.

Every FP8 cast of a ``Float8Linear`` goes through ``hp_tensor_to_float8_dynamic`` (looked up
in ``torchao.float8.float8_linear``'s globals at call time), which calls ``tensor_to_amax``
(looked up in ``torchao.float8.float8_utils``' globals by ``tensor_to_scale``). Both are
wrapped here, once per process, never copied: the outer wrapper knows the module (its
``linear_mm_config``, one object per ``Float8Linear``) and the GEMM role of the cast; the inner
one hands the amax torchao just computed (a 0-d tensor tensorwise, one per row or column
rowwise) to the source that owns that module. Why: measuring every input, weight and
output-gradient amax again in hooks read each activation once more (``abs()`` even twice, with
a temporary) and cost 6-9% of an 8-layer step on the H200 (docs/gpu.md); torchao has already
computed exactly these values for its own casts.

Capturing is host work only (two list appends per cast, on whichever thread casts: the
autograd thread in backward). The device work is :meth:`AmaxSink.fold`, once per step: a fixed
handful of launches whatever the number of casts (per dtype: the per-tensor max of rowwise
amaxes in one foreach launch and its cleanup, one batched stack; then one cat, one gather into
a ``[columns, casts]`` table, one row max, one running max). Several casts of one role in one step see the same tensor (tensorwise: the input, the
weight and the output gradient are each cast twice; rowwise: along both axes), so their max is
the tensor-wide amax torchao's first cast of that role used: the value the hooks measured.

Only plain tensors are kept: a cast traced by ``torch.compile`` (fake or functional tensors)
or a DTensor amax is passed through unrecorded, and the source's ``stale_reason`` says so.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["AmaxSink", "attach", "detach", "to_device", "unavailable", "unwrapped"]

_FOLD_AT = 8192
"""Captured amaxes held before folding early (gradient accumulation over many micro-batches, or
forwards without ``monitor.step``): bounds the references held and the size of one fold."""
_INDEX_CACHE = 16
"""Distinct cast sequences whose gather tables stay on the device (one per pattern of
micro-batches and fallbacks; a training loop repeats one or two)."""

_lock = threading.Lock()
_local = threading.local()
_routes: dict[int, tuple[Any, tuple[tuple[AmaxSink, int], ...]]] = {}
"""id(linear_mm_config) -> (that object, ((a sink, the module's first column in it), ...)): two
sources on one model (a second monitor, a benchmark's) each get every cast."""
_orig: dict[str, Callable[..., Any]] = {}
_roles: dict[Any, int] = {}


def _torchao() -> tuple[Any, Any, Any]:
    import torchao.float8.float8_linear as fl
    import torchao.float8.float8_training_tensor as ft
    import torchao.float8.float8_utils as fu

    return fl, fu, ft


def unavailable(modules: Sequence[tuple[str, torch.nn.Module]]) -> str | None:
    """Why torchao's amaxes cannot be read back for these modules (None: they can)."""
    try:
        fl, fu, ft = _torchao()
    except ImportError as exc:
        return f"torchao.float8 not importable: {exc}"
    cast = getattr(fl, "hp_tensor_to_float8_dynamic", None)
    scale = getattr(fu, "tensor_to_scale", None)
    if cast is None or getattr(fu, "tensor_to_amax", None) is None or scale is None:
        return "this torchao has no float8_linear.hp_tensor_to_float8_dynamic / float8_utils.tensor_to_amax"
    if "tensor_to_amax" not in getattr(inspect.unwrap(scale), "__code__", cast.__code__).co_names:
        return "this torchao's tensor_to_scale does not call tensor_to_amax"
    if not hasattr(ft, "GemmInputRole"):
        return "this torchao has no GemmInputRole"
    configs = [getattr(m, "linear_mm_config", None) for _, m in modules]
    if any(c is None for c in configs) or len({id(c) for c in configs}) != len(configs):
        return "Float8Linear modules share a linear_mm_config: casts cannot be told apart"
    return None


def _install() -> None:
    """Wrap torchao's two functions, again if something replaced the wrappers (each wrapper calls
    the function it replaced; one nested in another passes through, so a cast is recorded once)."""
    fl, fu, ft = _torchao()
    if not _roles:
        _roles.update({ft.GemmInputRole.INPUT: 0, ft.GemmInputRole.WEIGHT: 1, ft.GemmInputRole.GRAD_OUTPUT: 2})
    if not getattr(fl.hp_tensor_to_float8_dynamic, "_fp8guard", False):
        _orig.setdefault("cast", fl.hp_tensor_to_float8_dynamic)
        fl.hp_tensor_to_float8_dynamic = _wrap_cast(fl.hp_tensor_to_float8_dynamic)
    if not getattr(fu.tensor_to_amax, "_fp8guard", False):
        _orig.setdefault("amax", fu.tensor_to_amax)
        fu.tensor_to_amax = _wrap_amax(fu.tensor_to_amax)


def _wrap_cast(cast: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(hp_tensor: Any, float8_dtype: Any, linear_mm_config: Any, *args: Any, **kwargs: Any) -> Any:
        route = _routes.get(id(linear_mm_config))
        if route is None or route[0] is not linear_mm_config or getattr(_local, "inside", False):
            return cast(hp_tensor, float8_dtype, linear_mm_config, *args, **kwargs)
        role = kwargs["gemm_input_role"] if "gemm_input_role" in kwargs else (args[1] if len(args) > 1 else None)
        offset = _roles.get(role, 0)  # torchao's default role is INPUT
        _local.pending = [(sink, base + offset) for sink, base in route[1] if not sink.paused]
        _local.inside = True
        try:
            return cast(hp_tensor, float8_dtype, linear_mm_config, *args, **kwargs)
        finally:
            _local.pending = None
            _local.inside = False

    wrapper._fp8guard = True  # type: ignore[attr-defined]
    return wrapper


def _wrap_amax(amax: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        value = amax(*args, **kwargs)
        pending = getattr(_local, "pending", None)
        if pending:
            _local.pending = None  # one amax per cast
            for sink, slot in pending:
                sink.add(slot, value)
        return value

    wrapper._fp8guard = True  # type: ignore[attr-defined]
    return wrapper


def attach(sink: AmaxSink, modules: Sequence[tuple[torch.nn.Module, int]]) -> None:
    """Route the casts of ``modules`` (each with its first column) into ``sink``."""
    with _lock:
        _install()
        for module, base in modules:
            cfg = module.linear_mm_config
            route = _routes.get(id(cfg))
            others = route[1] if route is not None and route[0] is cfg else ()
            _routes[id(cfg)] = (cfg, (*others, (sink, base)))


def detach(sink: AmaxSink) -> None:
    with _lock:
        for key, (cfg, entries) in list(_routes.items()):
            kept = tuple(e for e in entries if e[0] is not sink)
            if kept:
                _routes[key] = (cfg, kept)
            else:
                del _routes[key]


@contextmanager
def unwrapped() -> Iterator[None]:
    """torchao's own functions, unwrapped, inside (benchmarks: torchao alone, no capture)."""
    fl, fu, _ = _torchao()
    with _lock:
        saved = fl.hp_tensor_to_float8_dynamic, fu.tensor_to_amax
        if _orig:
            fl.hp_tensor_to_float8_dynamic, fu.tensor_to_amax = _orig["cast"], _orig["amax"]
    try:
        yield
    finally:
        with _lock:
            fl.hp_tensor_to_float8_dynamic, fu.tensor_to_amax = saved


class AmaxSink:
    """torchao's amaxes of one source's columns since the last fold, and their fold into
    ``amax`` (running max per column, NaN kept: torchao's ``torch.max`` propagates it into the
    scale, and ``_foreach_max``, the gather, ``amax`` and ``maximum`` below propagate it too).

    Kept per dtype (bf16 activations and float32 weights under autocast, say): CUDA's batched
    ``cat``/``stack`` and ``_foreach_max`` take their one-launch path only for inputs of one dtype
    (with mixed dtypes, or an output of another dtype, ``cat`` copies input by input)."""

    def __init__(self, amax: torch.Tensor) -> None:
        self.amax = amax
        self.paused = False
        """True during a harm probe's forwards: they are not this step's telemetry."""
        self.captures = 0
        """Casts recorded since construction (a host counter, for ``stale_reason``)."""
        self.skipped = 0
        """Casts passed through unrecorded (traced by torch.compile, DTensor, another device)."""
        self.held = 0
        """Amaxes held for the next fold."""
        self._groups: dict[torch.dtype, tuple[list[torch.Tensor], list[int], list[bool]]] = {}
        """dtype -> (torchao's amaxes, their columns, [all 0-d])."""
        self._zero = torch.zeros(1, device=amax.device)
        self._index: dict[tuple[int, ...], torch.Tensor] = {}

    def add(self, slot: int, value: Any) -> None:
        """Host only: keep a reference to torchao's amax (it computed it under no_grad and never
        writes it again) for the next fold."""
        if type(value) is not torch.Tensor or value.device != self.amax.device or value.numel() == 0:
            self.skipped += 1
            return
        group = self._groups.get(value.dtype)
        if group is None:
            group = self._groups[value.dtype] = ([], [], [True])
        group[0].append(value)
        group[1].append(slot)
        if value.dim():
            group[2][0] = False
        self.captures += 1
        self.held += 1
        if self.held >= _FOLD_AT:
            self.fold()

    def clear(self) -> None:
        self._groups = {}
        self.held = 0

    def fold(self) -> None:
        """Device ops only, a fixed number of launches per dtype (one, two in practice): running
        max of the captured amaxes per column."""
        groups = self._groups
        if not groups:
            return
        self.clear()
        parts: list[torch.Tensor] = []
        order: list[int] = []
        for tensors, slots, (scalar,) in groups.values():
            maxes = tensors if scalar else torch._foreach_max(tensors)  # rowwise: the largest row's
            parts.append(torch.stack(maxes).float())
            order += slots
        parts.append(self._zero)  # the gather's padding, after the last amax
        vals = torch.cat(parts)
        table = vals[self._table(tuple(order))]
        torch.maximum(self.amax, table.amax(dim=1), out=self.amax)

    def _table(self, slots: tuple[int, ...]) -> torch.Tensor:
        """``[columns, casts]`` indices into the stacked amaxes, padded with ``len(slots)`` (the
        zero after them); built on the host once per cast sequence and copied asynchronously
        (pinned) to the device."""
        table = self._index.get(slots)
        if table is None:
            pad = len(slots)
            rows: list[list[int]] = [[] for _ in range(self.amax.numel())]
            for i, s in enumerate(slots):
                rows[s].append(i)
            width = max(1, *(len(r) for r in rows))
            host = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64)
            table = to_device(host, self.amax.device)
            if len(self._index) >= _INDEX_CACHE:
                self._index.clear()
            self._index[slots] = table
        return table


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An asynchronous copy from pinned memory: a pageable one would sync the stream inside
    ``monitor.step`` (the pinned allocator keeps the buffer until the copy is done)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
