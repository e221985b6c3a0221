"""The closed loop in a process of its own (``fp8guard serve``'s default): its decisions reach a
long-poll at once, every batch is judged exactly once, a killed loop process is restarted, and a
shutdown judges what was acknowledged first. Real ``fp8guard serve`` processes, SQLite and
PostgreSQL."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import sqlalchemy as sa

from bench._serve import Served, serve_process
from fp8guard import wire
from fp8guard.service.loop import link
from fp8guard.service.store import make_engine
from fp8guard.service.store.models import SqlLoopQueue
from tests.helpers import batch
from tests.service.test_loop_pipeline import _inf_batch, _wait_for

_LOOP_PROCESS = {"FP8GUARD_LOOP_PROCESS": "1"}
"""``fp8guard serve --loop-process``: off by default (threads), on for these tests."""

pytestmark = pytest.mark.slow


def _post(c: httpx.Client, body: dict[str, Any]) -> httpx.Response:
    r = c.post("/v1/ingest", content=wire.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    return r


def _metric(c: httpx.Client, name: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "_total "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not on /metrics")


def _loop_child(served: Served) -> int:
    """The pid of the serving process's loop process (a spawned child; not the resource tracker)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == served.proc.pid and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return int(entry.name)
    raise AssertionError("no loop process found")


def _queued(url: str) -> int:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.scalar(sa.select(sa.func.count()).select_from(SqlLoopQueue)) or 0)
    finally:
        engine.dispose()


def _long_poll_fallback(c: httpx.Client, run: str, first_step: int, *, module: int = 0,
                        after: int = 0) -> tuple[list[dict[str, Any]], float]:
    """Long-poll the run's commands newer than ``after``, then send a batch with an infinite amax
    in module ``blocks.{module}.fc``: (commands, seconds from that batch's answer to the long-poll's)."""
    got: dict[str, Any] = {}

    def poll() -> None:
        with httpx.Client(base_url=str(c.base_url), timeout=60) as p:
            got["commands"] = p.get(f"/v1/runs/{run}/commands", params={"wait": 30, "after": after}).json()
            got["at"] = time.monotonic()

    waiter = threading.Thread(target=poll)
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()
    values = np.ones((10, 1, 12), dtype="<f4")
    values[-1, 0, 3 * module] = np.inf
    _post(c, batch(run, list(range(first_step, first_step + 10)), stats=("amax",), values=values, n_tensors=12,
                   define_tensors=False))
    answered = time.monotonic()
    waiter.join(40)
    return got["commands"], got["at"] - answered


def test_frames_split_wherever_the_stream_breaks() -> None:
    data = link.batch_frame(7, 42, True) + link.drained_frame(3, True) + link.batch_frame(8, None, False)
    frames = link.Frames()
    out = [f for i in range(len(data)) for f in frames.feed(data[i:i + 1])]
    assert [k for k, _ in out] == [link.Kind.BATCH, link.Kind.DRAINED, link.Kind.BATCH]
    assert link.read_batch(out[0][1]) == (7, 42, True) and link.read_batch(out[2][1]) == (8, None, False)
    assert link.read_drained(out[1][1]) == (3, True)


def test_a_decision_of_the_loop_process_wakes_the_long_poll_at_once(migrated_url: str) -> None:
    """The loop process sends the commands it issued back to the serving process, which wakes the
    long-poll: with the database re-read every 30 s, only that message can answer it in time."""
    env = {"FP8GUARD_COMMAND_POLL_INTERVAL_S": "30"}
    with serve_process(migrated_url, env={**_LOOP_PROCESS, **env}) as served, httpx.Client(base_url=served.base, timeout=60) as c:
        assert c.put("/v1/runs/lp", json={}).status_code == 201
        _post(c, batch("lp", list(range(10)), n_tensors=12))
        commands, seconds = _long_poll_fallback(c, "lp", 10)
        assert [x["kind"] for x in commands] == ["fallback"]
        assert seconds < 5  # typically a few ms; far below the 30 s re-read
        assert _loop_child(served)  # it was the loop process that decided
        _wait_for(lambda: _metric(c, "fp8guard_loop_commands") == 1, timeout=10)  # counters come back


def test_every_acknowledged_batch_is_judged_exactly_once(migrated_url: str) -> None:
    """Runs shipping back to back (gathered) and at a slower pace: once the queue is empty, the
    loop judged as many batches as were acknowledged, and each rank's detector is at its last step."""
    runs, per_run = [f"once-{i}" for i in range(4)], 15
    with serve_process(migrated_url, env=_LOOP_PROCESS) as served, httpx.Client(base_url=served.base, timeout=60) as c:
        for run in runs:
            assert c.put(f"/v1/runs/{run}", json={}).status_code == 201

        def send(run: str) -> None:
            with httpx.Client(base_url=served.base, timeout=60) as s:
                for k in range(per_run):
                    _post(s, batch(run, list(range(10 * k, 10 * k + 10)), n_tensors=12, define_tensors=k == 0))
                    if run.endswith("0"):
                        time.sleep(0.05)  # slower than loop_gather_s: judged one by one

        threads = [threading.Thread(target=send, args=(run,)) for run in runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        _wait_for(lambda: _queued(migrated_url) == 0, timeout=30)
        _wait_for(lambda: _metric(c, "fp8guard_loop_batches") >= len(runs) * per_run, timeout=10)
        time.sleep(1.2)  # a second judgement of a batch would be counted by now (stats every 0.5 s)
        assert _metric(c, "fp8guard_loop_batches") == len(runs) * per_run
    engine = make_engine(migrated_url)
    try:
        with engine.connect() as conn:
            steps = conn.execute(sa.text("SELECT last_step FROM detector_states")).scalars().all()
    finally:
        engine.dispose()
    assert sorted(steps) == [10 * per_run - 1] * len(runs)


def test_a_killed_loop_process_is_restarted_and_judges_what_it_missed(migrated_url: str) -> None:
    env = {"FP8GUARD_COMMAND_POLL_INTERVAL_S": "30"}
    with serve_process(migrated_url, env={**_LOOP_PROCESS, **env}) as served, httpx.Client(base_url=served.base, timeout=60) as c:
        assert c.put("/v1/runs/kill", json={}).status_code == 201
        _post(c, batch("kill", list(range(10)), n_tensors=12))
        first = _loop_child(served)
        os.kill(first, signal.SIGKILL)
        _post(c, _inf_batch("kill", range(10, 20), define_tensors=False))  # sent while it is dead
        commands = _wait_for(lambda: c.get("/v1/runs/kill/commands").json(), timeout=30)
        assert [x["kind"] for x in commands] == ["fallback"]
        assert _loop_child(served) != first
        assert _metric(c, "fp8guard_loop_restarts") == 1 and _metric(c, "fp8guard_loop_up") == 1
        assert "the loop process died" in served.log_text()
        # And the new one's decisions wake long-polls at once too.
        more, seconds = _long_poll_fallback(c, "kill", 20, module=1, after=commands[0]["id"])
        assert [x["kind"] for x in more] == ["fallback"] and more[0]["id"] > commands[0]["id"]
        assert seconds < 5  # the notification, not the database re-read every 30 s


def test_a_shutdown_judges_what_was_acknowledged(migrated_url: str) -> None:
    """Batches gathered for a second (``loop_gather_s=1``) when the service is told to stop are
    judged before it exits: nothing is left in the queue."""
    with serve_process(migrated_url, env={**_LOOP_PROCESS, "FP8GUARD_LOOP_GATHER_S": "1"}) as served, \
            httpx.Client(base_url=served.base, timeout=60) as c:
        assert c.put("/v1/runs/drain", json={}).status_code == 201
        for k in range(6):
            _post(c, batch("drain", list(range(10 * k, 10 * k + 10)), n_tensors=12, define_tensors=k == 0))
        assert _queued(migrated_url) > 0  # still gathering
        served.proc.terminate()
        assert served.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    assert _queued(migrated_url) == 0
