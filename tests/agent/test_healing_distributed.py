"""torchrun with gloo on the CPU: the README's healing loop under DDP. A rollback that only one
rank receives (rank 0; or rank 1 when it is the only reporting rank) is applied by every rank at
the same step, restored at the next batch on every rank, and the ranks go on in step (the same
weights at the end)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")


@pytest.mark.slow
@pytest.mark.parametrize("receiver", [0, 1], ids=["rank0-receives", "only-rank1-reports"])
def test_a_rollback_heals_every_rank_of_a_ddp_loop(tmp_path: Path, receiver: int) -> None:
    """With ``report_ranks=[1]`` only rank 1 hears the service: the commands travel from it (the
    Monitor's ``command_rank``). Before, every rank took rank 0's empty inbox and rank 1's rollback
    was dropped, on every rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FP8GUARD_RUN_ID", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
         str(Path(__file__).with_name("heal_worker.py")), str(tmp_path), str(receiver)],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["command_rank"] for r in ranks] == [receiver, receiver]
    assert [r["reporting"] for r in ranks] == ([True, True] if receiver == 0 else [False, True])
    for r in ranks:
        # received at step 12, applied at the every-5 broadcast (step 14), resumed at step 10
        assert [s for s, _ in r["seen"]] == [*range(0, 15), *range(10, 20)]
        assert r["seen"][15][1] == 10 + 2  # the checkpoint's data position, two batches skipped
        assert r["segment"] == 1 and r["checkpoints"] == [4, 9, 14, 19]
    assert ranks[0]["final_hash"] == ranks[1]["final_hash"]  # DDP stayed in step through the restore
