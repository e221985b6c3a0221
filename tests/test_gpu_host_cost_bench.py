"""bench/gpu_host_cost.py without a GPU: it skips cleanly, and ``--smoke`` runs every part of it on
the CPU over the TE stand-in (tests/fake_te.py). The smoke run proves the script runs and writes
its result; its timings are the CPU's and mean nothing for the H200."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, env: dict[str, str] | None = None) -> dict:  # type: ignore[type-arg]
    proc = subprocess.run([sys.executable, "bench/gpu_host_cost.py", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the bench would run for real")
def test_skips_cleanly_without_a_gpu() -> None:
    line = _run()
    assert "skipped" in line and "GPU" in line["skipped"]


@pytest.mark.slow
def test_smoke_runs_every_part_on_the_cpu(tmp_path: Path) -> None:
    # Under Triton's CPU interpreter (where Triton is installed) the table grad norm runs too.
    interpret = importlib.util.find_spec("triton") is not None
    summary = _run("--smoke", "--out", str(tmp_path / "host.json"),
                   env=dict(os.environ, TRITON_INTERPRET="1") if interpret else None)
    full = json.loads((tmp_path / "host.json").read_text())
    assert summary["smoke"] is True and full["transformer_engine"].startswith("stand-in")
    assert set(full["sweep"]) == {"2", "4", "8"} and set(full["ratios"]) == {"smoke_2x32", "smoke_4x32"}
    for layers, point in full["sweep"].items():
        assert "error" not in point, point
        assert point["columns"] == 12 * int(layers) and not point["monitor_broken"]
        assert point["monitor_step_host_us_in_loop"]["n"] == 4 and point["monitor_buffers_bytes"] > 0
        # the tripwire's check alone, both ways where the kernel runs (timings: the CPU's, meaningless)
        assert point["tripwire_backend"] == "torch"  # auto: the kernel on CUDA only
        assert set(point["tripwire_check_host_us_idle"]) == ({"triton", "torch"} if interpret else {"torch"})
    for result in full["ratios"].values():
        assert "error" not in result, result
        assert result["ratio"] > 0 and not result["monitor_broken"]
        # the monitor's default norm, and foreach beside it exactly where the default is the table
        table = result["grad_norm_backend"] == "table"
        assert result["modes"] == ["plain", "monitor"] + (["monitor_foreach"] if table else [])
        assert ("foreach_ratio" in result) == table
        assert not table or result["foreach_ratio"] > 0
        # every round's paired ratio kept; the smoke run's 2 rounds are too few for an interval,
        # so its verdict can only be unresolved (tests/test_bench_paired.py covers the interval)
        for key in ("paired", *(("foreach_paired",) if table else ())):
            paired = result[key]
            assert len(paired["paired_ratios"]) == result["rounds"] == 2 and paired["target"] == 1.005
            assert paired["paired_ratio_interval"] is None and paired["verdict"] == "unresolved"
    assert full["agent_log"] == []


@pytest.mark.slow
def test_smoke_with_gradients_kept_in_a_buffer(tmp_path: Path) -> None:
    """``--grads keep``: every loop zeroes in place and the monitor keeps the gradients as views of
    its buffer, which holds through the whole run (steady steps walk no gradient)."""
    summary = _run("--smoke", "--grads", "keep", "--parts", "sweep", "--layers", "2,4",
                   "--out", str(tmp_path / "host.json"))
    full = json.loads((tmp_path / "host.json").read_text())
    assert summary["grads"] == "keep" and full["zero_grad_set_to_none"] is False
    for point in full["sweep"].values():
        assert "error" not in point, point
        state = point["grad_buffer"]
        assert state["state"] == "adopted" and state["readopted"] == 0 and state["bytes"] > 0
        # the first step, then one per change of what the bench does between norms; the timed steps none
        assert state["full_checks"] <= 4, state
    assert full["agent_log"] == []
