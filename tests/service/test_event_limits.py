"""D3: event data is bounded at the door (per event, per batch) and on the way out (per event and
per answer), so no stored event can cost every dashboard load hundreds of megabytes."""

from __future__ import annotations

import gzip
from typing import Any

import sqlalchemy as sa

from fp8guard import wire
from fp8guard.service.store import make_engine
from fp8guard.service.store.models import SqlEvent, SqlRun
from fp8guard.service.store.series_reader import EVENT_DATA_READ_BYTES, EVENTS_READ_BYTES
from tests.helpers import batch, post, register


def _note(text: str, step: int = 0) -> dict[str, Any]:
    return {"kind": "note", "step": step, "data": {"text": text}}


def test_an_oversized_event_is_refused_naming_it_and_nothing_is_stored(client: Any) -> None:
    register(client, "ev")
    r = post(client, batch("ev", [0, 1], events=[_note("ok"), _note("x" * 70_000)]))
    assert r.status_code == 413, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "events", 1, "data"]
    assert "per event" in r.json()["detail"][0]["msg"]
    assert client.get("/v1/runs/ev").json()["samples"] == 0
    assert client.get("/v1/runs/ev/events").json() == []


def test_the_events_of_one_batch_are_bounded_together(client: Any) -> None:
    register(client, "evb")
    events = [_note("y" * 60_000, step=i) for i in range(20)]  # each under the per-event limit
    r = post(client, batch("evb", [0], events=events))
    assert r.status_code == 413, r.text
    assert r.json()["detail"][0]["loc"][:2] == ["body", "events"] and "per batch" in r.text
    ok = post(client, batch("evb", [0], events=events[:10]))
    assert ok.status_code == 200, ok.text
    assert len(client.get("/v1/runs/evb/events").json()) == 10


def test_a_gzip_stream_of_several_members_is_read_whole(client: Any) -> None:
    register(client, "gzm")
    body = wire.dumps(batch("gzm", [0, 1, 2]))
    cut = len(body) // 2
    r = client.post("/v1/ingest", content=gzip.compress(body[:cut]) + gzip.compress(body[cut:]),
                    headers={"content-encoding": "gzip", "content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["steps"] == 3


def test_trailing_garbage_after_gzip_is_refused(client: Any) -> None:
    register(client, "gzt")
    r = client.post("/v1/ingest", content=gzip.compress(wire.dumps(batch("gzt", [0]))) + b"junk",
                    headers={"content-encoding": "gzip", "content-type": "application/json"})
    assert r.status_code == 400, r.text


def test_reads_bound_what_an_already_stored_large_event_costs(client: Any, migrated_url: str) -> None:
    """An event stored before the limits existed (or under a raised limit) is served truncated,
    and one answer carries at most EVENTS_READ_BYTES of event data."""
    register(client, "old")
    post(client, batch("old", [0], events=[_note("small", 0)]))
    engine = make_engine(migrated_url)
    with engine.begin() as conn:
        pk = conn.scalar(sa.select(SqlRun.id).where(SqlRun.run_id == "old"))
        big = {"text": "z" * (2 * 2**20)}
        conn.execute(sa.insert(SqlEvent), [{"run_pk": pk, "rank": 0, "segment": 0, "step": 1, "time": None,
                                            "kind": "note", "data": big}])
        medium = {"text": "m" * (EVENT_DATA_READ_BYTES - 100)}
        n_medium = EVENTS_READ_BYTES // EVENT_DATA_READ_BYTES + 5
        conn.execute(sa.insert(SqlEvent), [{"run_pk": pk, "rank": 0, "segment": 0, "step": 2 + i, "time": None,
                                            "kind": "note", "data": medium} for i in range(n_medium)])
    engine.dispose()
    r = client.get("/v1/runs/old/events", params={"limit": 10_000})
    assert r.status_code == 200
    events = r.json()
    assert len(events) == 2 + n_medium, "every event keeps its place in the list"
    assert events[0]["data"] == {"text": "small"}
    assert events[1]["data"] == {"truncated": True, "bytes": len('{"text": ""}') + 2 * 2**20} or \
        events[1]["data"]["truncated"] is True
    whole = [e for e in events[2:] if e["data"] == medium]
    assert 0 < len(whole) < n_medium and all(e["data"]["truncated"] for e in events[2 + len(whole):])
    assert len(r.content) < EVENTS_READ_BYTES + 2 * EVENT_DATA_READ_BYTES + 200 * len(events)


def test_events_page_on_with_after(client: Any) -> None:
    register(client, "pg")
    post(client, batch("pg", [0], events=[_note(f"n{i}", step=i) for i in range(5)]))
    seen: list[str] = []
    after = None
    while True:
        params: dict[str, Any] = {"limit": 2} if after is None else {"limit": 2, "after": after}
        page = client.get("/v1/runs/pg/events", params=params).json()
        if not page:
            break
        seen += [e["data"]["text"] for e in page]
        after = page[-1]["id"]
    assert seen == [f"n{i}" for i in range(5)]
