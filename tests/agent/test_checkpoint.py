"""CheckpointManager on the CPU: bit-exact round trips (parameters, optimizer, scheduler, RNGs, data
position), saving every n steps, atomic writes, stale temp files, pruning that keeps the newest
known-good checkpoint, and validation errors that say what to change.

Fallback and promotion are in test_remediation.py, rollback in test_rollback.py; their shared run
and helpers in remediation_helpers.py.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from fp8guard.agent.checkpoint import CheckpointManager  # noqa: E402
from fp8guard.agent.errors import CheckpointError  # noqa: E402
from tests.agent.remediation_helpers import _assert_same_state, _run, _snapshot, _train_step  # noqa: E402


def _flat_optimizer_state(opt: torch.optim.Optimizer) -> list[Any]:
    out: list[Any] = []
    for pid, st in sorted(opt.state_dict()["state"].items()):
        for key, v in sorted(st.items()):
            out.append((pid, key, v.clone() if isinstance(v, torch.Tensor) else v))
    return out


def _assert_same_optimizer_state(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b) and a
    for (pa, ka, va), (pb, kb, vb) in zip(a, b, strict=True):
        assert (pa, ka) == (pb, kb)
        if isinstance(va, torch.Tensor):
            assert torch.equal(va, vb), f"optimizer state {pa}/{ka} differs"
        else:
            assert va == vb


# -- CheckpointManager -----------------------------------------------------------------------------


def test_round_trip_restores_params_optimizer_rng_and_data_bit_exactly(tmp_path: Path) -> None:
    r = _run(tmp_path)
    for _ in range(3):
        _train_step(r)
    params, opt_state = _snapshot(r.model), _flat_optimizer_state(r.opt)
    sched_state, position = r.sched.state_dict(), r.data.position
    path = r.ckpts.save(2, extra={"monitor": {"next_step": 3, "segment": 0}})
    assert path.name == "ckpt-rank0-step000000002.pt" and r.ckpts.steps() == [2]
    # the draws that should follow the checkpoint
    draws = (torch.rand(4), random.random(), np.random.rand(3))
    next_loss = _train_step(r)
    for _ in range(3):
        _train_step(r)
    assert not torch.equal(next(iter(r.model.parameters())), next(iter(params.values())))

    extra = r.ckpts.load(2)

    assert extra == {"monitor": {"next_step": 3, "segment": 0}}
    _assert_same_state(_snapshot(r.model), params)  # weights and the FP8 amax histories and scales
    assert any(k.endswith("fp8_amax_history_fwd") for k in params)
    _assert_same_optimizer_state(_flat_optimizer_state(r.opt), opt_state)
    assert r.sched.state_dict() == sched_state and r.opt.param_groups[0]["lr"] == r.sched.get_last_lr()[0]
    assert r.data.position == position
    assert torch.equal(torch.rand(4), draws[0])
    assert random.random() == draws[1]
    assert np.array_equal(np.random.rand(3), draws[2])
    # the whole training state is back: replaying the next step gives the same loss to the bit
    torch.manual_seed(123)  # disturb the RNG, then restore it once more
    random.seed(5)
    r.ckpts.load(2)
    assert torch.equal(_train_step(r), next_loss)


def test_maybe_save_every_n_completed_steps(tmp_path: Path) -> None:
    r = _run(tmp_path, every=5)
    saved = [s for s in range(12) if r.ckpts.maybe_save(s) is not None]
    assert saved == [4, 9] and r.ckpts.steps() == [4, 9]
    assert r.ckpts.latest_at_or_before(8) == 4 and r.ckpts.latest_at_or_before(9) == 9
    assert r.ckpts.latest_at_or_before(3) is None


def test_a_crash_mid_write_leaves_the_previous_checkpoints_intact(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    r = _run(tmp_path)
    _train_step(r)
    good = r.ckpts.save(4)
    before = good.read_bytes()

    def crash(obj: object, f: Any, *a: Any, **k: Any) -> None:
        f.write(b"half a checkpoint")
        raise OSError("No space left on device")

    _train_step(r)
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="No space left"):
        r.ckpts.save(9)
    with pytest.raises(OSError, match="No space left"):
        r.ckpts.save(4)  # overwriting an existing checkpoint fails too: the old one stays
    monkeypatch.undo()
    assert sorted(os.listdir(r.ckpts.directory)) == [good.name]  # no torn file, no temp file left
    assert good.read_bytes() == before and r.ckpts.steps() == [4]
    r.ckpts.load(4)


def test_stale_temp_files_of_a_killed_writer_are_removed(tmp_path: Path) -> None:
    r = _run(tmp_path)
    stale = r.ckpts.directory / ".ckpt-rank0-step000000009.pt.abc123.tmp"
    stale.write_bytes(b"torn")
    other_rank = r.ckpts.directory / ".ckpt-rank1-step000000009.pt.abc123.tmp"
    other_rank.write_bytes(b"rank 1 may be writing this right now")
    CheckpointManager(r.ckpts.directory, model=r.model, rank=0)
    assert not stale.exists() and other_rank.exists()


def test_keep_last_never_prunes_the_newest_known_good(tmp_path: Path) -> None:
    r = _run(tmp_path, every=1, keep_last=2)
    for s in range(3):
        r.ckpts.save(s)
    assert r.ckpts.steps() == [1, 2]
    r.ckpts.mark_known_good(1)
    for s in range(3, 6):
        r.ckpts.save(s)
    assert r.ckpts.steps() == [1, 4, 5] and r.ckpts.known_good() == [1]
    r.ckpts.mark_known_good(4)  # 1 is no longer the newest known-good one: it may go
    assert r.ckpts.steps() == [4, 5] and r.ckpts.known_good() == [4]
    r.ckpts.save(6)
    r.ckpts.save(7)
    assert r.ckpts.steps() == [4, 6, 7] and r.ckpts.known_good() == [4]
    index = json.loads((r.ckpts.directory / "index-rank0.json").read_text())
    assert index["known_good"] == [4] and index["rank"] == 0
    # a second manager (a restarted job) sees the same marks
    again = CheckpointManager(r.ckpts.directory, model=r.model, every_n_steps=1, keep_last=2, rank=0)
    assert again.known_good() == [4]


def test_validation_errors_say_what_to_change(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="every_n_steps must be an int >= 1"):
        CheckpointManager(tmp_path, model=model, every_n_steps=0)
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, model=model, keep_last=0)
    with pytest.raises(ValueError, match="together"):
        CheckpointManager(tmp_path, model=model, data_state=dict)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        CheckpointManager(a_file, model=model)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable"):
            CheckpointManager(locked, model=model)
    ckpts = CheckpointManager(tmp_path / "ok", model=model, rank=0)
    ckpts.save(3)
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 7 .*steps: \[3\]"):
        ckpts.load(7)
    with pytest.raises(CheckpointError, match="cannot mark step 7"):
        ckpts.mark_known_good(7)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        ckpts.save(-1)
    other = CheckpointManager(tmp_path / "ok", model=nn.Sequential(nn.Linear(2, 3)), rank=0)
    with pytest.raises(CheckpointError, match="differ in shape"):
        other.load(3)
    with pytest.raises(ValueError, match="skipping batches needs"):
        ckpts.skip_batches(2)
