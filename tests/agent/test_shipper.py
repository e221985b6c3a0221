"""Shipper: ordered hand-off on a daemon thread, drop-oldest on a full queue, errors survived."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fp8guard import wire
from fp8guard.agent.shipper import Shipper
from fp8guard.agent.transport import HttpTransport, RunInfo, TransportStats
from tests.helpers import batch

LOGGER = "fp8guard.agent.shipper"


class Recording:
    """Records payloads; optionally blocks each send until ``release`` is set."""

    def __init__(self, block: bool = False, fail_on: Any = None) -> None:
        self.payloads: list[dict[str, Any]] = []
        self.threads: set[str] = set()
        self.started = threading.Event()
        self.release = threading.Event()
        if not block:
            self.release.set()
        self.fail_on = fail_on
        self.closed = 0

    def send(self, payload: dict[str, Any]) -> None:
        self.threads.add(threading.current_thread().name)
        self.started.set()
        assert self.release.wait(10), "test forgot to release the transport"
        if payload.get("i") == self.fail_on:
            raise RuntimeError("transport broke its promise")
        self.payloads.append(payload)

    def close(self) -> None:
        self.closed += 1

    def stats(self) -> TransportStats:
        return TransportStats(sent_batches=len(self.payloads))

    def ids(self) -> list[Any]:
        return [p["i"] for p in self.payloads]


def thunk(i: int) -> Any:
    return lambda: {"i": i}


def test_order_is_preserved_and_thunks_run_on_the_shipper_thread() -> None:
    transport = Recording()
    shipper = Shipper(transport, max_queue=1000, name="ship-test")
    for i in range(200):
        shipper.submit(thunk(i))
    assert shipper.flush(5)
    assert transport.ids() == list(range(200))
    assert transport.threads == {"ship-test"}
    s = shipper.stats()
    assert (s.submitted, s.processed, s.dropped, s.errors, s.queued) == (200, 200, 0, 0, 0)
    shipper.close()
    assert transport.closed == 1


def test_full_queue_drops_the_oldest_without_blocking() -> None:
    transport = Recording(block=True)
    shipper = Shipper(transport, max_queue=4)
    shipper.submit(thunk(0))
    assert transport.started.wait(5)  # item 0 is inside send(), blocked
    t0 = time.perf_counter()
    for i in range(1, 8):
        shipper.submit(thunk(i))
    assert time.perf_counter() - t0 < 0.5  # never waited for the transport
    s = shipper.stats()
    assert (s.dropped, s.queued) == (3, 4)
    assert not shipper.flush(0.05)  # still blocked
    transport.release.set()
    assert shipper.flush(5)
    assert transport.ids() == [0, 4, 5, 6, 7]  # 1, 2, 3 were the oldest waiting
    shipper.close()


def test_errors_in_thunks_and_sends_are_logged_and_the_thread_survives(caplog: pytest.LogCaptureFixture) -> None:
    transport = Recording(fail_on=2)

    def bad() -> dict[str, Any]:
        raise ValueError("thunk bug")

    shipper = Shipper(transport)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        shipper.submit(thunk(0))
        shipper.submit(bad)
        shipper.submit(thunk(1))
        shipper.submit(thunk(2))  # the transport raises
        shipper.submit(thunk(3))
        assert shipper.flush(5)
    assert transport.ids() == [0, 1, 3]
    assert shipper.stats().errors == 2 and shipper.stats().processed == 5
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and errors[0].exc_info is not None and "thunk bug" in str(errors[0].exc_info[1])
    shipper.close()


def test_close_flushes_then_closes_the_transport_and_is_idempotent() -> None:
    class Slow(Recording):
        def send(self, payload: dict[str, Any]) -> None:
            time.sleep(0.002)
            super().send(payload)

    transport = Slow()
    shipper = Shipper(transport)
    for i in range(20):
        shipper.submit(thunk(i))
    shipper.close()
    assert transport.ids() == list(range(20)) and transport.closed == 1
    shipper.close()
    assert transport.closed == 1
    shipper.submit(thunk(99))  # after close: dropped, never raises
    assert shipper.stats().dropped == 1 and transport.ids()[-1] == 19


def test_close_gives_up_on_a_stuck_transport(caplog: pytest.LogCaptureFixture) -> None:
    transport = Recording(block=True)
    shipper = Shipper(transport, max_queue=8)
    for i in range(3):
        shipper.submit(thunk(i))
    assert transport.started.wait(5)
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        shipper.close(timeout_s=0.1)
    assert time.perf_counter() - t0 < 2
    assert transport.closed == 0  # not closed under the busy thread's feet
    assert shipper.stats().dropped == 2  # the two still queued
    assert any("not closing it" in r.message for r in caplog.records)
    transport.release.set()  # let the daemon thread finish


def test_invalid_queue_size() -> None:
    with pytest.raises(ValueError, match="max_queue must be an int >= 1"):
        Shipper(Recording(), max_queue=0)


def test_shipper_with_http_transport_end_to_end(client: Any, tmp_path: Path) -> None:
    transport = HttpTransport("http://testserver", RunInfo("shipped", model="tiny"), client=client,
                              spool_dir=tmp_path)
    shipper = Shipper(transport)
    for i in range(5):
        steps = list(range(10 * i, 10 * i + 10))
        shipper.submit(lambda steps=steps, first=i == 0: batch("shipped", steps, define_tensors=first))
    shipper.submit(lambda: wire.make_batch(run_id="shipped", events=[{"kind": "run_finished", "step": 49}]))
    shipper.close()
    assert transport.stats().sent_batches == 6
    assert client.get("/v1/runs/shipped/scalars", params={"fields": "loss"}).json()["steps"] == list(range(50))
    assert client.get("/v1/runs/shipped").json()["status"] == "finished"
