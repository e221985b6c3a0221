"""Heatmap query latency on a large run: 1,000 tensors x 100,000 steps x 4 stats, queried as
one stat downsampled to 2,000 columns (extremes kept), the way the run page draws it.

    python bench/query.py --json                  # SQLite
    python bench/query.py --json --backend postgres

The run is written through the store's ingest path (the same code the HTTP endpoint calls,
skipping HTTP to save time), then queried through the HTTP API of a real `fp8guard serve`
process and through the store directly. Prints one JSON line with median latencies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._serve import serve
from bench.ingest import PG_ADMIN_URL
from fp8guard.service.domain import Batch, RunSpec, StatBlock, StepRow, TensorInfo
from fp8guard.service.store import Store, Window, make_engine, upgrade

STATS = ("amax", "scale", "saturation", "amax_history_max")


def populate(store: Store, run_id: str, steps: int, tensors: int, chunk: int = 500) -> float:
    store.register_run(RunSpec(run_id=run_id, model="bench"))
    rng = np.random.default_rng(0)
    base = rng.lognormal(size=(chunk, len(STATS), tensors)).astype("<f4")
    infos = [TensorInfo(index=i, name=f"layers.{i // 4}.op{i % 4}", module=f"layers.{i // 4}", role="fwd_input",
                        fp8_format="e4m3", first_step=0) for i in range(tensors)]
    t0 = time.perf_counter()
    for first in range(0, steps, chunk):
        n = min(chunk, steps - first)
        step_ids = np.arange(first, first + n, dtype=np.int64)
        values = base[:n].copy()
        values[:, 0, (first // chunk) % tensors] *= 50.0  # a moving outlier, so extremes matter
        store.ingest(Batch(
            run_id=run_id, batch_id=f"populate-{first:09d}", rank=0, segment=0,
            tensors=infos if first == 0 else [],
            steps=[StepRow(step=int(s), loss=2.0) for s in step_ids],
            blocks=[StatBlock(stats=STATS, steps=step_ids, values=values)], events=[],
        ))
    return time.perf_counter() - t0


def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    store = Store.open(url)
    seconds = populate(store, "big", args.steps, args.tensors)
    window = Window(width=args.width)
    store_ms = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        m = store.tensor_matrix("big", "amax", window)
        store_ms.append((time.perf_counter() - t) * 1e3)
    store.close()
    http_ms = []
    with serve(url) as base, httpx.Client(base_url=base, timeout=60) as client:
        for _ in range(args.repeat):
            t = time.perf_counter()
            r = client.get("/v1/runs/big/matrix", params={"stat": "amax", "width": args.width})
            r.raise_for_status()
            body = r.json()
            http_ms.append((time.perf_counter() - t) * 1e3)
    assert len(body["steps"]) == m.column_steps.size <= args.width
    return {
        "populate_s": seconds,
        "columns": int(m.column_steps.size),
        "bucket": m.bucket,
        "level": m.level,
        "store_ms_median": statistics.median(store_ms),
        "http_ms_median": statistics.median(http_ms),
        "response_bytes": len(r.content),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--width", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    result: dict[str, Any] = {"backend": args.backend, "steps": args.steps, "tensors": args.tensors,
                              "width": args.width}
    if args.backend == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            result.update(measure(f"sqlite:///{tmp}/big.db", args))
    else:
        import psycopg

        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
            admin.execute("DROP DATABASE IF EXISTS fp8guard_query_bench")
            admin.execute("CREATE DATABASE fp8guard_query_bench")
        try:
            result.update(measure(PG_ADMIN_URL.rsplit("/", 1)[0] + "/fp8guard_query_bench", args))
        finally:
            with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
                admin.execute("DROP DATABASE IF EXISTS fp8guard_query_bench WITH (FORCE)")
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.backend}: heatmap {args.tensors}x{args.steps} -> {result['columns']} columns: "
              f"store {result['store_ms_median']:.0f} ms, HTTP {result['http_ms_median']:.0f} ms")


if __name__ == "__main__":
    main()
