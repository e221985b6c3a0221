"""The README's main command, end to end: ``fp8guard demo --exit`` recovers and says so."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")


@pytest.mark.slow
def test_demo_recovers_and_ends_with_a_json_line(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fp8guard", "demo", "--exit", "--port", "0",
         "--database-url", f"sqlite:///{tmp_path / 'demo.db'}"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["recovered"] is True
    assert "rollback" in summary["actions"]
    # the outliers trip the FP8 rules, but the harm probe measures no harm from them: FP8 stays on
    assert "fallback" not in summary["actions"]
    gap = summary["fp8_loss_gap"]
    assert gap["probes"] >= 20 and gap["max"] < 0.01 and gap["attributed"] is None
    assert summary["findings"] >= 2 and summary["final_loss"] < summary["pre_incident_loss"]
    assert "Timeline" in proc.stderr and "FP8 cost to the loss (harm probe" in proc.stderr
    # the tripwire ships at once and the agent listens: every command applies within two steps
    assert summary["max_steps_to_apply"] is not None and summary["max_steps_to_apply"] <= 2
