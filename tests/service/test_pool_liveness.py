"""Pooled PostgreSQL connections killed under the store (a server restart, a failover, an idle
timeout): the store recovers without a restart, and loses nothing it acknowledged. Connections
are pinged at checkout only after ``PING_AFTER_IDLE_S`` unused (``store/engine.py``), not at
every checkout."""

from __future__ import annotations

import time
import uuid

import psycopg
import pytest

from fp8guard.service.domain import RunSpec
from fp8guard.service.errors import StorageUnavailable
from fp8guard.service.ingest.decode import decode_batch
from fp8guard.service.schemas import IngestBatchIn
from fp8guard.service.store import Store, Window, make_engine
from tests.conftest import postgres_base_url
from tests.helpers import batch


@pytest.fixture
def pg_url(migrated_url: str) -> str:
    if not migrated_url.startswith("postgresql"):
        pytest.skip("PostgreSQL only: it kills the service's own PostgreSQL backends (the postgresql case runs)")
    return migrated_url


def _kill(app: str) -> int:
    base = postgres_base_url()
    assert base is not None
    with psycopg.connect(base.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as admin:
        row = admin.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                            "WHERE application_name = %s", (app,)).fetchone()
    assert row is not None
    return int(row[0])


def _store(url: str, idle_s: float) -> tuple[Store, str]:
    app = f"fp8g-live-{uuid.uuid4().hex[:8]}"
    return Store(make_engine(f"{url}&application_name={app}", ping_after_idle_s=idle_s)), app


def _ingest(store: Store, steps: list[int], *, first: bool = False) -> None:
    store.ingest(decode_batch(IngestBatchIn.model_validate(batch("live", steps, define_tensors=first))))


def _samples(store: Store) -> int:
    return sum(r.samples for r in store.run("live").ranks)


def test_connections_killed_while_idle_are_replaced_without_an_error(pg_url: str) -> None:
    store, app = _store(pg_url, idle_s=0.2)
    try:
        store.register_run(RunSpec(run_id="live"))
        _ingest(store, [0, 1], first=True)
        assert _kill(app) >= 1
        time.sleep(0.3)  # idle past the threshold: the checkout pings, finds it dead, reconnects
        _ingest(store, [2, 3])
        assert store.scalars("live", ["loss"], Window()).steps == [0, 1, 2, 3]
    finally:
        store.close()


def test_connections_killed_while_busy_cost_one_transaction_then_recover(pg_url: str) -> None:
    store, app = _store(pg_url, idle_s=60.0)  # never idle long enough to be pinged
    try:
        store.register_run(RunSpec(run_id="live"))
        _ingest(store, [0, 1], first=True)
        store.run("live")  # a second pooled connection, killed too
        before = _samples(store)
        assert _kill(app) >= 1
        with pytest.raises(StorageUnavailable):  # answered 503: the agent retries the same batch
            _ingest(store, [2, 3])
        for _ in range(3):  # the failed rollback invalidated the pool: the other killed connection is replaced too
            assert _samples(store) == before
        _ingest(store, [2, 3])
        assert store.scalars("live", ["loss"], Window()).steps == [0, 1, 2, 3]
    finally:
        store.close()
