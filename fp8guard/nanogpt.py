"""A small byte-level GPT (after nanoGPT) and real text every machine has: the Python
standard library's sources. Used by the demo, the benchmarks and the tests; nothing is
downloaded.
"""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPT", "GPTConfig", "TextBatches", "stdlib_text"]


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    vocab_size: int = 256
    """Bytes."""
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn_qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.attn_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.mlp_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn_qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        out: torch.Tensor = x + self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(x))))
        return out


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        # Untied head: FP8 emulation applies to nn.Linear, and the head is where logits saturate.
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def stdlib_text(max_bytes: int = 4_000_000) -> bytes:
    """Python source of the standard library (sorted, so every machine reads the same order)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for path in sorted(root.glob("*.py")):
        out += path.read_bytes()
        if len(out) >= max_bytes:
            break
    if len(out) < 10_000:
        raise RuntimeError(f"found too little Python source under {root}")
    return bytes(out[:max_bytes])


class TextBatches:
    """Deterministic random crops of a byte string, endless; ``position`` (the next batch's index)
    is saved and restored by ``state_dict``/``load_state_dict``, so ``monitor.batches(data)``
    can move it back after a rollback."""

    def __init__(self, data: bytes, *, block_size: int, batch_size: int, seed: int = 0) -> None:
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.block_size, self.batch_size, self.seed = block_size, batch_size, seed
        self.position = 0

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        starts = torch.randint(len(self.data) - self.block_size - 1, (self.batch_size,), generator=g)
        x = torch.stack([self.data[s:s + self.block_size] for s in starts.tolist()])
        y = torch.stack([self.data[s + 1:s + 1 + self.block_size] for s in starts.tolist()])
        return x, y

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        xy = self.batch(self.position)
        self.position += 1
        return xy

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next()

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
