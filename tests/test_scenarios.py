"""Issue #11's targets on the scenario suite (``bench/scenarios.py``): seeded emulated-FP8 training
runs against the real service, at agent batch sizes 1 and 10.

One suite run serves every test (200 steps, no unguarded twins: about two minutes on two cores).
A target the suite does not meet yet is an ``xfail(strict=True)`` that names the reason, so it
turns red the day it is met and the marker must go.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

from bench.scenarios import run_suite, suite

BATCH_SIZES = (1, 10)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
"""The module's one suite run is set up inside its first test: about two minutes on a quiet
machine, past the default 300 s per test when CI shares the cores."""


@pytest.fixture(scope="module")
def board() -> dict[str, Any]:
    # heal_wide (the H200-shaped heal, #12) is left to `bench/scenarios.py`: a 4-block model that
    # doubles the suite's time and that no target here reads (docs/detection.md has its rows).
    return run_suite([s for s in suite(steps=200) if s.name != "heal_wide"], BATCH_SIZES, twins=False)["scenarios"]


def _runs(board: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return list(board[name]["by_batch_size"].values())


def test_healthy_seeds_get_no_remediation(board: dict[str, Any]) -> None:
    healthy = [n for n, s in board.items() if s["kind"] == "healthy"]
    assert len(healthy) == 3
    for name in healthy:
        for run in _runs(board, name):
            assert run["false_remediations"] == 0 and run["actions"] == [], (name, run["actions"])


def test_a_one_step_outlier_is_flagged_at_its_step_on_its_module(board: dict[str, Any]) -> None:
    s = board["weight_spike"]
    for run in _runs(board, "weight_spike"):
        first = run["first_finding"]
        assert first is not None and first["step"] == s["onset"], first
        assert first["modules"] == ["blocks.1.mlp_fc"], first
        assert run["false_remediations"] == 0, run["actions"]


def test_a_gradual_ramp_is_flagged_within_50_steps_naming_the_module_and_never_rolled_back(board: dict[str, Any]) -> None:
    s = board["weight_ramp"]
    for run in _runs(board, "weight_ramp"):
        first = run["first_finding"]
        assert first is not None and first["step"] - s["onset"] <= 50, first
        assert "blocks.1.mlp_fc" in first["modules"], first
        assert not any(a.startswith("rollback") for a in run["actions"]), run["actions"]


def test_an_lr_blowup_is_found_within_5_steps_and_rolled_back_never_fallen_back(board: dict[str, Any]) -> None:
    s = board["lr_blowup"]
    left = s["unguarded_loss_leaves_band_at"]
    assert left is not None and left <= 5, "the injection must blow the loss up at once"
    for run in _runs(board, "lr_blowup"):
        rollback_findings = [f for f in run["findings"]
                             if f[2] in ("loss_divergence", "grad_divergence", "loss_spike", "nonfinite")]
        assert rollback_findings and rollback_findings[0][1] - left <= 5, run["findings"][:5]
        assert run["first_action"] is not None and run["first_action"]["kind"] == "rollback", run["actions"]


def test_an_lr_blowup_is_never_fallen_back(board: dict[str, Any]) -> None:
    """The resumed, still too fast run pins its E5M2 scales again after the rollback; the harm
    probe measures no harm from them, so they are alerts (before the probe they were fallen back)."""
    for run in _runs(board, "lr_blowup"):
        assert run["false_remediations"] == 0, run["actions"]


def test_a_data_spike_is_rolled_back_never_fallen_back(board: dict[str, Any]) -> None:
    for run in _runs(board, "data_spike"):
        assert run["first_action"] is not None and run["first_action"]["kind"] == "rollback", run["actions"]
        assert run["first_finding"]["rule"] == "loss_spike"
        assert run["false_remediations"] == 0, run["actions"]


def test_the_heal_story_falls_back_where_the_harm_probe_measures_harm(board: dict[str, Any]) -> None:
    """Issue #12: the dormant unit hurts the loss through FP8 alone; the probe measures it, bisects
    it to modules, and the first fallback follows that measurement."""
    for run in _runs(board, "heal"):
        assert run["first_action"] is not None and run["first_action"]["kind"] == "fallback", run["actions"]
        harm = [f for f in run["findings"] if f[2] == "fp8_harm"]
        assert harm and harm[0][1] <= run["first_action"]["step"], run["findings"]
        assert run["false_remediations"] == 0, run["actions"]


def test_fp8_anomalies_the_probe_finds_harmless_stay_in_fp8(board: dict[str, Any]) -> None:
    """Issue #12: the one-step outlier and the ramp trip the FP8 rules but do not move the loss
    through FP8: findings and alerts, no fallback."""
    for name in ("weight_spike", "weight_ramp"):
        for run in _runs(board, name):
            assert run["findings"], name
            assert not any(a.startswith("fallback") for a in run["actions"]), (name, run["actions"])
            assert not any(f[2] == "fp8_harm" for f in run["findings"]), (name, run["findings"])


def test_findings_and_first_decisions_do_not_depend_on_the_batch_size(board: dict[str, Any]) -> None:
    for name, s in board.items():
        assert s["findings_identical"], (name, [r["findings"] for r in s["by_batch_size"].values()])
        assert s["first_decision_identical"], (name, [r["first_action"] for r in s["by_batch_size"].values()])


@pytest.mark.parametrize("batch_size", [1, 10])
def test_at_most_two_steps_from_the_anomaly_to_the_applied_command(board: dict[str, Any], batch_size: int) -> None:
    worst = {name: s["by_batch_size"][str(batch_size)]["max_steps_to_apply"] for name, s in board.items()}
    assert all(v is None or v <= 2 for v in worst.values()), worst
