"""What the framework-integration tests (tests/agent/test_integrations*.py) share: the tiny GPT in
emulated FP8 that every framework trains, its batches, and the warning filters Lightning needs."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from fp8guard.agent import emulate_fp8
from fp8guard.nanogpt import GPT, GPTConfig

TINY = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)

PL_WARNINGS = (
    # The data is a list of in-memory batches: worker processes would only slow a few-step test down.
    "ignore:The 'train_dataloader' does not have many workers:UserWarning",
    # Lightning 2.6 still builds torch's LeafSpec, which torch 2.13 deprecates.
    r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning",
)


def pl_warnings(f: Any) -> Any:
    """Marks a Lightning test with :data:`PL_WARNINGS`."""
    for w in PL_WARNINGS:
        f = pytest.mark.filterwarnings(w)(f)
    return f


def batches(n: int, *, batch_size: int = 2, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` random (input, target) batches of TINY's block size, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, TINY.vocab_size, (batch_size, TINY.block_size + 1), generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def tiny_gpt() -> tuple[GPT, Any]:
    """The tiny GPT from seed 0 with its linears in emulated FP8, and the emulation's handle."""
    torch.manual_seed(0)
    gpt = GPT(TINY)
    return gpt, emulate_fp8(gpt)


class TinyGPT(torch.nn.Module):
    """The tiny GPT from seed 0 (``self.gpt``) in emulated FP8 (``self.fp8``), for the Trainer and
    plain loops to wrap: subclasses write ``forward``. ``update_after_backward``: the emulation's
    scales update once per forward/backward pair, after the backward reaches the last layer."""

    def __init__(self, *, update_after_backward: bool = True) -> None:
        super().__init__()
        self.gpt, self.fp8 = tiny_gpt()
        if update_after_backward:
            self.gpt.lm_head.weight.register_post_accumulate_grad_hook(lambda p: self.fp8.update())


@functools.cache
def lightning_tiny_gpt() -> Any:
    """The LightningModule base of the Lightning tests (skips without Lightning): the tiny GPT
    from seed 0 (``self.gpt``) in emulated FP8 (``self.fp8``); subclasses write the steps."""
    pytest.importorskip("lightning")
    from lightning.pytorch import LightningModule

    class TinyGPTModule(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gpt, self.fp8 = tiny_gpt()

    return TinyGPTModule
