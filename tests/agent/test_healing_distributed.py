"""torchrun with gloo on the CPU: the README's healing loop under DDP. A rollback that only rank 0
receives is applied by every rank at the same step, restored at the next batch on every rank,
and the ranks go on in step (the same weights at the end)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")


@pytest.mark.slow
def test_a_rollback_heals_every_rank_of_a_ddp_loop(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FP8GUARD_RUN_ID", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
         str(Path(__file__).with_name("heal_worker.py")), str(tmp_path)],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        # received at step 12, applied at the every-5 broadcast (step 14), resumed at step 10
        assert [s for s, _ in r["seen"]] == [*range(0, 15), *range(10, 20)]
        assert r["seen"][15][1] == 10 + 2  # the checkpoint's data position, two batches skipped
        assert r["segment"] == 1 and r["checkpoints"] == [4, 9, 14, 19]
    assert ranks[0]["final_hash"] == ranks[1]["final_hash"]  # DDP stayed in step through the restore
