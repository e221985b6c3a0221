"""The GPU benchmarks on a machine without a GPU: they skip with a reason, and the instability
script runs its whole story with the emulated FP8 backend (same loop, service and policy as on
the H200, only the FP8 casts are fp8guard's CPU emulation instead of Transformer Engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, timeout: int = 600) -> dict:  # type: ignore[type-arg]
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the benches would run for real")
@pytest.mark.parametrize("script", [["bench/gpu_counts.py", "verify"], ["bench/gpu_counts.py", "time"],
                                    ["bench/gpu_overhead.py"], ["bench/gpu_heal.py"], ["bench/gpu_dist.py"]])
def test_gpu_benches_skip_cleanly_without_a_gpu(script: list[str]) -> None:
    line = _run(*script, timeout=120)
    assert "skipped" in line and "GPU" in line["skipped"]


@pytest.mark.slow
def test_heal_story_with_emulated_fp8(tmp_path: Path) -> None:
    """The unit lights up at batch 60: the guarded run falls the implicated projections back to
    BF16 while the unguarded twin only records what it would have done; BF16 is untouched."""
    summary = _run("bench/gpu_heal.py", "--backend", "emulation", "--small", "--steps", "140", "--incident", "60",
                   "--incident-batches", "40", "--out", str(tmp_path))
    assert summary["first_finding_step"]["fp8_guarded"] is not None
    full = json.loads((tmp_path / "gpu_heal.json").read_text())
    guarded, unguarded = full["runs"]["fp8_guarded"], full["runs"]["fp8_unguarded"]
    assert any(e["kind"] == "fallback_applied" for e in guarded["agent_events"])
    assert unguarded["agent_events"] == []  # dry run: detected, never acted
    assert any(a["status"] == "recommended" for a in unguarded["actions"])
    rules = {f["rule"] for f in unguarded["findings"]}
    assert "amax_growth" in rules
    assert all(len(r["losses"]) == 140 for r in full["runs"].values())
    # the dormant unit's weights are zero: in high precision the injection changes nothing at all
    assert summary["val_loss"]["bf16"] > 0


@pytest.mark.slow
def test_dist_story_with_emulated_fp8_on_two_ranks(tmp_path: Path) -> None:
    """The two-GPU script's story with gloo and emulated FP8: the service's fallback and rollback
    reach rank 0 only and are applied by both ranks at the same steps; replicas stay identical."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FP8GUARD_RUN_ID", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "bench/gpu_dist.py", "--backend", "emulation", "--small", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_dist.json").read_text())
    assert result["world"] == 2 and result["one_reporting_rank"]
    assert result["same_commands_same_steps_on_every_rank"]
    assert {"fallback", "rollback"} <= set(result["kinds_applied"])
    assert result["replicas_identical_at_end"]
    assert [r["segment"] for r in result["ranks"]] == [1, 1]  # both ranks resumed in a new segment
