"""The GPU benchmarks' shared pieces: the Transformer Engine model of ``../shared/gpu/te_baseline.py``
(12 ``te.TransformerLayer``, hidden 2048, FFN 8192, 16 heads, bf16 parameters, about 604M
parameters; sequence 2048, batch 8; fused AdamW; loss mean(h**2); DelayedScaling HYBRID with a
1024-step amax history), the skip line, the result line (and file), and a log handler that keeps
the agent's warnings."""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def skip(bench: str, reason: str) -> None:
    print(json.dumps({"bench": bench, "skipped": reason}), flush=True)
    sys.exit(0)


def write_result(result: dict[str, Any], out: str | None, name: str) -> None:
    """Print ``result`` as one JSON line and, with ``out`` (a folder), write it there as ``name``."""
    line = json.dumps(result)
    print(line, flush=True)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / name).write_text(line + "\n")


def require_te(bench: str) -> tuple[Any, Any]:
    """(torch, transformer_engine.pytorch), or a skip line and exit 0 without CUDA/TE/FP8."""
    try:
        import torch
    except ImportError as exc:
        skip(bench, f"torch not importable: {exc}")
    if not torch.cuda.is_available():
        skip(bench, "needs a CUDA GPU (torch.cuda.is_available() is False)")
    try:
        import transformer_engine.pytorch as te
    except Exception as exc:  # ImportError, or TE's own load errors (missing libs)
        skip(bench, f"Transformer Engine not importable: {type(exc).__name__}: {exc}"[:300])
    ok = te.is_fp8_available()
    if isinstance(ok, tuple):
        ok, why = ok[0], ok[1]
    else:
        why = ""
    if not ok:
        skip(bench, f"FP8 not available on {torch.cuda.get_device_name()}: {why}")
    return torch, te


@dataclass
class Shape:
    layers: int = int(os.environ.get("L", 12))
    hidden: int = int(os.environ.get("H", 2048))
    seq: int = int(os.environ.get("S", 2048))
    batch: int = int(os.environ.get("B", 8))


class TEModel:
    """Model, optimizer, input and recipe; ``step()`` is one training step (optionally with a
    loss multiplier, used to provoke gradient overflows)."""

    def __init__(self, shape: Shape, *, history: int = 1024, te: Any = None, recipes: Any = None,
                 device: str = "cuda") -> None:
        """``te`` / ``recipes``: ``transformer_engine.pytorch`` and ``transformer_engine.common.recipe``
        by default; a CPU smoke run passes the stand-in of tests/fake_te.py for both."""
        import torch

        if te is None:
            import transformer_engine.pytorch as te
        if recipes is None:
            import transformer_engine.common.recipe as recipes

        self.te, self.torch, self.shape = te, torch, shape
        torch.manual_seed(0)
        h = shape.hidden
        self.model = torch.nn.ModuleList([
            te.TransformerLayer(h, 4 * h, max(1, h // 128), params_dtype=torch.bfloat16, hidden_dropout=0.0,
                                attention_dropout=0.0, fuse_qkv_params=True, layer_number=i + 1, name=f"layer{i}")
            for i in range(shape.layers)]).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        self.x = torch.randn(shape.seq, shape.batch, h, device=device, dtype=torch.bfloat16)
        self.set_to_none = True
        """How ``zero_grad`` clears the gradients (False: zeroed in place, at stable addresses)."""
        self.recipe = recipes.DelayedScaling(fp8_format=recipes.Format.HYBRID, amax_history_len=history,
                                             amax_compute_algo="max")

    def forward_backward(self, loss_scale: float = 1.0) -> Any:
        with self.te.autocast(enabled=True, recipe=self.recipe):
            h = self.x
            for layer in self.model:
                h = layer(h)
        loss = h.float().pow(2).mean()
        (loss * loss_scale if loss_scale != 1.0 else loss).backward()
        return loss

    def step(self, monitor: Any = None, loss_scale: float = 1.0) -> Any:
        loss = self.forward_backward(loss_scale)
        self.opt.step()
        if monitor is not None:
            monitor.step(loss)
        self.zero_grad()
        return loss

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=self.set_to_none)

    @property
    def params_m(self) -> int:
        return round(sum(p.numel() for p in self.model.parameters()) / 1e6)


class Records(logging.Handler):
    """Keeps the agent's warnings and errors, so a result can show that it never switched off."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname} {record.name}: {record.getMessage()}"[:300])
