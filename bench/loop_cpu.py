"""CPU of the closed loop per large batch, in process (no HTTP, no clients): the ingest bench's
batches (1,000 tensors x 4 stats x 100 steps of random data, which trips rules at nearly every
step) stored through ``Store.ingest`` and judged by ``Judge`` one pass per batch, as the loop's
worker does. Prints JSON (ms per batch: ingest, loop pass); ``--profile`` adds cProfile's top
functions of the loop passes.

``--healthy`` sends ``bench/load.py``'s batches instead (healthy values, no rule fires; default
200 tensors x 4 stats x 10 steps with ``--tensors 200 --steps 10``), and ``--per-pass K`` judges K
stored batches per pass, as the loop does for an agent shipping faster than ``loop_gather_s``:

    python bench/loop_cpu.py --healthy --tensors 200 --steps 10 --batches 401 --per-pass 1
    python bench/loop_cpu.py --healthy --tensors 200 --steps 10 --batches 401 --per-pass 4
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
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
from bench._load_bodies import Batches
from bench.ingest import Payloads
from fp8guard.service.alerts.config import AlertSettings
from fp8guard.service.domain import RunSpec
from fp8guard.service.ingest.decode import decode_batch
from fp8guard.service.loop.judge import Judge
from fp8guard.service.schemas import IngestBatchIn
from fp8guard.service.store import Store, make_engine, upgrade


def measure(url: str, batches: int, tensors: int, steps: int, profile: bool, *, healthy: bool = False,
            per_pass: int = 1) -> dict[str, Any]:
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    store = Store.open(url)
    judge = Judge(AlertSettings())
    payloads = Payloads(f"loop-cpu-{time.time_ns()}", tensors, steps)
    healthy_batches = Batches(tensors, 4, steps) if healthy else None

    def body(i: int) -> bytes:
        if healthy_batches is None:
            return payloads.body(i * steps, with_tensors=i == 0)
        return gzip.decompress(healthy_batches.body(payloads.run_id, i * steps, i, with_tensors=i == 0))

    store.register_run(RunSpec(run_id=payloads.run_id, model="bench", world_size=1))
    prof = cProfile.Profile() if profile else None
    ingest_s = loop_s = loop_wall_s = 0.0
    held: dict[int, Any] = {}
    try:
        for i in range(batches):
            batch = decode_batch(IngestBatchIn.model_validate_json(body(i)))
            t0 = time.process_time()
            result = store.ingest(batch)
            t1 = time.process_time()
            assert result.run_pk is not None and result.queue_id is not None
            held[result.queue_id] = batch
            if i > 0:  # the first batch registers the tensors and builds the detector
                ingest_s += t1 - t0
            if i % per_pass and i < batches - 1:
                continue  # gathering
            t1, w1 = time.process_time(), time.perf_counter()
            if prof is not None and i > 0:
                prof.enable()
            store.loop_pass(result.run_pk, lambda txn: judge(txn, lambda q: held.pop(q, None)))
            if prof is not None:
                prof.disable()
            t2, w2 = time.process_time(), time.perf_counter()
            if i > 0:
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
    ap.add_argument("--healthy", action="store_true", help="bench/load.py's healthy batches instead of random data")
    ap.add_argument("--per-pass", type=int, default=1, help="stored batches judged per loop pass")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = args.database or f"sqlite:///{tmp}/loop_cpu.db"
        out = measure(url, args.batches, args.tensors, args.steps, args.profile, healthy=args.healthy,
                      per_pass=max(1, args.per_pass))
    text = out.pop("profile", None)
    print(json.dumps(out))
    if text:
        print(text)


if __name__ == "__main__":
    main()
