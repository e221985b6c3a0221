"""Where a step's host time goes: cProfile over a few calls of one function, beside the CUDA
caching allocator's counters (an allocation that has to free cached blocks calls ``cudaFree``,
which waits for the device, and ``set_sync_debug_mode`` does not report it).

    from bench._host_profile import profile_host
    report = profile_host(torch, lambda: loop.monitor.step(loss), steps=20, before=run_step_body)
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["profile_host"]

_ALLOCATOR = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams", "num_ooms")


def _allocator(torch: Any) -> dict[str, int]:
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in _ALLOCATOR}


def profile_host(torch: Any, call: Callable[[], object], *, steps: int,
                 before: Callable[[], object] | None = None, top: int = 25,
                 sort: str = "cumulative") -> dict[str, Any]:
    """Runs ``before()`` then ``call()`` ``steps`` times, timing and profiling ``call`` only.
    Returns host microseconds per call, the allocator counters' growth over the calls, and the
    top functions by ``sort`` (a pstats key: cumulative, tottime...) as text lines."""
    host_us: list[float] = []
    alloc_before = _allocator(torch)
    prof = cProfile.Profile()
    for _ in range(steps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        prof.enable()
        call()
        prof.disable()
        host_us.append((time.perf_counter() - t0) * 1e6)
    alloc_after = _allocator(torch)
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    key = 2 if sort == "tottime" else 3  # (calls, primitive calls, own time, cumulative time, callers)
    ranked = sorted(stats.stats.items(), key=lambda kv: kv[1][key], reverse=True)[:top]  # type: ignore[attr-defined]
    per_call = max(1, steps)
    functions = [{"function": f"{path.rsplit('/', 1)[-1]}:{line}({name})", "calls_per_step": round(v[1] / per_call, 2),
                  "own_us_per_step": round(v[2] * 1e6 / per_call, 1), "cum_us_per_step": round(v[3] * 1e6 / per_call, 1)}
                 for (path, line, name), v in ranked]
    stats.sort_stats(sort).print_stats(top)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    return {"steps": steps, "host_us": [round(u, 1) for u in host_us],
            "host_us_median": round(statistics.median(host_us), 1) if host_us else None,
            "allocator_growth": {k: alloc_after[k] - alloc_before.get(k, 0) for k in alloc_after},
            "sort": sort, "functions": functions, "profile": lines[-(top + 2):]}
