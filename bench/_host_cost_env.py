"""What both parts of ``bench/gpu_host_cost.py`` run on and read with: torch, the TE handles and
the device (``Env``: the real ones, or the CPU stand-in under ``--smoke``), the summary of a list
of timings, and the state of the monitor's gradient buffer."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from typing import Any

from bench._te_model import Shape, TEModel, require_te

BENCH = "gpu_host_cost"


class Env:
    """torch, the TE handles and the device: the real ones, or the CPU stand-in under ``--smoke``."""

    def __init__(self, smoke: bool, grads: str = "none") -> None:
        self.smoke = smoke
        self.keep_grads = grads == "keep"
        self._stack = contextlib.ExitStack()
        if smoke:
            import torch

            from fp8guard.agent.sources import te_access
            from tests import fake_te

            self.torch, self.te, self.recipes, self.device = torch, fake_te, fake_te, "cpu"
            self._stack.enter_context(te_access.substitute(fake_te))
            self.versions = {"torch": torch.__version__, "transformer_engine": "stand-in (tests/fake_te.py)"}
        else:
            torch, te = require_te(BENCH)
            import transformer_engine
            import transformer_engine.common.recipe as recipes

            self.torch, self.te, self.recipes, self.device = torch, te, recipes, "cuda"
            self.versions = {"torch": torch.__version__, "transformer_engine": transformer_engine.__version__,
                             "device": torch.cuda.get_device_name()}

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def allocated(self) -> int:
        return int(self.torch.cuda.memory_allocated()) if self.cuda else 0

    def model(self, layers: int, hidden: int, seq: int, batch: int) -> TEModel:
        m = TEModel(Shape(layers=layers, hidden=hidden, seq=seq, batch=batch), te=self.te, recipes=self.recipes,
                    device=self.device)
        m.set_to_none = not self.keep_grads
        return m

    def monitor(self, m: TEModel) -> Any:
        from fp8guard.agent import Monitor, MonitorConfig, NullTransport

        return Monitor(MonitorConfig(url=None, sources=["te"], flush_interval_steps=50, count_interval_steps=0,
                                     grad_buffer=self.keep_grads), transport=NullTransport()).attach(m.model, m.opt)

    def foreach_norm(self, m: TEModel) -> Any:
        """``GradNorm(backend="foreach")``: the comparison to the monitor's default."""
        from fp8guard.agent.telemetry import GradNorm

        return GradNorm(m.model.parameters(), backend="foreach")

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def close(self) -> None:
        self._stack.close()


def _stats(xs: list[float], nd: int = 1) -> dict[str, Any]:
    s = sorted(xs)
    return {"median": round(statistics.median(s), nd), "p90": round(s[int(0.9 * (len(s) - 1))], nd),
            "min": round(s[0], nd), "n": len(s)} if s else {"n": 0}


def _us_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e6


def _buffer_state(monitor: Any) -> dict[str, Any]:
    """The gradient buffer (``--grads keep``): whether it held, its size (it replaces the gradients:
    not the monitor's memory), the steps that walked every gradient and the times it was put back."""
    buf = monitor._grad_norm.buffer
    if buf is None:
        return {"grad_buffer": None}
    return {"grad_buffer": {"state": buf.state, "bytes": sum(b.numel() * b.element_size() for b in buf.buffers),
                            "full_checks": buf.full_checks, "readopted": buf.readopted}}
