"""What every fused kernel shares: whether Triton runs here, and how many programs fill the GPU.

The only place, with the kernel modules beside it, where fp8guard imports Triton (optional: the
agent's dependencies stay torch and httpx). Triton's CPU interpreter (``TRITON_INTERPRET=1``)
runs the kernels on CPU tensors, which is how CI checks them against their torch references.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

BLOCK = 4096
"""Elements per block of the streaming kernels (counting, sum of squares)."""


def interpret() -> bool:
    """Whether Triton's CPU interpreter is on (read per call: Triton reads it when imported)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


@functools.cache
def triton_modules() -> tuple[Any, Any] | None:
    """``(triton, triton.language)``, or None when Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # not installed, or a broken install: every caller has an exact torch path
        return None
    return triton, tl


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernels run for tensors on ``device`` (CUDA, or CPU when interpreting)."""
    if device.type != "cuda" and not (device.type == "cpu" and interpret()):
        return False
    return triton_modules() is not None


def device_index(device: torch.device) -> int:
    """The CUDA device index ``device`` means (its own, else the current one; 0 off CUDA)."""
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" else 0


@functools.cache
def max_programs(device_index: int, per_sm: int = 8) -> int:
    """Enough programs to fill the GPU a few times over; each then loops over its blocks."""
    if interpret():
        return 4
    return per_sm * torch.cuda.get_device_properties(device_index).multi_processor_count


def launch_shape(n: int, device: torch.device, block: int = BLOCK, per_sm: int = 8) -> tuple[int, int]:
    """(programs, blocks per program). Blocks per program is a power of two and a compile-time
    constant (a handful of kernel variants in all, and a loop the compiler can unroll)."""
    blocks = -(-n // block)
    iters = 1
    while blocks > iters * max_programs(device_index(device), per_sm):
        iters *= 2
    return -(-blocks // iters), iters


def specialization_key(args: Sequence[Any]) -> tuple[Hashable, ...]:
    """What Triton's JIT specialises a compiled kernel on, per runtime argument: a tensor's dtype
    and its address's 16-byte alignment; an integer's divisibility by 16, equality to 1 and
    width. Two calls with the same key run the same compiled kernel."""
    key: list[Hashable] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool) or not isinstance(a, int):
            key.append(type(a).__name__)
        else:
            key.append((a % 16 == 0, a == 1, -(2**31) <= a < 2**31))
    return tuple(key)


@functools.cache
def _runtime_knobs() -> Any:
    """Triton's runtime knobs (its launch hooks), or None where this Triton has none."""
    try:
        from triton import knobs
    except Exception:
        return None
    return knobs.runtime


def launch_hooks_off() -> bool:
    """Whether no launch hook is set in Triton (a profiler such as proton sets them): then the C
    launcher can be called without the launch metadata the hooks would be handed. A hook that is
    not Triton's chain of hooks counts as set."""
    runtime = _runtime_knobs()
    if runtime is None:
        return False
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


@functools.cache
def _stream_lookup() -> Callable[[], int]:
    """The current CUDA stream's raw handle on the current device, as Triton's runner looks it up
    (the current device, not the arguments'), through torch's C entry points where they exist."""
    get_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return lambda: int(raw(get_device()))
    return lambda: int(torch.cuda.current_stream(get_device()).cuda_stream)


class CompiledLaunch:
    """Launches one kernel call site through the compiled kernel's own handle.

    Triton's JIT dispatch binds and specialises every argument in Python on each call (30-100 us
    of host time per launch on the H200's host: ``jit.py:run`` in ``bench/gpu_host_cost.py``'s
    profile); the compiled kernel's handle skips that, its C launcher only reads the arguments'
    values and addresses. The first call for a key goes through the JIT (``jit``, which returns
    the compiled kernel) and keeps its handle; later calls with the same key (the constants and
    :func:`specialization_key` of the runtime arguments) use it. Under the interpreter, off CUDA,
    or after any failure of the handle (an API drift in Triton's launcher) every call goes
    through the JIT, with the same result.

    With no launch hook set (:func:`launch_hooks_off`) the handle's C launcher is called directly
    with the current stream, as Triton's runner calls it less the launch metadata and the hook
    calls it makes on every launch (Triton 3.6 hands both an empty chain of hooks each time): on
    the H200's host Triton's runner took 10.2-16.5 us a launch and the C launcher called so
    7.1-11.2 (``bench/gpu_counts.py kernels``' ``launch_floor``, docs/gpu.md). With a hook set
    (a profiler) the runner is used, so the hooks see every launch.
    """

    def __init__(self) -> None:
        self._compiled: dict[Hashable, Any] = {}
        self.fast = True
        """Whether the handle is used (False: every call through the JIT)."""
        self.direct = True
        """Whether the handle's C launcher is called directly when no launch hook is set (False:
        through Triton's runner, as before the twelfth session; the launch bench compares both)."""

    @property
    def cached(self) -> int:
        """Compiled handles kept (one per key seen)."""
        return len(self._compiled)

    def __call__(self, grid: int, args: Sequence[Any], consts: Sequence[Hashable], jit: Callable[[], Any],
                 *, key: Hashable | None = None) -> None:
        """Run the kernel over ``grid`` programs: ``args`` are the runtime arguments and
        ``consts`` the constexpr values, each in the kernel's signature order; ``key`` (default:
        ``consts`` and the arguments' specialization) must change whenever the JIT would compile
        another kernel."""
        if not self.fast:
            jit()
            return
        key = key if key is not None else (*consts, *specialization_key(args))
        compiled = self._compiled.get(key)  # never filled under the interpreter (below)
        if compiled is not None:
            if self.direct and launch_hooks_off():
                try:
                    compiled.run(grid, 1, 1, _stream_lookup()(), compiled.function, compiled.packed_metadata, None,
                                 None, None, *args, *consts)
                    return
                except Exception:  # this Triton's launcher takes other arguments: its runner from now on
                    self.direct = False
            try:
                compiled[(grid, 1, 1)](*args, *consts)
                return
            except Exception:  # an API drift in Triton's launcher: the JIT from now on, same result
                self.fast = False
                self._compiled.clear()
                jit()
                return
        if interpret():  # read on a miss only: the environment's read costs a launch ~1 us
            jit()
            return
        handle = jit()
        if handle is not None and hasattr(handle, "__getitem__"):
            self._compiled[key] = handle
