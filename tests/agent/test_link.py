"""The split between the byte link and the payload side: the link ships whatever bytes a letter
seals, untouched, and tells the ledger every loss; DropReports turns losses into reports."""

from __future__ import annotations

import copy
import dataclasses
import gzip
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from fp8guard import wire
from fp8guard.agent.drop_reports import DropReports
from fp8guard.agent.transport import RunInfo
from fp8guard.agent.transport.letters import Sealed
from fp8guard.agent.transport.link import Link, LinkSettings
from tests.agent.test_transport import URL, FakeClock, FakeService
from tests.helpers import tensor_defs


@dataclass
class Opaque:
    """A letter whose bytes the link must ship as they are (the service below only stores them)."""

    body: bytes
    steps: int = 3
    label: str = "opaque"

    def seal(self) -> Sealed | None:
        return Sealed(self.body)

    def plain(self) -> bytes | None:
        return self.body


@dataclass
class Recording:
    """A ledger that records what the link tells it."""

    losses: list[tuple[int, tuple[int, int], bool]] = field(default_factory=list)
    given_back: list[tuple[int, int] | None] = field(default_factory=list)

    def lost(self, steps: int, carried: tuple[int, int], *, refused: bool) -> None:
        self.losses.append((steps, carried, refused))

    def returned(self, claimed: tuple[int, int] | None, *, with_table: bool = False) -> None:
        self.given_back.append(claimed)

    def report_due(self) -> bool:
        return False

    def has_drops(self) -> bool:
        return False

    def report(self) -> Sealed | None:
        return None


def link(tmp_path: Path, handler: httpx.MockTransport, ledger: object, **kw: object) -> Link:
    settings = LinkSettings(url=URL, timeout_s=10.0, max_attempts=2, backoff_base_s=0.0, backoff_max_s=5.0,
                            gzip_min_bytes=1 << 20, spool_dir=tmp_path / "spool", spool_max_bytes=1 << 20,
                            background=False, max_in_memory=4, drain_s=5.0)
    settings = dataclasses.replace(settings, **kw)  # type: ignore[arg-type]
    return Link(settings, RunInfo("run-1"), ledger, client=httpx.Client(base_url=URL, transport=handler),  # type: ignore[arg-type]
                token=None, sleep=lambda s: None, rng=random.Random(0), clock=FakeClock(), on_commands=None)


def test_the_link_ships_the_sealed_bytes_untouched_and_reports_refusals(tmp_path: Path) -> None:
    seen: list[bytes] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.method == "PUT":
            return httpx.Response(201, json={})
        seen.append(request.content)
        if request.content == b"refuse me":
            return httpx.Response(422, json={"detail": "no"})
        return httpx.Response(200, json={"duplicate": False})

    ledger = Recording()
    lk = link(tmp_path, httpx.MockTransport(answer), ledger)
    lk.admit(Opaque(b"not json at all \x00\xff"), rank=0)
    lk.admit(Opaque(b"refuse me", steps=7), rank=0)
    lk.close()
    assert seen == [b"not json at all \x00\xff", b"refuse me"]
    assert ledger.losses == [(7, (0, 0), True)] and ledger.given_back == [None]
    s = lk.stats()
    assert (s.sent_batches, s.rejected_batches, s.dropped_batches, s.dropped_steps) == (1, 1, 1, 7)


def test_the_link_spools_the_exact_bytes_while_the_service_is_down(tmp_path: Path) -> None:
    service = FakeService(up=False)
    lk = link(tmp_path, httpx.MockTransport(service), Recording())
    lk.admit(Opaque(b"\x01\x02 opaque"), rank=3)
    files = sorted((tmp_path / "spool").glob("*.json.gz"))
    assert [gzip.decompress(f.read_bytes()) for f in files] == [b"\x01\x02 opaque"]
    lk.close()


def test_drop_reports_claim_once_fold_back_and_resend_the_table_once() -> None:
    reports = DropReports("run-1")
    first = wire.make_batch(run_id="run-1", batch_id="b0", tensors=tensor_defs(2), steps=[{"step": 0, "loss": 1.0}])
    later = wire.make_batch(run_id="run-1", batch_id="b1", steps=[{"step": 1, "loss": 1.0}])
    untouched = copy.deepcopy(later)
    reports.letter(first)
    assert not reports.report_due()
    reports.lost(5, (1, 2), refused=False)  # a batch of 5 steps that carried an earlier report of 1 batch, 2 steps
    assert reports.report_due() and reports.has_drops()
    sealed = reports.letter(later).seal()
    assert sealed is not None and sealed.claimed == (2, 7) and sealed.with_table
    body = json.loads(sealed.body)
    assert body["events"][-1]["data"] == {"batches": 2, "steps": 7} and body["tensors"] == tensor_defs(2)
    assert later == untouched  # the caller's dict is never changed
    again = reports.letter(later).seal()
    assert again is not None and again.claimed is None and not again.with_table  # claimed once, table once
    reports.returned(sealed.claimed)  # its carrier did not arrive: pending again
    report = reports.report()
    assert report is not None and report.claimed == (2, 7) and not report.with_table
    reports.lost(1, (0, 0), refused=True)  # a refusal: the table may be why, so it is not re-sent
    sealed = reports.report()
    assert sealed is not None and sealed.claimed == (1, 1) and not sealed.with_table
