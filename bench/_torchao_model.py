"""The model of ``bench/gpu_torchao.py``, the loop that trains it in every mode, and the switch that
leaves torchao alone for a plain block (``source_off``).

The model: ``--layers`` transformer-like blocks (LayerNorm, a fused qkv ``nn.Linear``, causal
SDPA, an output projection, a 4x MLP with a biased ``fc1``), bf16 parameters, converted with
``convert_to_float8_training`` (every ``nn.Linear``) under each recipe of ``--recipes``
(``tensorwise``, ``rowwise``); AdamW (fused on CUDA), loss MSE to a fixed target, eager mode.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any


def _build(torch: Any, float8: Any, a: argparse.Namespace, recipe: str, device: str,
           dtype: Any) -> tuple[Any, Any, Any, Any]:
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self, h: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.qkv, self.proj = nn.Linear(h, 3 * h, bias=False), nn.Linear(h, h, bias=False)
            self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h, bias=False)

        def forward(self, x: Any) -> Any:
            b, s, h = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
            x = x + self.proj(att)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    torch.manual_seed(0)
    model = nn.Sequential(*[Block(a.hidden, a.heads) for _ in range(a.layers)]).to(device=device, dtype=dtype)
    cfg = float8.Float8LinearConfig.from_recipe_name(recipe)
    if device == "cpu":
        cfg = dataclasses.replace(cfg, emulate=True)
    float8.convert_to_float8_training(model, config=cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, **({"fused": True} if device == "cuda" else {}))
    x = torch.randn(a.batch, a.seq, a.hidden, device=device, dtype=dtype)
    y = 0.5 * torch.randn(a.batch, a.seq, a.hidden, device=device, dtype=dtype)
    return model, opt, x, y


class Loop:
    """One model and the steps of every mode; ``step`` never syncs."""

    def __init__(self, torch: Any, model: Any, opt: Any, x: Any, y: Any, autocast: bool = False) -> None:
        self.torch, self.model, self.opt, self.x, self.y, self.autocast = torch, model, opt, x, y, autocast
        self.monitor: Any = None

    def forward_backward(self) -> Any:
        torch = self.torch
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()
        with ctx:
            out = self.model(self.x)
        loss = torch.nn.functional.mse_loss(out.float(), self.y.float())
        loss.backward()
        return loss

    def step(self, mode: str = "plain", step: int | None = None) -> Any:
        loss = self.forward_backward()
        norm = None
        if mode.endswith("_clip"):
            norm = self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        if mode.startswith("monitor"):
            self.monitor.step(loss, grad_norm=norm, step=step)
        self.opt.zero_grad(set_to_none=True)
        return loss


@contextlib.contextmanager
def source_off(model: Any) -> Iterator[None]:
    """torchao alone for a plain block: every module hook (the source's count hooks, or its hooks
    fallback) detached and torchao's functions unwrapped (no amax read back); all back after."""
    from fp8guard.agent.sources.torchao_capture import unwrapped

    saved = [(m, m._forward_pre_hooks, m._backward_pre_hooks) for m in model.modules()]
    for m, _, _ in saved:
        m._forward_pre_hooks, m._backward_pre_hooks = type(m._forward_pre_hooks)(), type(m._backward_pre_hooks)()
    try:
        with unwrapped():
            yield
    finally:
        for m, fwd, bwd in saved:
            m._forward_pre_hooks, m._backward_pre_hooks = fwd, bwd
