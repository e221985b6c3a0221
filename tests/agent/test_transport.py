"""HttpTransport's construction and argument checks, HttpTransport end to end against the real
service app (TestClient), and the simple transports: NullTransport and JsonlFileTransport. No real
sleeping: ``sleep`` and ``clock`` are injected.

Retries and the never-raises contract are in test_transport_retries.py, outages and the spool in
test_transport_spool.py; their fakes in transport_fakes.py.
"""

from __future__ import annotations

import gzip
import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from fp8guard import wire
from fp8guard.agent.transport import (
    HttpTransport,
    JsonlFileTransport,
    NullTransport,
    RunInfo,
    Transport,
    TransportStats,
)
from tests.agent.transport_fakes import (
    RUN,
    URL,
    FakeClock,
    FakeService,
    Rig,
    make_rig_fixture,  # noqa: F401 - fixture
    small,
)
from tests.helpers import batch, stat_values

# ---------------------------------------------------------------------- construction


def test_transports_satisfy_the_protocol(tmp_path: Path) -> None:
    http = HttpTransport(URL, RUN, client=httpx.Client(base_url=URL, transport=httpx.MockTransport(FakeService())))
    for t in (NullTransport(), JsonlFileTransport(tmp_path / "x.jsonl"), http):
        assert isinstance(t, Transport)
        assert t.stats() == TransportStats()
        t.close()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"url": "fp8guard:8000"}, "url must start with http:// or https://"),
    ({"url": "ftp://x"}, "url must start with http:// or https://"),
    ({"timeout_s": 0}, "timeout_s must be"),
    ({"timeout_s": math.inf}, "timeout_s must be"),
    ({"max_attempts": 0}, "max_attempts must be an int >= 1"),
    ({"backoff_base_s": -1.0}, "backoff_base_s must be"),
    ({"backoff_base_s": 2.0, "backoff_max_s": 1.0}, "backoff_max_s must be a finite number >= backoff_base_s"),
    ({"gzip_min_bytes": -1}, "gzip_min_bytes must be an int >= 0"),
    ({"spool_max_bytes": -1}, "spool_max_bytes must be an int >= 0"),
    ({"run": "run-1"}, "run must be a RunInfo"),
    ({"client": object()}, "client must be an httpx.Client"),
])
def test_invalid_arguments_say_what_to_change(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"url": URL, "run": RUN, **kwargs}
    with pytest.raises(ValueError, match=match):
        HttpTransport(args.pop("url"), args.pop("run"), **args)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"run_id": "bad id"}, "run_id 'bad id' must match"),
    ({"run_id": ""}, "must match"),
    ({"run_id": "r", "world_size": 0}, "world_size must be an int >= 1"),
])
def test_run_info_is_validated(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RunInfo(**kwargs)


# ---------------------------------------------------------------------- end to end (real app)


def forwarding(client: Any, seen: list[httpx.Request],
               after: Callable[[httpx.Request, httpx.Response], None] | None = None) -> httpx.Client:
    """An httpx.Client whose requests go to the real app through ``client`` and are recorded."""

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        headers = {k: v for k, v in request.headers.items() if k in ("content-type", "content-encoding")}
        r = client.request(request.method, request.url.path, content=request.content, headers=headers)
        response = httpx.Response(r.status_code, headers={"content-type": r.headers.get("content-type", "")},
                                  content=r.content)
        if after is not None:
            after(request, response)
        return response

    return httpx.Client(base_url="http://testserver", transport=httpx.MockTransport(handler))


def test_end_to_end_registers_then_stores_exactly(client: Any, tmp_path: Path) -> None:
    run = RunInfo("e2e-run", model="tiny-gpt", recipe={"kind": "delayed", "margin": 0}, world_size=2,
                  config={"lr": 0.0003, "layers": 2})
    assert client.get("/v1/runs/e2e-run").status_code == 404
    t = HttpTransport("http://testserver", run, client=client, spool_dir=tmp_path / "spool")
    steps = list(range(10))
    losses = [2.5, 2.25, math.nan, 2.0, math.inf, 1.75, 1.5, -math.inf, 1.25, 1.0]
    vals = stat_values(steps, 6)
    vals[3, 0, 2] = np.nan
    t.send(batch("e2e-run", steps, n_tensors=6, values=vals, losses=losses,
                 events=[{"kind": "run_started", "step": 0}]))
    t.close()

    s = t.stats()
    assert (s.sent_batches, s.duplicate_batches, s.retries, s.spooled_batches, s.rejected_batches) == (1, 0, 0, 0, 0)
    assert s.bytes_sent > 0
    detail = client.get("/v1/runs/e2e-run").json()
    assert (detail["model"], detail["world_size"]) == ("tiny-gpt", 2)
    assert detail["recipe"] == {"kind": "delayed", "margin": 0} and detail["config"] == {"lr": 0.0003, "layers": 2}
    assert detail["last_step"] == 9 and detail["num_tensors"] == 6 and detail["samples"] == 60
    scalars = client.get("/v1/runs/e2e-run/scalars", params={"fields": "loss,tokens"}).json()
    assert scalars["steps"] == steps
    expected = [wire.encode_float(x) for x in losses]
    assert scalars["min"]["loss"] == expected and scalars["max"]["loss"] == expected
    assert scalars["min"]["tokens"] == [4096 * (k + 1) for k in steps]
    series = client.get("/v1/runs/e2e-run/tensors/2/series", params={"stat": "amax"}).json()
    got = np.array([wire.decode_float(v) for v in series["min"]], dtype="<f4")
    np.testing.assert_array_equal(got, vals[:, 0, 2])
    assert [e["kind"] for e in client.get("/v1/runs/e2e-run/events").json()] == ["run_started"]


def test_end_to_end_gzip_above_threshold_only(client: Any, tmp_path: Path) -> None:
    seen: list[httpx.Request] = []
    t = HttpTransport("http://testserver", RunInfo("gz-run"), client=forwarding(client, seen),
                      gzip_min_bytes=4096, spool_dir=tmp_path)
    big = batch("gz-run", list(range(20)), n_tensors=64)  # 20 x 4 x 64 float32 = 20 KiB of data
    tiny = wire.make_batch(run_id="gz-run", batch_id="tiny-batch", events=[{"kind": "note", "data": {"m": 1}}])
    assert len(wire.dumps(big)) >= 4096 > len(wire.dumps(tiny))
    t.send(big)
    t.send(tiny)
    posts = [r for r in seen if r.method == "POST"]
    assert posts[0].headers["content-encoding"] == "gzip" and posts[0].content[:2] == b"\x1f\x8b"
    assert gzip.decompress(posts[0].content) == wire.dumps(big)
    assert "content-encoding" not in posts[1].headers and posts[1].content == wire.dumps(tiny)
    assert t.stats().bytes_sent == len(posts[0].content) + len(posts[1].content) < len(wire.dumps(big))
    detail = client.get("/v1/runs/gz-run").json()
    assert detail["samples"] == 20 * 64 and detail["num_tensors"] == 64
    assert [e["data"] for e in client.get("/v1/runs/gz-run/events").json()] == [{"m": 1}]
    t.close()


def test_end_to_end_lost_answer_is_retried_and_stored_once(client: Any, tmp_path: Path) -> None:
    seen: list[httpx.Request] = []
    lost = [True]

    def lose_first_answer(request: httpx.Request, response: httpx.Response) -> None:
        if request.method == "POST" and lost[0]:
            lost[0] = False  # the service stored it; the client never hears back
            raise httpx.ReadTimeout("timed out", request=request)

    sleeps: list[float] = []
    t = HttpTransport("http://testserver", RunInfo("dup-run"), client=forwarding(client, seen, lose_first_answer),
                      sleep=sleeps.append, rng=random.Random(1), spool_dir=tmp_path)
    t.send(batch("dup-run", list(range(5))))
    posts = [r for r in seen if r.method == "POST"]
    assert len(posts) == 2 and posts[0].content == posts[1].content
    s = t.stats()
    assert (s.sent_batches, s.duplicate_batches, s.retries, s.spooled_batches) == (1, 1, 1, 0)
    assert len(sleeps) == 1
    detail = client.get("/v1/runs/dup-run").json()
    assert detail["ranks"][0]["batches"] == 1 and detail["samples"] == 5 * 6
    assert client.get("/v1/runs/dup-run/scalars", params={"fields": "loss"}).json()["steps"] == list(range(5))
    t.close()


def test_end_to_end_outage_spools_then_backfills_in_order(client: Any, tmp_path: Path) -> None:
    up = [False]
    seen: list[httpx.Request] = []
    real = forwarding(client, seen)

    def handler(request: httpx.Request) -> httpx.Response:
        if not up[0]:
            raise httpx.ConnectError("refused", request=request)
        return real.send(request)

    clock = FakeClock()
    t = HttpTransport("http://testserver", RunInfo("outage"), spool_dir=tmp_path / "spool", sleep=lambda s: None,
                      clock=clock, client=httpx.Client(base_url="http://testserver",
                                                       transport=httpx.MockTransport(handler)))
    for i in range(3):
        t.send(batch("outage", list(range(10 * i, 10 * i + 10)), define_tensors=i == 0,
                     events=[{"kind": "note", "step": 10 * i, "data": {"i": i}}]))
    assert len(list((tmp_path / "spool").glob("*.json.gz"))) == 3
    up[0] = True
    clock.advance(10)
    t.send(batch("outage", list(range(30, 40)), define_tensors=False,
                 events=[{"kind": "note", "step": 30, "data": {"i": 3}}]))
    assert not list((tmp_path / "spool").glob("*.json.gz"))
    s = t.stats()
    assert (s.sent_batches, s.spooled_batches, s.backfilled_batches) == (4, 3, 3)
    assert client.get("/v1/runs/outage/scalars", params={"fields": "loss"}).json()["steps"] == list(range(40))
    assert [e["data"]["i"] for e in client.get("/v1/runs/outage/events").json()] == [0, 1, 2, 3]
    t.close()


def test_end_to_end_spool_overflow_is_reported_and_later_stats_still_accepted(client: Any, tmp_path: Path) -> None:
    up = [False]
    real = forwarding(client, [])

    def handler(request: httpx.Request) -> httpx.Response:
        if not up[0]:
            raise httpx.ConnectError("refused", request=request)
        return real.send(request)

    payloads = [batch("overflow", list(range(10 * i, 10 * i + 10)), define_tensors=i == 0) for i in range(6)]
    one_file = max(len(wire.gzip_body(wire.dumps(p))) for p in payloads)
    clock = FakeClock()
    t = HttpTransport("http://testserver", RunInfo("overflow"), spool_dir=tmp_path / "spool", sleep=lambda s: None,
                      clock=clock, spool_max_bytes=2 * one_file,
                      client=httpx.Client(base_url="http://testserver", transport=httpx.MockTransport(handler)))
    for p in payloads[:5]:
        t.send(p)
    assert t.stats().dropped_batches == 3  # including batch 0, the only one with the tensor table
    up[0] = True
    clock.advance(60)
    t.send(payloads[5])
    t.close()
    s = t.stats()
    assert (s.sent_batches, s.backfilled_batches, s.rejected_batches, s.dropped_steps) == (4, 2, 0, 30)
    assert client.get("/v1/runs/overflow/scalars", params={"fields": "loss"}).json()["steps"] == list(range(30, 60))
    (event,) = client.get("/v1/runs/overflow/events").json()
    assert event["kind"] == "telemetry_dropped" and event["data"] == {"batches": 3, "steps": 30}
    assert client.get("/v1/runs/overflow").json()["num_tensors"] == 6


def test_jsonl_file_can_be_replayed_into_the_service(client: Any, tmp_path: Path) -> None:
    path = tmp_path / "offline" / "telemetry.jsonl"
    t = JsonlFileTransport(path)
    payloads = [batch("offline", [0, 1, 2]), batch("offline", [3, 4], define_tensors=False)]
    for p in payloads:
        t.send(p)
    t.close()
    lines = path.read_bytes().splitlines()
    assert [json.loads(line) for line in lines] == payloads
    assert t.stats().sent_batches == 2 and t.stats().bytes_sent == path.stat().st_size
    client.put("/v1/runs/offline", json={"world_size": 1})
    for line in lines:
        r = client.post("/v1/ingest", content=line, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
    assert client.get("/v1/runs/offline/scalars", params={"fields": "loss"}).json()["steps"] == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------------- simple transports


def test_null_transport_counts() -> None:
    t = NullTransport()
    for i in range(3):
        t.send(small(i))
    t.close()
    assert t.stats().sent_batches == 3


def test_jsonl_transport_appends_lines_and_survives_errors(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    t = JsonlFileTransport(path)
    t.send(small(0))
    bad = small(1)
    bad["steps"][0]["loss"] = math.inf
    t.send(bad)
    t.close()
    second = JsonlFileTransport(path)  # a second writer appends
    second.send(small(2))
    second.close()
    assert [json.loads(line)["batch_id"] for line in path.read_text().splitlines()] == ["batch-0000", "batch-0002"]
    assert t.stats().rejected_batches == 1 and t.stats().sent_batches == 1

    unwritable = JsonlFileTransport(path / "below-a-file.jsonl")
    unwritable.send(small(3))
    assert unwritable.stats().dropped_batches == 1 and unwritable.stats().dropped_steps == 3


def test_stats_is_a_snapshot(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    snap = rig.transport.stats()
    rig.transport.send(small(0))
    assert snap.sent_batches == 0 and rig.transport.stats().sent_batches == 1
