"""The alert outbox across transactions, processes and time, on SQLite and PostgreSQL: enqueue joins
the caller's transaction and suppresses duplicates, a run pages once per incident, rows wait for
their sink, a restart or a crash mid-send loses nothing, two dispatchers never send a row twice, and
the background thread survives errors.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import httpx
import numpy as np
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fp8guard.service.alerts import AlertDispatcher, AlertSettings, SlackSink, backlog, enqueue, resolve
from fp8guard.service.alerts.dispatcher import LEASE_MARGIN_S
from fp8guard.service.store import make_engine
from fp8guard.service.store.models import SqlRun
from tests.service.alerting_helpers import (
    T0,
    Clock,
    Received,
    Receiver,
    alert,
    dispatcher,
    engine_fixture,  # noqa: F401 - fixture
    outbox,
    put,
    receiver_fixture,  # noqa: F401 - fixture
    webhook_settings,
)

# -- enqueue: the caller's transaction, duplicates, sinks ----------------------------------------


def test_duplicates_are_suppressed(engine: Engine, receiver: Receiver) -> None:
    settings = webhook_settings(receiver)
    assert put(engine, settings, alert(), alert()) == 1, "twice in one call"
    assert put(engine, settings, alert(summary="The same alert, worded differently.")) == 0, "and again later"
    assert put(engine, settings, alert(2)) == 1
    d = dispatcher(engine, settings, Clock())
    assert d.run_once() == 2
    d.close()
    assert len(receiver.received("/hook")) == 2
    # one row per (sink, alert): a second sink gets its own copy
    both = AlertSettings(webhooks=settings.webhooks, slack=[SlackSink(url=receiver.url("/slack"))])
    assert put(engine, both, alert(), alert(3)) == 3


def test_enqueue_joins_the_callers_transaction(engine: Engine, receiver: Receiver) -> None:
    settings = webhook_settings(receiver)
    with pytest.raises(RuntimeError), engine.begin() as conn:
        enqueue(conn, [alert()], settings, T0, None)
        raise RuntimeError("the action failed to store")
    assert outbox(engine) == [], "rolled back with the caller"

    with engine.begin() as conn:
        run_pk = conn.execute(sa.insert(SqlRun).values(run_id="r-42", world_size=1, status="running",
                                                       created_at=T0, updated_at=T0).returning(SqlRun.id)).scalar_one()
        assert enqueue(conn, [alert()], settings, T0, run_pk) == 1
        # a duplicate inside the same transaction must not poison it (PostgreSQL aborts a
        # transaction on an IntegrityError; ON CONFLICT DO NOTHING does not)
        assert enqueue(conn, [alert()], settings, T0, run_pk) == 0
        conn.execute(sa.update(SqlRun).where(SqlRun.id == run_pk).values(status="finished"))
    [row] = outbox(engine)
    assert row.run_pk == run_pk and row.kind == "rollback" and row.severity == "critical"
    with engine.connect() as conn:
        assert backlog(conn) == {"webhook": {"pending": 1}}


def test_no_sinks_is_a_no_op(engine: Engine) -> None:
    settings = AlertSettings()
    assert put(engine, settings, alert()) == 0
    d = dispatcher(engine, settings, Clock())
    assert d.run_once() == 0
    d.close()


def test_rows_of_unconfigured_sinks_wait(engine: Engine, receiver: Receiver) -> None:
    settings = webhook_settings(receiver)
    put(engine, settings, alert())
    other = AlertSettings(slack=[SlackSink(url=receiver.url("/slack"))])
    d = dispatcher(engine, other, Clock())
    assert d.run_once() == 0
    d.close()
    assert outbox(engine)[0].status == "pending"


# -- alert storms: one page per incident ---------------------------------------------------------


def test_repeated_alerts_of_a_run_page_once_per_incident(engine: Engine, receiver: Receiver) -> None:
    settings = webhook_settings(receiver, incident_window_s=3600)
    with engine.begin() as conn:
        run_pk = conn.execute(sa.insert(SqlRun).values(run_id="r-42", world_size=1, status="running",
                                                       created_at=T0, updated_at=T0).returning(SqlRun.id)).scalar_one()
    for i in range(10):
        with engine.begin() as conn:
            enqueue(conn, [alert(i, kind="escalation")], settings, T0 + timedelta(seconds=5 * i), run_pk)
    with engine.begin() as conn:
        enqueue(conn, [alert(99, kind="rollback")], settings, T0 + timedelta(seconds=60), run_pk)
    assert [(r.kind, r.dedupe_key) for r in outbox(engine)] == [
        ("escalation", "r-42:escalation:0"), ("rollback", "r-42:rollback:99")]
    with engine.begin() as conn:  # past the window: a new incident pages again
        enqueue(conn, [alert(10, kind="escalation")], settings, T0 + timedelta(seconds=3700), run_pk)
    with engine.begin() as conn:  # resolved: the next alert is a new incident
        resolve(conn, "r-42:rollback:99", T0 + timedelta(seconds=3800))
        enqueue(conn, [alert(100, kind="rollback")], settings, T0 + timedelta(seconds=3801), run_pk)
    assert [r.dedupe_key for r in outbox(engine)] == [
        "r-42:escalation:0", "r-42:rollback:99", "r-42:escalation:10", "r-42:rollback:99:resolved",
        "r-42:rollback:100"]


def test_ten_nan_batches_send_one_page(migrated_url: str, receiver: Receiver) -> None:
    """Issue #15: ten POSTs of NaN-loss batches, far apart in steps and with no checkpoint, sent
    ten pages; the decisions are all still stored."""
    from fastapi.testclient import TestClient

    from fp8guard.service import Settings, create_app
    from tests.helpers import batch, post, register

    app = create_app(Settings(database_url=migrated_url, auth="off", alerts=webhook_settings(receiver)))
    with TestClient(app) as c:
        register(c, "victim")
        for i in range(10):
            steps = [i * 1000 + j for j in range(5)]
            values = np.ones((5, 4, 6), dtype="<f4")
            r = post(c, batch("victim", steps, values=values, losses=[float("nan")] * 5))
            assert r.status_code == 200, r.text
        pages = [a for a in c.get("/v1/runs/victim/actions").json() if a["kind"] == "page"]
    assert len(pages) == 10
    rows = outbox(app.state.store.engine)
    assert [(r.kind, r.sink) for r in rows] == [("escalation", "webhook")], rows


# -- restarts and concurrent dispatchers ---------------------------------------------------------


def test_a_restart_delivers_what_the_old_process_could_not(migrated_url: str, receiver: Receiver) -> None:
    receiver.respond("/hook", (500, {}, b""), (500, {}, b""))
    settings = webhook_settings(receiver)
    clock = Clock()
    first = make_engine(migrated_url)
    put(first, settings, alert(1), alert(2))
    d1 = dispatcher(first, settings, clock)
    assert d1.run_once() == 2
    d1.close()
    first.dispose()  # the process "dies"

    clock.advance(3600)
    second = make_engine(migrated_url)
    d2 = dispatcher(second, settings, clock)
    assert d2.run_once() == 2
    d2.close()
    rows = outbox(second)
    second.dispose()
    assert [(r.status, r.attempts) for r in rows] == [("sent", 2), ("sent", 2)]
    ids = [r.headers["webhook-id"] for r in receiver.received("/hook")]
    assert len(ids) == 4 and len(set(ids)) == 2, "the new process reuses the stored webhook-ids"


def test_two_dispatchers_never_double_send(migrated_url: str, receiver: Receiver) -> None:
    """On PostgreSQL the claim is SELECT ... FOR UPDATE SKIP LOCKED; on SQLite the claiming UPDATE
    takes the single write lock. Either way each row goes out exactly once."""
    receiver.delay_s = 0.005
    settings = webhook_settings(receiver)
    n = 40
    seed = make_engine(migrated_url)
    put(seed, settings, *[alert(i) for i in range(n)], now=datetime.now(UTC))
    seed.dispose()

    engines = [make_engine(migrated_url) for _ in range(2)]
    dispatchers = [AlertDispatcher(e, settings, batch_size=3) for e in engines]
    counts = [0, 0]
    errors: list[BaseException] = []
    go = threading.Barrier(2)

    def work(k: int) -> None:
        try:
            go.wait(10)
            while True:
                done = dispatchers[k].run_once()
                counts[k] += done
                if done == 0:
                    return
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for d in dispatchers:
        d.close()
    rows = outbox(engines[0])
    for e in engines:
        e.dispose()
    assert errors == []
    assert sum(counts) == n
    ids = [r.headers["webhook-id"] for r in receiver.received("/hook")]
    assert len(ids) == n and len(set(ids)) == n
    assert {r.status for r in rows} == {"sent"}


# -- leases: an interrupted delivery is retried within a minute ----------------------------------


class Crash(BaseException):
    """The process dying mid-send (not an error the dispatcher may catch)."""


def test_a_delivery_interrupted_by_a_crash_is_retried_within_a_minute(migrated_url: str,
                                                                        receiver: Receiver) -> None:
    settings = webhook_settings(receiver)
    clock = Clock()
    first = make_engine(migrated_url)
    put(first, settings, alert(1), alert(2), alert(3))

    def die(_: httpx.Request) -> httpx.Response:
        raise Crash

    d1 = AlertDispatcher(first, settings, clock=clock, client=httpx.Client(transport=httpx.MockTransport(die)))
    with pytest.raises(Crash):
        d1.run_once()
    first.dispose()  # the process is gone, its first row leased mid-send, the other two claimed

    second = make_engine(migrated_url)
    d2 = dispatcher(second, settings, clock)
    clock.advance(settings.request_timeout_s + LEASE_MARGIN_S + 1)
    assert clock.now - T0 < timedelta(minutes=1)
    assert d2.run_once() == 3, "every row the dead process held is due again within a minute"
    d2.close()
    assert [r.status for r in outbox(second)] == ["sent", "sent", "sent"]
    second.dispose()


def test_each_send_renews_its_lease_and_a_row_taken_over_is_not_sent_twice(engine: Engine,
                                                                           receiver: Receiver) -> None:
    """Sends are sequential: a row whose claim ran out while earlier rows were slow, and that
    another dispatcher claimed meanwhile, is left to that dispatcher."""
    settings = webhook_settings(receiver)
    lease = timedelta(seconds=settings.request_timeout_s + LEASE_MARGIN_S)
    clock = Clock()
    put(engine, settings, alert(1), alert(2), alert(3))
    d1, d2 = dispatcher(engine, settings, clock), dispatcher(engine, settings, clock)
    taken: list[int] = []

    def slow_sends(req: Received) -> None:
        sending = len(receiver.received("/hook"))
        if sending == 1:
            assert outbox(engine)[0].next_attempt_at == clock.now + lease
            clock.advance(settings.request_timeout_s)  # each send uses its whole timeout
        elif sending == 2:
            assert outbox(engine)[1].next_attempt_at == clock.now + lease, "renewed when its send began"
            clock.advance(settings.request_timeout_s + 1)
            receiver.on_request = None
            taken.append(d2.run_once())  # the third row's claim ran out: another process takes it

    receiver.on_request = slow_sends
    assert d1.run_once() == 3
    d1.close()
    d2.close()
    assert taken == [1], "only the row whose claim ran out, not the two d1 held leases on"
    ids = [r.headers["webhook-id"] for r in receiver.received("/hook")]
    assert len(ids) == 3 and len(set(ids)) == 3, "each alert went out once"
    assert [r.status for r in outbox(engine)] == ["sent", "sent", "sent"]


# -- the background thread -----------------------------------------------------------------------


def wait_for(predicate: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_background_thread_survives_errors(engine: Engine, receiver: Receiver,
                                           caplog: pytest.LogCaptureFixture) -> None:
    settings = webhook_settings(receiver, poll_interval_s=0.05)
    failures = [2]

    def flaky_clock() -> datetime:
        if failures[0] > 0:
            failures[0] -= 1
            raise OSError("clock source unavailable")
        return datetime.now(UTC)

    put(engine, settings, alert(), now=datetime.now(UTC))
    d = AlertDispatcher(engine, settings, clock=flaky_clock)
    with caplog.at_level(logging.ERROR, logger="fp8guard.service.alerts.dispatcher"):
        d.start()
        d.start()  # idempotent
        try:
            wait_for(lambda: len(receiver.received("/hook")) == 1)
            # alerts queued while it runs are picked up too
            put(engine, settings, alert(2), now=datetime.now(UTC))
            wait_for(lambda: len(receiver.received("/hook")) == 2)
        finally:
            d.close()
    assert "alert dispatcher pass failed" in caplog.text
    assert d._thread is None
    assert [r.status for r in outbox(engine)] == ["sent", "sent"]
