"""HttpTransport through outages, against a fake service (httpx.MockTransport): the disk spool in send
order, the circuit breaker's probes and the backfill in order, rate-limited warnings, the spool's
bound and the reports of what it dropped, restarts, close(), and the default spool directory. No
real sleeping: ``sleep`` and ``clock`` are injected.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from fp8guard import wire
from fp8guard.agent.transport import HttpTransport
from tests.agent.transport_fakes import (
    LOGGER,
    RUN,
    URL,
    FakeService,
    Rig,
    make_rig_fixture,  # noqa: F401 - fixture
    small,
)
from tests.helpers import tensor_defs

# ---------------------------------------------------------------------- spool, breaker, backfill


def test_connection_errors_spool_in_send_order(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(FakeService(up=False), max_attempts=3)
    for i in range(4):
        rig.clock.advance(1.0)  # well inside backoff_max_s: the breaker stays open
        rig.transport.send(small(i))
    # only the first batch paid for retries; the others went straight to disk
    assert len(rig.service.seen) == 3 and len(rig.sleeps) == 2
    assert rig.spool_files() == [f"{n:012d}.json.gz" for n in (1, 2, 3, 4)]
    assert rig.spooled_ids() == ["batch-0000", "batch-0001", "batch-0002", "batch-0003"]
    s = rig.transport.stats()
    assert (s.spooled_batches, s.sent_batches, s.retries) == (4, 0, 2)


def test_breaker_probes_at_most_every_backoff_max_then_backfills_in_order(
        make_rig: Callable[..., Rig], caplog: pytest.LogCaptureFixture) -> None:
    rig = make_rig(FakeService(up=False), max_attempts=4, backoff_max_s=5.0)
    svc, t = rig.service, rig.transport
    with caplog.at_level(logging.INFO, logger=LOGGER):
        t.send(small(0))
        assert len(svc.seen) == 4  # PUT failing, 4 attempts
        rig.clock.advance(4.9)
        t.send(small(1))
        assert len(svc.seen) == 4  # breaker open: no request at all
        rig.clock.advance(0.2)
        t.send(small(2))
        assert len(svc.seen) == 5  # one single-attempt probe, which failed
        svc.up = True
        rig.clock.advance(1.0)
        t.send(small(3))
        assert len(svc.seen) == 5  # the probe failed 1 s ago: still waiting
        rig.clock.advance(5.0)
        t.send(small(4))
    assert svc.posted_ids() == [f"batch-{i:04d}" for i in range(5)]
    assert list(svc.stored) == [f"batch-{i:04d}" for i in range(5)]
    assert rig.spool_files() == []
    s = t.stats()
    assert (s.sent_batches, s.spooled_batches, s.backfilled_batches, s.dropped_batches) == (5, 4, 4, 0)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0].message  # the first failure only
    assert any("reachable again" in r.message and "4 spooled batches backfilled" in r.message
               for r in caplog.records if r.levelno == logging.INFO)
    rig.transport.send(small(5))  # back to normal
    assert svc.posted_ids()[-1] == "batch-0005" and rig.spool_files() == []


def test_warnings_are_rate_limited_while_down(make_rig: Callable[..., Rig],
                                              caplog: pytest.LogCaptureFixture) -> None:
    rig = make_rig(FakeService(up=False), backoff_max_s=5.0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for i in range(60):  # 5 minutes of one batch every 5 s, each one a probe
            rig.transport.send(small(i))
            rig.clock.advance(5.0)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert 2 <= len(warnings) <= 1 + 5
    assert "still unreachable" in warnings[-1].message
    assert rig.transport.stats().spooled_batches == 60


def test_spool_bound_drops_oldest_and_next_batch_reports_it(make_rig: Callable[..., Rig],
                                                            tmp_path: Path) -> None:
    rnd = np.random.default_rng(0)

    def noisy(i: int) -> dict[str, Any]:
        steps = list(range(10 * i, 10 * i + 10))
        data = rnd.random((10, 1, 50)).astype("<f4")  # incompressible: every file has about the same size
        return wire.make_batch(run_id="run-1", batch_id=f"batch-{i:04d}", tensors=tensor_defs(50) if i == 0 else (),
                               steps=[{"step": s, "loss": 1.0} for s in steps],
                               tensor_stats=[wire.tensor_stats_block(stats=["amax"], steps=steps, n_tensors=50,
                                                                     data=data.tobytes())])

    one_file = len(wire.gzip_body(wire.dumps(noisy(99))))
    rig = make_rig(FakeService(up=False), spool_max_bytes=int(2.5 * one_file))
    for i in range(5):
        rig.transport.send(noisy(i))
    assert rig.spooled_ids() == ["batch-0003", "batch-0004"]
    s = rig.transport.stats()
    assert (s.spooled_batches, s.dropped_batches, s.dropped_steps) == (5, 3, 30)

    rig.service.up = True
    rig.clock.advance(60)
    rig.transport.send(noisy(5))
    rig.transport.send(noisy(6))
    # First a report of the gap, ahead of the surviving batches; batch 0 held the tensor table
    # and was lost, so the report re-sends it (the survivors' stats need it).
    report, *rest = rig.service.posts()
    assert [p.body["batch_id"] for p in rest] == ["batch-0003", "batch-0004", "batch-0005", "batch-0006"]
    assert report.body["steps"] == [] and report.body["tensors"] == tensor_defs(50)
    assert [(e["kind"], e["data"]) for e in report.body["events"]] == [("telemetry_dropped", {"batches": 3, "steps": 30})]
    assert all(p.body["events"] == [] and p.body["tensors"] == [] for p in rest)  # reported once


def test_drop_report_rides_on_the_next_batch_when_nothing_is_spooled(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(FakeService(up=False), spool_max_bytes=1)  # nothing fits: every batch is dropped
    rig.transport.send(small(0, tensors=tensor_defs(2)))
    rig.transport.send(small(1))
    rig.service.up = True
    rig.clock.advance(60)
    rig.transport.send(small(2))
    rig.transport.send(small(3))
    b2, b3 = rig.service.posts()
    assert b2.body["batch_id"] == "batch-0002" and b2.body["tensors"] == tensor_defs(2)
    assert b2.body["events"] == [{"kind": "telemetry_dropped", "time": b2.body["events"][0]["time"],
                                  "data": {"batches": 2, "steps": 6}}]
    assert b3.body["events"] == [] and b3.body["tensors"] == []


def test_drop_report_is_kept_when_its_carrier_is_rejected(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(FakeService(up=False), spool_max_bytes=1)  # nothing fits: every spooled batch is dropped
    rig.transport.send(small(0))
    assert rig.transport.stats().dropped_batches == 1
    rig.service.up = True
    rig.clock.advance(60)
    rig.service.registered.add("run-1")
    rig.service.script = [httpx.Response(201), httpx.Response(422, json={"detail": "nope"})]
    rig.transport.send(small(1))  # carried the report, refused: that batch is a loss too
    rig.transport.send(small(2))
    posts = rig.service.posts()
    assert [p.body["events"][-1]["data"] for p in posts] == [{"batches": 1, "steps": 3}, {"batches": 2, "steps": 6}]
    s = rig.transport.stats()
    assert (s.rejected_batches, s.dropped_batches, s.dropped_steps) == (1, 2, 6)


def test_restart_backfills_what_the_previous_process_spooled(make_rig: Callable[..., Rig],
                                                            tmp_path: Path) -> None:
    service = FakeService(up=False)
    first = make_rig(service)
    first.transport.send(small(0))
    first.transport.send(small(1))
    first.transport.close()  # tries once, the service is still down: the files stay
    assert first.spooled_ids() == ["batch-0000", "batch-0001"]

    second = make_rig(service)  # same spool_dir, fresh process
    second.transport.send(small(2))  # still down: numbered after the old files
    assert second.spool_files()[-1] == "000000000003.json.gz"
    assert second.spooled_ids() == ["batch-0000", "batch-0001", "batch-0002"]

    third = make_rig(service)
    service.up = True
    third.transport.send(small(3))
    assert service.posted_ids()[-4:] == ["batch-0000", "batch-0001", "batch-0002", "batch-0003"]
    assert third.spool_files() == [] and third.transport.stats().backfilled_batches == 3


def test_close_backfills_the_spool(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(FakeService(up=False))
    rig.transport.send(small(0))
    rig.transport.send(small(1))
    rig.service.up = True
    rig.transport.close()
    rig.transport.close()  # idempotent
    assert rig.service.posted_ids()[-2:] == ["batch-0000", "batch-0001"]
    assert rig.spool_files() == [] and rig.transport.stats().backfilled_batches == 2


def test_close_reports_drops_no_later_batch_could_carry(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(FakeService(up=False), spool_max_bytes=1)
    rig.transport.send(small(0, rank=3, segment=2))
    rig.service.up = True
    rig.transport.close()
    (post,) = rig.service.posts()[-1:]
    assert (post.body["rank"], post.body["segment"], post.body["steps"]) == (3, 2, [])
    assert post.body["events"][0]["kind"] == "telemetry_dropped"
    assert post.body["events"][0]["data"] == {"batches": 1, "steps": 3}


def test_send_after_close_spools_for_the_next_process(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    rig.transport.close()
    rig.transport.send(small(0))
    assert rig.service.seen == [] and rig.spooled_ids() == ["batch-0000"]


def test_default_spool_dir_is_per_run_and_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    service = FakeService(up=False)
    t = HttpTransport(URL, RUN, client=httpx.Client(base_url=URL, transport=httpx.MockTransport(service)),
                      sleep=lambda s: None)
    assert t.spool_dir is None  # unknown until the first payload names its rank
    t.send(small(0, rank=5))
    expected = tmp_path / "cache" / "fp8guard" / "spool" / "run-1" / "rank-5"
    assert t.spool_dir == expected and sorted(p.name for p in expected.iterdir()) == ["000000000001.json.gz", "run.json"]
    for d in (expected, expected.parent, expected.parent.parent, expected.parent.parent.parent):
        assert d.stat().st_mode & 0o777 == 0o700  # private: the fp8guard root and everything below
    t.close()


def test_client_without_base_url_uses_absolute_urls(tmp_path: Path) -> None:
    service = FakeService()
    t = HttpTransport(URL + "/", RUN, client=httpx.Client(transport=httpx.MockTransport(service)),
                      spool_dir=tmp_path)
    t.send(small(0))
    assert [str(s.path) for s in service.seen] == ["/v1/runs/run-1", "/v1/ingest"]
    assert t.stats().sent_batches == 1
    t.close()
