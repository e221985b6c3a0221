"""HttpTransport against the real service app (TestClient) and against httpx.MockTransport fakes;
NullTransport and JsonlFileTransport. No real sleeping: ``sleep`` and ``clock`` are injected."""

from __future__ import annotations

import gzip
import json
import logging
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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
from tests.helpers import batch, stat_values, tensor_defs

URL = "http://fp8guard.test"
LOGGER = "fp8guard.agent.transport"


# ---------------------------------------------------------------------- fakes


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Seen:
    method: str
    path: str
    headers: httpx.Headers
    raw: bytes
    body: Any


Scripted = httpx.Response | BaseException | Callable[[httpx.Request], httpx.Response]


@dataclass
class FakeService:
    """A tiny in-memory ingest service: registration, idempotent batches, an on/off switch and a
    script of answers (responses or exceptions) that take precedence, one per request."""

    up: bool = True
    registered: set[str] = field(default_factory=set)
    stored: dict[str, Any] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    script: list[Scripted] = field(default_factory=list)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        raw = request.content
        decoded = gzip.decompress(raw) if request.headers.get("content-encoding") == "gzip" else raw
        body = json.loads(decoded) if decoded else None
        self.seen.append(Seen(request.method, request.url.path, request.headers, raw, body))
        if self.script:
            answer = self.script.pop(0)
            if isinstance(answer, BaseException):
                raise answer
            if isinstance(answer, httpx.Response):
                return answer
            return answer(request)
        if not self.up:
            raise httpx.ConnectError("connection refused", request=request)
        if request.method == "PUT":
            run_id = request.url.path.rsplit("/", 1)[-1]
            created = run_id not in self.registered
            self.registered.add(run_id)
            return httpx.Response(201 if created else 200, json={"run_id": run_id})
        if body["run_id"] not in self.registered:
            return httpx.Response(404, json={"detail": [{"loc": ["body", "run_id"], "msg": "unknown run",
                                                         "type": "not_found"}]})
        duplicate = body["batch_id"] in self.stored
        self.stored.setdefault(body["batch_id"], body)
        return httpx.Response(200, json={"batch_id": body["batch_id"], "duplicate": duplicate, "steps": 0,
                                         "samples": 0})

    def posts(self) -> list[Seen]:
        return [s for s in self.seen if s.method == "POST"]

    def posted_ids(self) -> list[str]:
        return [s.body["batch_id"] for s in self.posts()]

    def methods(self) -> list[str]:
        return [s.method for s in self.seen]


@dataclass
class Rig:
    service: FakeService
    transport: HttpTransport
    sleeps: list[float]
    clock: FakeClock
    spool: Path

    def spool_files(self) -> list[str]:
        return sorted(p.name for p in self.spool.glob("*.json.gz")) if self.spool.exists() else []

    def spooled_ids(self) -> list[str]:
        return [json.loads(gzip.decompress((self.spool / name).read_bytes()))["batch_id"]
                for name in self.spool_files()]


RUN = RunInfo("run-1", model="tiny", recipe={"kind": "delayed"}, world_size=1, config={"lr": 3e-4})


@pytest.fixture
def make_rig(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    made: list[HttpTransport] = []

    def make(service: FakeService | None = None, *, seed: int = 0, spool: Path | None = None,
             clock: FakeClock | None = None, **kw: Any) -> Rig:
        service = service or FakeService()
        sleeps: list[float] = []
        clock = clock or FakeClock()
        spool = spool or tmp_path / "spool"
        client = httpx.Client(base_url=URL, transport=httpx.MockTransport(service))
        transport = HttpTransport(URL, kw.pop("run", RUN), client=client, spool_dir=spool, sleep=sleeps.append,
                                  rng=random.Random(seed), clock=clock, **kw)
        made.append(transport)
        return Rig(service, transport, sleeps, clock, spool)

    yield make
    for t in made:
        t.close()


def small(i: int, run_id: str = "run-1", **kw: Any) -> dict[str, Any]:
    """A small batch: 3 step records, ids sortable by i."""
    return wire.make_batch(run_id=run_id, batch_id=f"batch-{i:04d}",
                           steps=[{"step": 3 * i + k, "loss": 2.0 + k} for k in range(3)], **kw)


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


# ---------------------------------------------------------------------- retries


def test_503_then_200_retries_same_bytes_with_full_jitter(make_rig: Callable[..., Rig]) -> None:
    service = FakeService(script=[httpx.Response(201), httpx.Response(503), httpx.Response(502)])
    service.registered.add("run-1")
    rig = make_rig(service, seed=42, backoff_base_s=0.2, backoff_max_s=5.0)
    rig.transport.send(small(0))
    assert service.methods() == ["PUT", "POST", "POST", "POST"]
    posts = service.posts()
    assert len({p.raw for p in posts}) == 1 and {p.body["batch_id"] for p in posts} == {"batch-0000"}
    expected_rng = random.Random(42)
    assert rig.sleeps == [expected_rng.uniform(0, 0.2), expected_rng.uniform(0, 0.4)]
    s = rig.transport.stats()
    assert (s.sent_batches, s.retries, s.spooled_batches) == (1, 2, 0)
    assert service.stored["batch-0000"] == posts[0].body


def test_backoff_grows_exponentially_and_is_capped(make_rig: Callable[..., Rig]) -> None:
    service = FakeService(script=[httpx.Response(500)] * 8)
    rig = make_rig(service, seed=7, max_attempts=8, backoff_base_s=0.1, backoff_max_s=1.0)
    rig.transport.send(small(0))
    assert len(rig.sleeps) == 7
    for k, slept in enumerate(rig.sleeps):
        assert 0.0 <= slept <= min(1.0, 0.1 * 2**k)
    assert sum(rig.sleeps) <= 0.1 + 0.2 + 0.4 + 0.8 + 1.0 * 3  # the retry budget
    assert rig.transport.stats().spooled_batches == 1


def test_retry_after_is_honoured_and_capped(make_rig: Callable[..., Rig]) -> None:
    service = FakeService(script=[
        httpx.Response(201),  # PUT
        httpx.Response(503, headers={"Retry-After": "2"}),
        httpx.Response(429, headers={"Retry-After": "3600"}),
        httpx.Response(503, headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}),
    ])
    service.registered.add("run-1")
    rig = make_rig(service, seed=3, backoff_base_s=0.2, backoff_max_s=5.0)
    rig.transport.send(small(0))
    assert rig.sleeps[:2] == [2.0, 5.0]
    assert 0.0 <= rig.sleeps[2] <= 0.8  # an HTTP date falls back to jittered backoff
    assert rig.transport.stats().sent_batches == 1 and rig.transport.stats().retries == 3


@pytest.mark.parametrize("status", [400, 409, 413, 422])
def test_client_errors_are_logged_and_dropped_never_retried(make_rig: Callable[..., Rig], status: int,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    detail = {"detail": [{"loc": ["body", "tensor_stats", 0, "data"], "msg": "invalid base64", "type": "x"}]}
    service = FakeService(script=[httpx.Response(201), httpx.Response(status, json=detail)])
    service.registered.add("run-1")
    rig = make_rig(service)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        rig.transport.send(small(0))
    assert service.methods() == ["PUT", "POST"] and rig.sleeps == []
    s = rig.transport.stats()
    assert (s.rejected_batches, s.retries, s.spooled_batches, s.sent_batches) == (1, 0, 0, 0)
    assert rig.spool_files() == []
    assert any(f"HTTP {status}" in r.message and "body.tensor_stats.0.data: invalid base64" in r.message
               and "batch-0000" in r.message for r in caplog.records)
    rig.transport.send(small(1))  # the transport is not "down": the next batch goes straight out
    assert service.posted_ids() == ["batch-0000", "batch-0001"] and "batch-0001" in service.stored


def test_404_reregisters_then_succeeds(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    rig.transport.send(small(0))
    assert rig.service.methods() == ["PUT", "POST"]
    rig.service.registered.clear()  # the service came back on a fresh database
    rig.transport.send(small(1))
    assert rig.service.methods() == ["PUT", "POST", "POST", "PUT", "POST"]
    assert list(rig.service.stored) == ["batch-0000", "batch-0001"]
    assert rig.service.seen[3].body == RUN.registration_body()
    assert rig.sleeps == []  # re-registration is immediate
    s = rig.transport.stats()
    assert (s.sent_batches, s.spooled_batches, s.rejected_batches) == (2, 0, 0)


def test_registration_body_and_lazy_registration(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    assert rig.service.seen == []  # nothing happens before the first send
    rig.transport.send(small(0))
    rig.transport.send(small(1))
    put = rig.service.seen[0]
    assert (put.method, put.path) == ("PUT", "/v1/runs/run-1")
    assert put.body == {"model": "tiny", "recipe": {"kind": "delayed"}, "world_size": 1, "config": {"lr": 3e-4}}
    assert rig.service.methods() == ["PUT", "POST", "POST"]


def test_gzip_threshold(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(gzip_min_bytes=600)
    big = wire.make_batch(run_id="run-1", batch_id="big-batch", steps=[{"step": k, "loss": 1.0} for k in range(40)])
    rig.transport.send(small(0))
    rig.transport.send(big)
    small_post, big_post = rig.service.posts()
    assert "content-encoding" not in small_post.headers and small_post.raw == wire.dumps(small(0))
    assert big_post.headers["content-encoding"] == "gzip" and gzip.decompress(big_post.raw) == wire.dumps(big)


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


# ---------------------------------------------------------------------- never raises


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyError("x"), ZeroDivisionError(), OSError("disk"),
                                 httpx.ReadTimeout("slow"), httpx.RemoteProtocolError("eof")])
def test_send_never_raises_on_arbitrary_client_exceptions(make_rig: Callable[..., Rig],
                                                          exc: BaseException) -> None:
    service = FakeService(script=[exc] * 10)
    rig = make_rig(service, max_attempts=2)
    rig.transport.send(small(0))
    assert rig.spooled_ids() == ["batch-0000"]
    service.script = []
    rig.clock.advance(60)
    rig.transport.send(small(1))
    assert service.posted_ids()[-2:] == ["batch-0000", "batch-0001"]


def test_send_never_raises_on_bad_payloads(make_rig: Callable[..., Rig],
                                           caplog: pytest.LogCaptureFixture) -> None:
    rig = make_rig()
    bare_nan = small(0)
    bare_nan["steps"][0]["loss"] = math.nan  # bypassed wire.encode_float
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        rig.transport.send(bare_nan)
        rig.transport.send({"batch_id": "x" * 8, "blob": object()})
        rig.transport.send("not a dict")  # type: ignore[arg-type]
    assert rig.transport.stats().rejected_batches == 3 and rig.service.posts() == []
    assert any("encode_float" in r.message for r in caplog.records)


def test_send_never_raises_when_spool_and_sleep_fail(make_rig: Callable[..., Rig], tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")

    def bad_sleep(seconds: float) -> None:
        raise RuntimeError("sleep broke")

    service = FakeService(up=False)
    t = HttpTransport(URL, RUN, client=httpx.Client(base_url=URL, transport=httpx.MockTransport(service)),
                      spool_dir=blocker / "spool", sleep=bad_sleep)
    t.send(small(0))  # retry sleep raises: counted as dropped, not raised
    t2 = HttpTransport(URL, RUN, client=httpx.Client(base_url=URL, transport=httpx.MockTransport(service)),
                       spool_dir=blocker / "spool", max_attempts=1)
    t2.send(small(1))  # spool directory cannot be created
    assert t.stats().dropped_batches == 1 and t2.stats().dropped_batches == 1
    assert t2.stats().dropped_steps == 3
    t.close()
    t2.close()


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
