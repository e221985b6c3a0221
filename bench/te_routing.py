"""What nvdlfw-inspect's routing of TE's debug calls costs the host per counted step, and what it
keeps: TE's own cache keys against the keys fp8guard sets in a debug session it opened
(``te_inspect.cache_routes_across_iterations``), and those keys with fp8guard answering TE's
questions itself (``te_inspect.answer_directly``, no routing), then also without nvdlfw-inspect's
module ``__getattr__`` and informational messages (``te_inspect.bind_namespace``), side by side.

    python3 bench/te_routing.py [--layers 12] [--iterations 300] [--rounds 3] [--out DIR]

Runs on the CPU: nvdlfw-inspect is real, TE's namespace API and its debug quantizers' calls are
copied from TE 2.20.2 (``bench/_te_namespace.py``; TE itself needs CUDA), fp8guard's feature
answers as in training (counting every 10th step). Each way opens a fresh debug session and runs
``--iterations`` counted iterations of every call the model's TE modules make when a debug
iteration builds their quantizers (1,296 routed calls and 288 log messages for 12 layers),
rounds rotating the ways; then, under ``tracemalloc``, what the session holds after as many iterations;
and the same calls made to functions that do nothing (``host_ms_loop_floor_median``: the bench's own
part of each figure).
Every way must give the same answers call by call. The routing of TE's own features (loaded
from its features folder under TE, absent here) is not in these figures: under TE each call that
misses the cache also asks each of them, so a miss costs more there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EVERY = 10
"""Counting every this many steps: the counted iterations are its multiples."""
WAYS = ("te_keys", "fp8guard_keys", "fp8guard_direct", "fp8guard_bound")
"""TE's routing keys; fp8guard's (``te_inspect.cache_routes_across_iterations``); fp8guard's keys
and its direct answers (``te_inspect.answer_directly``); those with TE's namespace bound and the
plan messages dropped (``te_inspect.bind_namespace``), the way of a session fp8guard opens."""


def _session(way: str, layers: int) -> tuple[Any, list[str]]:
    """A fresh debug session with fp8guard's feature and counter, routed ``way``."""
    import nvdlfw_inspect.api as debug_api
    import torch
    from nvdlfw_inspect.logging import BaseLogger

    from bench import _te_namespace
    from fp8guard.agent.fp8 import Fp8Format
    from fp8guard.agent.sources import te_counts, te_inspect

    if debug_api.DEBUG_MANAGER is not None:
        debug_api.end_debug()
    te_inspect.register_feature()
    _te_namespace.install()

    class Quiet(BaseLogger):  # type: ignore[misc]
        def log_scalar(self, name: str, value: float | int, iteration: int, **kwargs: Any) -> None:
            return None

    config = {"fp8guard": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"},
                           "transformer_engine": {te_inspect.FEATURE_NAME: {
                               "enabled": True, "tensors": list(te_inspect.TENSOR_NAMES.values())}}}}
    debug_api.initialize(config_file=config, feature_dirs=[], statistics_logger=Quiet(),
                         log_dir=_te_namespace.log_dir())
    if way != "te_keys" and not te_inspect.cache_routes_across_iterations():
        raise SystemExit("cache_routes_across_iterations found no routing map to change")
    if way in ("fp8guard_direct", "fp8guard_bound") and not te_inspect.answer_directly():
        raise SystemExit("answer_directly found no namespace API to answer for")
    if way == "fp8guard_bound" and not te_inspect.bind_namespace():
        raise SystemExit("bind_namespace found no session to bind")
    names = _te_namespace.layer_names(layers)
    targets = {(n, t): (i * 3 + j, Fp8Format.E4M3) for i, n in enumerate(names)
               for j, t in enumerate(te_inspect.TENSOR_NAMES.values())}
    counter = te_counts.InspectCounts(targets, torch.zeros(len(targets), 2, dtype=torch.int64))
    counter.owning, counter.every, counter.armed = True, EVERY, True
    te_inspect._Slot.counter = counter
    return debug_api, names


def _entries(debug_api: Any) -> dict[str, int]:
    from nvdlfw_inspect.logging import get_logger

    api = debug_api.DEBUG_MANAGER._namespace_apis["transformer_engine"]
    return {"routing_cache": len(api._api_cache), "logged_calls": len(get_logger().logged_api_encountered)}


def _loop_floor_ms(layers: int, iterations: int) -> float:
    """The bench's own part of an iteration: the same calls, made the same way, to functions
    that do nothing (no nvdlfw-inspect, no fp8guard)."""
    from types import SimpleNamespace

    from bench import _te_namespace

    def nothing(**_: Any) -> tuple[bool, None]:
        return False, None

    stand_in = SimpleNamespace(log_message=nothing, transformer_engine=SimpleNamespace(
        inspect_tensor_enabled=nothing, inspect_tensor_postquantize_enabled=nothing,
        modify_tensor_enabled=nothing, fp8_gemm_enabled=nothing))
    names = _te_namespace.layer_names(layers)
    took = []
    for k in range(iterations):
        t0 = time.perf_counter()
        _te_namespace.run_iteration(stand_in, names, k * EVERY)
        took.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(took), 3)


def measure(layers: int = 12, iterations: int = 300, rounds: int = 3) -> dict[str, Any]:
    try:
        import nvdlfw_inspect  # noqa: F401
        import torch  # noqa: F401
    except Exception as exc:
        return {"bench": "te_routing", "skipped": f"needs torch and nvdlfw-inspect: {exc}"}
    from bench import _te_namespace

    ways = WAYS
    per_iteration_ms: dict[str, list[float]] = {w: [] for w in ways}
    answers: dict[str, list[Any]] = {}
    held: dict[str, dict[str, Any]] = {}
    for r in range(rounds):
        for way in ways[r % len(ways):] + ways[:r % len(ways)]:
            debug_api, names = _session(way, layers)
            got = []
            for k in range(iterations):
                t0 = time.perf_counter()
                got.append(_te_namespace.run_iteration(debug_api, names, k * EVERY))
                per_iteration_ms[way].append((time.perf_counter() - t0) * 1e3)
            answers.setdefault(way, got)
            held[way] = _entries(debug_api)
            debug_api.end_debug()
    memory: dict[str, float] = {}
    for way in ways:  # what the session holds after the iterations, traced apart from the timing
        debug_api, names = _session(way, layers)
        _te_namespace.run_iteration(debug_api, names, 0)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for k in range(1, iterations + 1):
            _te_namespace.run_iteration(debug_api, names, k * EVERY)
        memory[way] = round((tracemalloc.get_traced_memory()[0] - before) / iterations / 1e3, 2)
        tracemalloc.stop()
        debug_api.end_debug()
    calls = sum(1 for _ in _te_namespace.module_calls("x", 0))
    median = {w: round(statistics.median(v), 3) for w, v in per_iteration_ms.items()}
    floor = _loop_floor_ms(layers, iterations)
    return {"bench": "te_routing", "layers": layers, "gemm_layers": 4 * layers, "counted_iterations": iterations,
            "rounds": rounds, "routed_calls_per_iteration": 4 * layers * (calls - 6),
            "host_ms_loop_floor_median": floor,
            "log_messages_per_iteration": 4 * layers * 6, "host_ms_per_counted_iteration_median": median,
            "host_ms_min_max": {w: [round(min(v), 3), round(max(v), 3)] for w, v in per_iteration_ms.items()},
            "entries_after": held, "held_kb_per_counted_iteration": memory,
            "same_answers": all(answers[w] == answers["te_keys"] for w in ways),
            "answers_to_count": sum(1 for it in answers["fp8guard_keys"] for a in it
                                    if isinstance(a, tuple) and a[0] is True and a[1] is not None)}


def main() -> None:
    from bench._te_model import write_result

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12, help="TransformerLayers (4 TE GEMM layers each)")
    parser.add_argument("--iterations", type=int, default=300, help="counted iterations per way and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="folder for te_routing.json")
    args = parser.parse_args()
    write_result(measure(args.layers, args.iterations, args.rounds), args.out, "te_routing.json")


if __name__ == "__main__":
    main()
