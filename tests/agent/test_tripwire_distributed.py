"""torchrun with gloo, 2 processes on the CPU, against a real ``fp8guard serve``: when the
tripwire's shared quantity (the gradient norm after DDP's all-reduce) goes NaN at step s, every
rank applies the service's command at the same step, s + 2 at the default configuration, not
at the next every-10-steps broadcast; a healthy run never enters an extra broadcast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")

from bench._serve import serve

POISON = 25
WORLD = 2
WAIT_S = 2.0
"""Rank 0's longest wait for the decision at the extra broadcast (default 0.25 s; it ends as soon
as the command arrives). This test box has 2 cores shared with other jobs: a loaded service
sometimes took longer than 0.25 s to decide, and the command then applied at a later broadcast.
Every cadence is the default; docs/closed-loop.md has the figures measured at the defaults."""


def _torchrun(base: str, run_id: str, out: Path, poison: int, steps: int, injection: str = "nan",
              wait_s: float = WAIT_S) -> list[dict[str, Any]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FP8GUARD_RUN_ID", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--standalone",
         str(Path(__file__).with_name("tripwire_worker.py")), base, run_id, str(out), str(poison), str(steps),
         injection, str(wait_s)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.slow
def test_a_shared_anomaly_is_answered_on_every_rank_within_two_steps(tmp_path: Path) -> None:
    with serve(f"sqlite:///{tmp_path / 'trip.db'}") as base:
        ranks = _torchrun(base, "dist-tripwire", tmp_path, POISON, 40)
        with httpx.Client(base_url=base, timeout=30) as api:
            findings = api.get("/v1/runs/dist-tripwire/findings").json()
            actions = api.get("/v1/runs/dist-tripwire/actions").json()

    # every rank applied the same commands at the same steps
    timelines = [[(a["step"], a["id"], a["kind"], a["status"]) for a in r["applied"]] for r in ranks]
    assert timelines[0] == timelines[1] and timelines[0], timelines
    first_step, first_id, kind, status = timelines[0][0]
    assert (kind, status) == ("rollback", "applied"), ranks[0]["applied"]
    # ... the service's command, answering the NaN of step POISON, applied at most 2 steps later:
    # an extra broadcast (the every-N ones fall at steps 9, 19, 29, ...)
    nonfinite = [f for f in findings if f["step"] == POISON]
    assert nonfinite, findings
    action = next(a for a in actions if a["id"] == first_id)
    assert action["status"] == "applied" and action["applied_step"] == first_step
    seen = min(f["step"] for f in findings if f["id"] in (action.get("finding_ids") or []))
    assert seen == POISON
    assert first_step - seen <= 2, (first_step, seen)
    for r in ranks:
        assert first_step in r["broadcasts"] and (first_step + 1) % 10 != 0
        assert r["tripwire_broadcasts"] >= 1
    print(f"\nsteps from anomaly (step {seen}) to applied command on every rank: {first_step - seen}; "
          f"{ranks[0]['calls']} steps in {ranks[0]['seconds']:.1f} s; deferred waits {[r['waits'] for r in ranks]}")


@pytest.mark.slow
def test_a_healthy_run_never_enters_an_extra_broadcast(tmp_path: Path) -> None:
    with serve(f"sqlite:///{tmp_path / 'healthy.db'}") as base:
        ranks = _torchrun(base, "dist-healthy", tmp_path, -1, 30)
    for r in ranks:
        assert r["applied"] == []
        assert r["tripwire_broadcasts"] == 0
        assert r["broadcasts"] == [9, 19, 29]  # the every-10 broadcasts only


@pytest.mark.slow
def test_all_reduced_verdicts_bring_one_ranks_own_anomaly_to_every_rank(tmp_path: Path) -> None:
    """``tripwire_all_reduce``: an outlier that only the last rank's amaxes see (the emulation keeps
    per-rank amaxes) makes every rank enter the extra broadcast at the same boundary, 2 steps later."""
    with serve(f"sqlite:///{tmp_path / 'outlier.db'}") as base:
        ranks = _torchrun(base, "dist-outlier", tmp_path, POISON, 30, "outlier")
    for r in ranks:
        assert r["tripwire_broadcasts"] == 1
        assert sorted(r["broadcasts"]) == [9, 19, POISON + 2, 29]
