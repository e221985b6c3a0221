"""D6: a hung service (SIGSTOP) must never silently lose telemetry, nor hold training up.

A real ``fp8guard serve`` on 127.0.0.1 (SQLite in tmp_path) is stopped while a Monitor streams,
then continued; every step must be stored once the agent has caught up."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")

from bench._serve import serve_process  # noqa: E402
from fp8guard.agent import Monitor, MonitorConfig  # noqa: E402

STOP_S = float(os.environ.get("FP8GUARD_SIGSTOP_S", "4"))  # the issue measured 60 s; 4 s keeps CI short


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    with serve_process(f"sqlite:///{tmp_path / 'fp8guard.db'}") as served:
        yield served.base, served.proc


@pytest.mark.slow
def test_sigstop_loses_no_step_and_never_blocks_training(service: tuple[str, subprocess.Popen[bytes]],
                                                         tmp_path: Path) -> None:
    base, proc = service
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    # Timeouts scaled down (1 s per request, probes every 0.5 s) so a stop of a few seconds is
    # an outage; a flush every 10 steps, so many batches are in flight when it starts.
    cfg = MonitorConfig(url=base, run_id="hung-run", flush_interval_steps=10, flush_interval_s=0.1,
                        timeout_s=1.0, retry_max_s=0.5, spool_dir=tmp_path / "spool", tripwire=False)
    monitor = Monitor(cfg).attach(model, opt)
    x = torch.randn(4, 8)
    step = 0
    slowest = 0.0

    def train(seconds: float) -> None:
        nonlocal step, slowest
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            t0 = time.perf_counter()
            monitor.step(float(step))  # the loss is the step number: every stored value is checkable
            slowest = max(slowest, time.perf_counter() - t0)
            if step % 25 == 0:
                monitor.event("note", data={"step": step, "v": float("nan")})
            step += 1
            time.sleep(0.004)

    train(1.0)
    proc.send_signal(signal.SIGSTOP)
    try:
        train(STOP_S)
        stopped_at = step
    finally:
        proc.send_signal(signal.SIGCONT)
    train(3.0)
    monitor.close(timeout_s=60)
    assert stopped_at > 0 and step > stopped_at

    stats = monitor._shipper.transport.stats() if monitor._shipper else None
    assert stats is not None
    print(f"\nsteps={step} stopped_for={STOP_S}s spooled={stats.spooled_batches} "
          f"backfilled={stats.backfilled_batches} dropped_steps={stats.dropped_steps} slowest_step={slowest * 1e3:.1f}ms")
    assert stats.spooled_batches > 0  # the stop was felt: batches went to the spool ...
    assert stats.dropped_batches == 0 and stats.dropped_steps == 0  # ... and none was lost
    assert monitor._shipper is not None and monitor._shipper.stats().dropped == 0
    assert slowest < 0.5, f"a step waited {slowest:.3f} s for the network"

    stored: list[int] = []
    with httpx.Client(base_url=base, timeout=30) as c:
        for start in range(0, step, 2000):  # windows of 2000 steps read at full resolution (bucket 1)
            page = c.get("/v1/runs/hung-run/scalars", params={"fields": "loss", "start": start,
                                                                "end": start + 1999, "width": 2000}).json()
            assert page["bucket"] == 1
            assert page["min"]["loss"] == page["max"]["loss"] == [float(s) for s in page["steps"]]
            stored += page["steps"]
        events = c.get("/v1/runs/hung-run/events", params={"kind": "note", "limit": 100_000}).json()
        dropped = c.get("/v1/runs/hung-run/events", params={"kind": "telemetry_dropped"}).json()
    print(f"steps lost: {step - len(stored)}")
    assert stored == list(range(step)), f"{step - len(stored)} steps lost"
    assert sorted(e["data"]["step"] for e in events) == list(range(0, step, 25))
    assert {e["data"]["v"] for e in events} == {"NaN"}  # D7: the non-finite value came back as the protocol says
    assert dropped == []  # nothing was lost, so nothing to report
