"""torchrun with gloo on the CPU: a fallback and a rollback that only rank 0 receives are applied
by every rank at the same step, and after the rollback all ranks hold the checkpoint's weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_commands_apply_on_every_rank_at_the_same_step(tmp_path: Path, world: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FP8GUARD_RUN_ID", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--standalone",
         str(Path(__file__).with_name("rollback_worker.py")), str(tmp_path)],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]

    # the same commands, applied at the same steps, with the same outcome, on every rank
    timelines = [[(a["step"], a["kind"], a["status"], a["resume_step"]) for a in r["applied"]] for r in ranks]
    assert timelines == [[(14, "fallback", "applied", None), (19, "rollback", "applied", 10),
                          (24, "rollback", "failed", None)]] * world, [a["error"] for r in ranks for a in r["applied"]]
    last = world - 1
    for r in ranks:
        fallback, rollback, refused = r["applied"]
        # a checkpoint missing on one rank stops the rollback on all of them, and says where
        assert f"rank {last}: rank {last} has no checkpoint of step 14" in refused["error"]
        assert refused["param_hash"] != r["saved"]["14"]["param_hash"]  # nothing was restored
        assert not fallback["fp8_enabled"]["blocks.0.mlp_fc"]
        assert sum(fallback["fp8_enabled"].values()) == 4  # the other modules stay in FP8
        # after restoring: exactly the state this rank saved at step 9 (weights and FP8 metadata)
        assert rollback["checkpoint_step"] == 9
        assert rollback["param_hash"] == r["saved"]["9"]["param_hash"]
        assert rollback["state_hash"] == r["saved"]["9"]["state_hash"]
        assert not rollback["fp8_enabled"]["blocks.0.mlp_fc"]  # a rollback keeps the precision choice
        assert r["segment"] == 1 and r["resumed_position"] == 10 + 2
        assert r["done"] == [*range(0, 19), *range(10, 25)]
        assert r["checkpoints"] == ([4, 9, 19, 24] if r["rank"] == last else [4, 9, 14, 19, 24])
    # bit-identical weights across ranks after the rollback and at the end (DDP stayed in step)
    assert len({r["applied"][1]["param_hash"] for r in ranks}) == 1
    assert len({r["final_hash"] for r in ranks}) == 1
    assert ranks[0]["saved"]["9"]["param_hash"] == ranks[0]["applied"][1]["param_hash"]
