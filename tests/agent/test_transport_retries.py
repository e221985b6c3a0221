"""HttpTransport's requests against a fake service (httpx.MockTransport): registration, lazy and again
after a 404; gzip above a threshold; retries of the same bytes with jittered, capped backoff and
Retry-After; client errors logged and dropped; and send() never raising, whatever the client, the
payload, the spool or the sleep does. No real sleeping: ``sleep`` and ``clock`` are injected.
"""

from __future__ import annotations

import gzip
import logging
import math
import random
from collections.abc import Callable
from pathlib import Path

import httpx
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
