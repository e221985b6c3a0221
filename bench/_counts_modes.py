"""The TE model with fp8guard attached and the switch between the modes that ``bench/gpu_counts.py
time``, ``profile`` and ``parts`` compare (``_Modes``), the ``time`` modes' names, and the
rotating order of a round's modes."""

from __future__ import annotations

import argparse
from typing import Any

from bench._te_model import Records, Shape, TEModel, require_te


class _Modes:
    """The TE model with fp8guard attached, and the switch between the modes ``time`` and
    ``profile`` compare: plain FP8 (TE's debug mode off), the Monitor with counting off, counting
    every 10th step (all modules at once, or staggered: ``MonitorConfig.count_stagger``), counting
    every step (with fp8guard's routing keys for nvdlfw-inspect, or TE's own; one count launch per
    operand, or eight operands a launch), and TE's debug path alone (counting armed, fp8guard's
    kernel skipped). fp8guard answers TE's debug questions itself (``te_inspect.answer_directly``,
    ``te_inspect.bind_namespace``) but in the modes ending ``_routed`` and
    ``counts_every_step_te_routes``, where nvdlfw-inspect routes them."""

    def __init__(self, args: argparse.Namespace, bench: str) -> None:
        torch, _ = require_te(bench)
        import logging

        from transformer_engine.debug.pytorch.debug_state import TEDebugState

        from fp8guard.agent import Monitor, MonitorConfig, NullTransport
        from fp8guard.agent.sources import te_counts, te_inspect

        self.torch, self.state, self.te_inspect, self.te_counts = torch, TEDebugState, te_inspect, te_counts
        self.records = Records()
        logging.getLogger("fp8guard").addHandler(self.records)
        self.m = TEModel(Shape(layers=args.layers))
        self.m.step()
        torch.cuda.synchronize()
        self.monitor = Monitor(MonitorConfig(url=None, sources=["te"], flush_interval_steps=50, count_interval_steps=0),
                               transport=NullTransport()).attach(self.m.model, self.m.opt)
        self.src = self.monitor.sources[0]
        self.monitor.set_count_interval(1)  # opens TE's debug session (fp8guard owns it)
        self.real = te_counts.count_cast_into
        from fp8guard.agent.kernels.count_batch import BATCH_SLOTS, CountBatch

        self.batch = CountBatch(BATCH_SLOTS)
        self.mode = "plain"

    @staticmethod
    def _skip_kernel(out: Any, x: Any, **kw: Any) -> None:
        return None

    def use(self, mode: str) -> None:
        self.mode = mode
        self.te_counts.count_cast_into = self._skip_kernel if mode.startswith("debug_path_only") else self.real
        counter = getattr(self.src, "_inspect", None)
        if counter is not None:  # eight operands a launch (count_batch.CountBatch) in the _batched modes
            counter.use_batch(self.batch if "_batched" in mode else None)
        if mode == "plain":
            self.state.debug_enabled = False
            return
        self.state.debug_enabled = True
        # TE's own routing keys for nvdlfw-inspect in one mode, fp8guard's in the others
        self.te_inspect.cache_routes_across_iterations(mode != "counts_every_step_te_routes")
        direct = not mode.endswith(("_routed", "_te_routes"))
        self.te_inspect.answer_directly(direct)
        self.te_inspect.bind_namespace(direct)
        self.monitor.config.count_stagger = mode.startswith("counts_every_10_staggered")
        self.monitor.set_count_interval(MODE_INTERVAL[mode])

    def step(self) -> None:
        self.m.step(None if self.mode == "plain" else self.monitor)

    def restore(self) -> None:
        self.te_counts.count_cast_into = self.real
        counter = getattr(self.src, "_inspect", None)
        if counter is not None:
            counter.use_batch(None)
        self.te_inspect.cache_routes_across_iterations(True)
        self.te_inspect.answer_directly(True)
        self.te_inspect.bind_namespace(True)


MODE_INTERVAL = {"agent_no_counts": 0, "counts_every_10": 10, "counts_every_10_staggered": 10,
                 "counts_every_step": 1, "counts_every_step_te_routes": 1, "debug_path_only": 1,
                 "counts_every_step_batched": 1, "counts_every_10_staggered_batched": 10,
                 "counts_every_10_staggered_batched_routed": 10, "counts_every_step_batched_routed": 1,
                 "debug_path_only_routed": 1}
"""Each monitored mode's count interval (``plain`` runs no monitor); staggered: the modes named so."""

_TIME_MODES = ("plain", "agent_no_counts", "counts_every_10", "counts_every_10_staggered", "counts_every_step",
               "debug_path_only", "counts_every_step_te_routes", "counts_every_step_batched",
               "counts_every_10_staggered_batched", "counts_every_10_staggered_batched_routed",
               "counts_every_step_batched_routed", "debug_path_only_routed")
"""Every mode ``time`` knows. These run only when ``--modes`` names them: ``counts_every_step_te_routes``
(counting every step with TE's own routing keys for nvdlfw-inspect, twelfth session) and the
``_batched`` modes (eight operands a count launch, ``count_batch.CountBatch``, thirteenth session),
and the ``_routed`` ones (TE's debug questions through nvdlfw-inspect's routing, as before the
sixteenth session's ``te_inspect.answer_directly``)."""
DEFAULT_TIME_MODES = _TIME_MODES[:6]
"""The modes ``time`` compares by default."""


def _round_order(modes: list[str], r: int) -> list[str]:
    """Round ``r``'s order of the modes: rotated by one each round, reversed every other round,
    so that no mode always follows the same one (its warm-up or cool-down would bias it)."""
    order = modes[r % len(modes):] + modes[:r % len(modes)]
    return order[::-1] if r % 2 else order
