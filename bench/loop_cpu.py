"""CPU of the closed loop per large batch, in process (no HTTP, no clients): the ingest bench's
batches (1,000 tensors x 4 stats x 100 steps of random data, which trips rules at nearly every
step) stored through ``Store.ingest`` and judged by ``Judge`` one pass per batch, as the loop's
worker does. Prints JSON (ms per batch: ingest, loop pass); ``--profile`` adds cProfile's top
functions of the loop passes."""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.ingest import Payloads
from fp8guard.service.alerts.config import AlertSettings
from fp8guard.service.domain import RunSpec
from fp8guard.service.ingest.decode import decode_batch
from fp8guard.service.loop.judge import Judge
from fp8guard.service.schemas import IngestBatchIn
from fp8guard.service.store import Store, make_engine, upgrade


def measure(url: str, batches: int, tensors: int, steps: int, profile: bool) -> dict[str, Any]:
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    store = Store.open(url)
    judge = Judge(AlertSettings())
    payloads = Payloads(f"loop-cpu-{time.time_ns()}", tensors, steps)
    store.register_run(RunSpec(run_id=payloads.run_id, model="bench", world_size=1))
    prof = cProfile.Profile() if profile else None
    ingest_s = loop_s = loop_wall_s = 0.0
    try:
        for i in range(batches):
            batch = decode_batch(IngestBatchIn.model_validate_json(payloads.body(i * steps, with_tensors=i == 0)))
            t0 = time.process_time()
            result = store.ingest(batch)
            t1, w1 = time.process_time(), time.perf_counter()
            assert result.run_pk is not None
            if prof is not None and i > 0:
                prof.enable()
            store.loop_pass(result.run_pk, lambda txn, b=batch: judge(txn, lambda _q: b))
            if prof is not None:
                prof.disable()
            t2, w2 = time.process_time(), time.perf_counter()
            if i > 0:  # the first batch registers the tensors and builds the detector
                ingest_s += t1 - t0
                loop_s += t2 - t1
                loop_wall_s += w2 - w1
        digest = _decisions_digest(store, payloads.run_id)
    finally:
        store.close()
    n = max(batches - 1, 1)
    out: dict[str, Any] = {"batches": n, "ingest_cpu_ms": 1e3 * ingest_s / n, "loop_cpu_ms": 1e3 * loop_s / n,
                           "loop_wall_ms": 1e3 * loop_wall_s / n,
                           **digest}
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
        out["profile"] = buf.getvalue()
    return out


def _decisions_digest(store: Store, run_id: str) -> dict[str, Any]:
    """How many findings and actions the run got, and a digest of what they say (not their ids or
    times): two runs of this bench decide the same iff the digests are equal."""
    with store.engine.connect() as conn:
        pk = conn.scalar(sa.text("SELECT id FROM runs WHERE run_id = :r"), {"r": run_id})
        findings = conn.execute(sa.text("SELECT rank, segment, step, onset_step, rule, severity, explanation "
                                         "FROM findings WHERE run_pk = :p ORDER BY id"), {"p": pk}).all()
        actions = conn.execute(sa.text("SELECT kind, status, step, reason, payload FROM actions WHERE run_pk = :p "
                                        "ORDER BY id"), {"p": pk}).all()
    text = repr([tuple(r) for r in findings]) + repr([(*r[:4], json.dumps(_json(r[4]), sort_keys=True))
                                                      for r in actions])
    return {"findings": len(findings), "actions": len(actions),
            "decisions_digest": hashlib.sha256(text.encode()).hexdigest()[:16]}


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--database", default=None, help="database URL (default: a fresh SQLite file)")
    ap.add_argument("--batches", type=int, default=21)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = args.database or f"sqlite:///{tmp}/loop_cpu.db"
        out = measure(url, args.batches, args.tensors, args.steps, args.profile)
    text = out.pop("profile", None)
    print(json.dumps(out))
    if text:
        print(text)


if __name__ == "__main__":
    main()
