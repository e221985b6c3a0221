"""Round trips to PostgreSQL per small batch: one ingest transaction and one loop pass, counted
from libpq's protocol trace (a round trip = the client sends, then waits for what the server
sends back). A pooled connection idle for over ``PING_AFTER_IDLE_S`` is pinged at checkout first
(one more round trip); the batches here follow each other closely, so none is.

    python bench/pg_roundtrips.py            # a healthy batch
    python bench/pg_roundtrips.py --nan      # the batch that triggers a decision (NaN loss, inf amax)

Prints JSON: ``ingest`` and ``loop`` round trips, and the CPU (``time.thread_time``) of each, for
the last of four batches of 200 tensors x 4 stats x 10 steps, as ``bench/load.py`` sends them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._load_bodies import Batches
from bench._load_service import PG_ADMIN_URL


def round_trips(trace: str) -> int:
    """Round trips in a libpq protocol trace: times the client sent, then waited for the server."""
    trips, last = 0, None
    for line in trace.splitlines():
        direction = line.split("\t", 1)[0]
        if direction == "F" and last != "F":
            trips += 1
        last = direction
    return trips


@contextmanager
def traced(engine: Any) -> Iterator[list[str]]:
    """libpq's protocol trace of every connection ``engine`` checks out inside the block; the
    list holds the trace's text once the block is over."""
    import sqlalchemy as sa
    from psycopg import pq

    trace = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed below
    out: list[str] = []

    def checkout(dbapi_conn: Any, record: Any, proxy: Any) -> None:
        dbapi_conn.pgconn.trace(trace.fileno())
        dbapi_conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)

    def checkin(dbapi_conn: Any, record: Any) -> None:
        if dbapi_conn is not None:
            dbapi_conn.pgconn.untrace()

    sa.event.listen(engine, "checkout", checkout)
    sa.event.listen(engine, "checkin", checkin)
    try:
        yield out
    finally:
        sa.event.remove(engine, "checkout", checkout)
        sa.event.remove(engine, "checkin", checkin)
        trace.flush()
        trace.seek(0)
        out.append(trace.read())
        trace.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nan", action="store_true", help="the last batch carries a NaN loss and an inf amax")
    args = parser.parse_args()

    import psycopg

    from fp8guard.service.alerts.config import AlertSettings
    from fp8guard.service.domain import RunSpec
    from fp8guard.service.ingest.decode import EventLimits
    from fp8guard.service.ingest.routes import _parse
    from fp8guard.service.loop.judge import Judge
    from fp8guard.service.store import Store, make_engine, upgrade

    name = f"fp8guard_rt_{os.getpid()}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    out: dict[str, Any] = {}
    try:
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        store = Store.open(url)
        try:
            store.register_run(RunSpec(run_id="rt"))
            batches = Batches(200, 4, 10)
            judge = Judge(AlertSettings())
            held: dict[int | None, Any] = {}
            for k in range(4):
                last = k == 3
                body = gzip.decompress(batches.body("rt", 10 * k, k, with_tensors=k == 0, nan_last=last and args.nan))
                batch = _parse(body, EventLimits())
                for stage in ("ingest", "loop"):
                    with traced(store.engine) if last else nullcontext([]) as trace:
                        cpu = time.thread_time()
                        if stage == "ingest":
                            result = store.ingest(batch)
                            held[result.queue_id] = batch
                        else:
                            assert result.run_pk is not None
                            store.loop_pass(result.run_pk, lambda txn: judge(txn, held.pop))
                        cpu = time.thread_time() - cpu
                    if last:
                        out[stage] = {"round_trips": round_trips(trace[0]), "cpu_ms": round(cpu * 1e3, 2)}
        finally:
            store.close()
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    print(json.dumps({"nan": args.nan, **out}))


if __name__ == "__main__":
    main()
