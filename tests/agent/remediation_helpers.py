"""Shared by the checkpoint and remediation tests (test_checkpoint.py, test_remediation.py,
test_rollback.py): the tiny GPT and its text, a run (GPT with emulated FP8, AdamW, LambdaLR, batches
and a CheckpointManager) and its train step, snapshots of a model's state and their bit-exact
comparison, and ``_cmd``, which builds a parsed command.

Importing this module skips the importing test module unless torch imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from fp8guard.agent import emulate_fp8  # noqa: E402
from fp8guard.agent.checkpoint import CheckpointManager  # noqa: E402
from fp8guard.agent.commands import Command, parse_command  # noqa: E402
from fp8guard.agent.emulation import Fp8Emulation  # noqa: E402
from fp8guard.nanogpt import GPT, GPTConfig, TextBatches, stdlib_text  # noqa: E402

TINY = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)
TEXT = stdlib_text(60_000)


@dataclass
class Run:
    model: nn.Module
    fp8: Fp8Emulation
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    data: TextBatches
    ckpts: CheckpointManager


def _run(tmp_path: Path, *, every: int = 5, keep_last: int = 5, seed: int = 0) -> Run:
    torch.manual_seed(seed)
    model = GPT(TINY)
    fp8 = emulate_fp8(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    data = TextBatches(TEXT, block_size=TINY.block_size, batch_size=2, seed=seed)
    ckpts = CheckpointManager(tmp_path / "ckpt", model=model, optimizer=opt, scheduler=sched,
                              data_state=lambda: {"position": data.position},
                              load_data_state=lambda s: setattr(data, "position", s["position"]),
                              every_n_steps=every, keep_last=keep_last, rank=0)
    return Run(model, fp8, opt, sched, data, ckpts)


def _train_step(r: Run) -> torch.Tensor:
    x, y = r.data.next()
    _, loss = r.model(x, y)
    assert loss is not None
    loss.backward()
    r.fp8.update()
    r.opt.step()
    r.sched.step()
    r.opt.zero_grad()
    return loss.detach()


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def _cmd(kind: str, cid: int = 1, **kw: Any) -> Command:
    return parse_command({"id": cid, "kind": kind, **kw})
