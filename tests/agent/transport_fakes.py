"""Fakes shared by the transport tests (test_transport.py, test_transport_retries.py,
test_transport_spool.py): an injected clock, a tiny in-memory ingest service behind
httpx.MockTransport, and a rig that builds an HttpTransport around them which never really sleeps.

The fixture is named in its decorator: a test module imports ``make_rig_fixture`` and its tests take
``make_rig``.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from fp8guard import wire
from fp8guard.agent.transport import HttpTransport, RunInfo

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


@pytest.fixture(name="make_rig")
def make_rig_fixture(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
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
