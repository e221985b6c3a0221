"""Shared by the Transformer Engine source's GPU tests (test_te_source_discovery.py,
test_te_source_scaling.py, test_te_source_training.py).

Importing this module skips the importing test module unless a CUDA GPU runs Transformer Engine 2.x
in FP8, so a test module imports it before anything else that needs torch or TE. It hands on torch,
``nn`` and the TE names the tests use, and holds their tools: a capture of what TE quantizes, a
train step, a model, batches, ``read``, and the autouse fixture ``fresh_te_state`` (a test module
imports it to start each test with TE's global FP8 state reset).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import transformer_engine.pytorch as te
        import transformer_engine_torch as tex
        from transformer_engine.common.recipe import (
            DelayedScaling,
            Float8BlockScaling,
            Float8CurrentScaling,
            Format,
        )
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
except Exception as exc:  # not installed, or its extension does not load
    pytest.skip(f"needs transformer_engine (import failed: {exc})", allow_module_level=True)
_fp8_ok, _fp8_reason = te.is_fp8_available(return_reason=True)
if not _fp8_ok:
    pytest.skip(f"the GPU cannot run TE FP8: {_fp8_reason}", allow_module_level=True)

TE_GPU_MARKS = [
    pytest.mark.te,
    pytest.mark.gpu,
    # TE and its torch integration warn about deprecations and experimental features.
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
"""Every TE GPU test module's ``pytestmark``."""

from torch import nn  # noqa: E402

from fp8guard.agent.sources.base import STATS  # noqa: E402

__all__ = [
    "BF16", "DEV", "E4M3_MAX", "E5M2_MAX", "TE_GPU_MARKS", "Capture", "DelayedScaling", "Float8BlockScaling",
    "Float8CurrentScaling", "Format", "batch", "fresh_te_state", "nn", "read", "te", "tex", "torch",
    "train_step", "two_linears",
]

DEV = torch.device("cuda")
BF16 = torch.bfloat16
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


# -- helpers ----------------------------------------------------------------------------------------


class Capture:
    """Records, per TE module and step, what TE quantizes: input, weight(s), output gradient."""

    def __init__(self, modules: dict[str, nn.Module], weights: Callable[[nn.Module], list[torch.Tensor]]) -> None:
        self.steps: list[dict[tuple[str, str], torch.Tensor]] = []
        self._weights = weights
        self._handles: list[Any] = []
        for name, m in modules.items():
            self._handles.append(m.register_forward_pre_hook(self._pre(name)))
            self._handles.append(m.register_forward_hook(self._post(name)))

    def new_step(self) -> None:
        self.steps.append({})

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...]) -> None:
            if self.steps:
                self.steps[-1][(name, "input")] = args[0].detach().clone()
                for i, w in enumerate(self._weights(m)):
                    self.steps[-1][(name, f"weight{i}")] = w.detach().clone()
        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            y = out[0] if isinstance(out, tuple) else out
            if self.steps and y.requires_grad:
                step = self.steps[-1]
                y.register_hook(lambda g: step.__setitem__((name, "grad"), g.detach().clone()))
        return hook

    def amax(self, step: int, name: str, what: str) -> float:
        return float(self.steps[step][(name, what)].float().abs().max())

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def train_step(model: nn.Module, x: torch.Tensor, recipe: Any, opt: torch.optim.Optimizer | None = None) -> torch.Tensor:
    with te.autocast(enabled=True, recipe=recipe):
        y = model(x)
    y = y[0] if isinstance(y, tuple) else y
    loss = y.float().pow(2).mean()
    loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.detach()


def two_linears() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(te.Linear(128, 256, params_dtype=BF16), te.Linear(256, 128, params_dtype=BF16)).to(DEV)


def batch(step: int, rows: int = 64, cols: int = 128) -> torch.Tensor:
    # A different magnitude every step, so the scale and its history really move.
    g = torch.Generator(device=DEV).manual_seed(1000 + step)
    return (torch.randn(rows, cols, device=DEV, generator=g) * (2.0 ** (step % 4 - 1))).to(BF16)


def read(src: Any) -> torch.Tensor:
    out = torch.zeros(len(STATS), len(src.tensors()), device=DEV)
    src.read(out)
    return out


@pytest.fixture(autouse=True)
def fresh_te_state() -> Iterator[None]:
    # TE's registry of delayed-scaling tensors is global: start every test with a clean one.
    FP8GlobalStateManager.reset()
    yield
    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
