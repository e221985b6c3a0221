"""torchrun with gloo, 2 processes on the CPU: one run identity, rank-aware reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("torch")

from bench._serve import serve


@pytest.mark.slow
def test_two_ranks_share_one_run(tmp_path: Path) -> None:
    with serve(f"sqlite:///{tmp_path / 'dist.db'}") as base:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("FP8GUARD_RUN_ID", None)
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
             str(Path(__file__).with_name("dist_worker.py")), base, str(tmp_path)],
            capture_output=True, text=True, timeout=240, env=env,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert ranks[0]["run_id"] == ranks[1]["run_id"]
        run_id = ranks[0]["run_id"]
        detail = httpx.get(f"{base}/v1/runs/{run_id}").json()
        # emulated FP8 keeps per-rank amax (no all-reduce), so by default both ranks report
        assert [r["rank"] for r in detail["ranks"]] == [0, 1]
        assert all(r["last_step"] == 4 for r in detail["ranks"])
        assert detail["world_size"] == 2 and detail["model"] == "ddp-tiny"
        a0 = httpx.get(f"{base}/v1/runs/{run_id}/tensors/0/series", params={"rank": 0}).json()
        a1 = httpx.get(f"{base}/v1/runs/{run_id}/tensors/0/series", params={"rank": 1}).json()
        assert a0["steps"] == a1["steps"] == [0, 1, 2, 3, 4]
        assert a0["max"] != a1["max"]  # different data shards, different input amax
