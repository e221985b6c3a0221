"""Sustained ingest through the HTTP API: one ``fp8guard serve`` process, loopback clients.

A run with 1,000 tensors x 4 stats per step (amax, scale, saturation, amax_history_max) is
streamed in batches of ``--batch-steps`` steps, the way the agent ships it (wire protocol v1,
base64 float32). One sample = one tensor's stats at one step.

    python bench/ingest.py --json                 # SQLite, and PostgreSQL if reachable
    python bench/ingest.py --json --peer          # also MLflow's tracking server, side by side

Prints one JSON line: ``samples_per_s`` (SQLite) plus per-backend figures and bytes stored
per sample; with ``--peer`` the ratio against MLflow measured in the same run. Detection runs
off the request path: ``samples_per_s`` counts until the closed loop has judged every stored
batch (detection and policy included), ``ingest_samples_per_s`` until the last answer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._serve import serve
from fp8guard import wire

STATS = ("amax", "scale", "saturation", "amax_history_max")
PG_ADMIN_URL = os.environ.get("FP8GUARD_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
PG_BENCH_DB = f"fp8guard_bench_{uuid.uuid4().hex[:8]}"
"""A database of this run's own: two sessions benchmarking at once never drop each other's."""


def _tensors(n: int) -> list[dict[str, Any]]:
    return [{"index": i, "name": f"layers.{i // 4}.op{i % 4}", "module": f"layers.{i // 4}", "role": "fwd_input",
             "format": "e4m3"} for i in range(n)]


class Payloads:
    """Pre-encodes the float32 data once; each batch only changes its id and steps."""

    def __init__(self, run_id: str, n_tensors: int, batch_steps: int) -> None:
        rng = np.random.default_rng(0)
        values = rng.lognormal(size=(batch_steps, len(STATS), n_tensors)).astype("<f4")
        self.data = wire.encode_f32(values.tobytes())
        self.run_id, self.n_tensors, self.batch_steps = run_id, n_tensors, batch_steps

    def body(self, first_step: int, *, with_tensors: bool) -> bytes:
        steps = list(range(first_step, first_step + self.batch_steps))
        payload = wire.make_batch(
            run_id=self.run_id,
            tensors=_tensors(self.n_tensors) if with_tensors else (),
            steps=[{"step": s, "time": time.time(), "loss": 2.5, "grad_norm": 1.0, "lr": 3e-4} for s in steps],
            tensor_stats=[{"stats": list(STATS), "steps": steps, "n_tensors": self.n_tensors, "dtype": "<f4",
                           "data": self.data}],
        )
        return wire.dumps(payload)


def _judged_batches(c: httpx.Client) -> int:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("fp8guard_loop_batches_total "):
            return int(float(line.split()[1]))
    return 0


def _run_clients(base: str, payloads: Payloads, seconds: float, clients: int) -> tuple[int, float, float]:
    """Each client thread sends batches back to back; returns (samples stored, seconds until the
    last answer, seconds until the closed loop had judged every stored batch)."""
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=base, timeout=60) as c:
        c.put(f"/v1/runs/{payloads.run_id}", json={"model": "bench", "world_size": 1}).raise_for_status()
        c.post("/v1/ingest", content=payloads.body(0, with_tensors=True), headers=headers).raise_for_status()
    lock = threading.Lock()
    next_step = [payloads.batch_steps]
    stored = [0]
    batches = [1]
    errors: list[str] = []
    stop_at = time.perf_counter() + seconds

    def worker() -> None:
        with httpx.Client(base_url=base, timeout=60) as c:
            while time.perf_counter() < stop_at:
                with lock:
                    first = next_step[0]
                    next_step[0] += payloads.batch_steps
                body = payloads.body(first, with_tensors=False)
                r = c.post("/v1/ingest", content=body, headers=headers)
                if r.status_code != 200:
                    errors.append(r.text[:200])
                    return
                with lock:
                    stored[0] += r.json()["samples"]
                    batches[0] += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"ingest failed: {errors[0]}")
    # Detection runs off the request path: the figure that includes it waits for the loop to catch up.
    with httpx.Client(base_url=base, timeout=60) as c:
        deadline = time.perf_counter() + 300
        while _judged_batches(c) < batches[0]:
            if time.perf_counter() > deadline:
                raise RuntimeError("the closed loop did not catch up within 300 s")
            time.sleep(0.02)
    return stored[0], elapsed, time.perf_counter() - t0


def _sqlite(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.db"
        with serve(f"sqlite:///{path}") as base:
            payloads = Payloads(f"bench-{uuid.uuid4().hex[:6]}", args.tensors, args.batch_steps)
            samples, elapsed, judged = _run_clients(base, payloads, args.seconds, args.clients)
        import sqlite3

        con = sqlite3.connect(path)
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        con.close()
        size = sum(p.stat().st_size for p in Path(tmp).iterdir())
        total = samples + args.tensors * args.batch_steps  # include the first batch
    return {"samples_per_s": samples / judged, "ingest_samples_per_s": samples / elapsed, "samples": total,
            "bytes_per_sample": size / total}


def _postgres(args: argparse.Namespace) -> dict[str, Any] | None:
    try:
        import psycopg

        admin = psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=3)
    except Exception as exc:
        print(f"postgres skipped: {exc}", file=sys.stderr)
        return None
    with admin:
        admin.execute(f"CREATE DATABASE {PG_BENCH_DB}")
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{PG_BENCH_DB}"
    try:
        with serve(url) as base:
            payloads = Payloads(f"bench-{uuid.uuid4().hex[:6]}", args.tensors, args.batch_steps)
            samples, elapsed, judged = _run_clients(base, payloads, args.seconds, args.clients)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM")
            size = conn.execute(
                "SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = 'public' AND c.relkind = 'r'"
            ).fetchone()[0]
        total = samples + args.tensors * args.batch_steps
        return {"samples_per_s": samples / judged, "ingest_samples_per_s": samples / elapsed, "samples": total,
                "bytes_per_sample": int(size) / total}
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {PG_BENCH_DB} WITH (FORCE)")


def _peer(backend: str, seconds: float) -> dict[str, Any] | None:
    script = Path(__file__).with_name("mlflow_peer.py")
    proc = subprocess.run([sys.executable, str(script), "--json", "--backend", backend, "--seconds", str(seconds)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        print(f"mlflow peer ({backend}) failed: {proc.stderr[-500:]}", file=sys.stderr)
        return None
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per backend")
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--batch-steps", type=int, default=100, help="steps per ingest batch")
    parser.add_argument("--clients", type=int, default=2, help="concurrent loopback clients")
    parser.add_argument("--backend", choices=("all", "sqlite", "postgres"), default="all")
    parser.add_argument("--peer", action="store_true", help="also measure MLflow's tracking server (slow)")
    args = parser.parse_args()

    result: dict[str, Any] = {"tensors": args.tensors, "stats": len(STATS), "batch_steps": args.batch_steps,
                              "clients": args.clients}
    if args.backend in ("all", "sqlite"):
        result["sqlite"] = _sqlite(args)
        result["samples_per_s"] = result["sqlite"]["samples_per_s"]
    if args.backend in ("all", "postgres"):
        pg = _postgres(args)
        if pg is not None:
            result["postgres"] = pg
            result.setdefault("samples_per_s", pg["samples_per_s"])
    if args.peer:
        for backend in ("sqlite", "postgres"):
            if backend in result and (peer := _peer(backend, args.seconds)) is not None:
                result[backend]["mlflow_samples_per_s"] = peer["samples_per_s"]
                result[backend]["ratio_vs_mlflow"] = result[backend]["samples_per_s"] / peer["samples_per_s"]
    if args.json:
        print(json.dumps(result))
    else:
        for backend in ("sqlite", "postgres"):
            if backend in result:
                r = result[backend]
                print(f"{backend:9} {r['samples_per_s']:>14,.0f} samples/s  {r['bytes_per_sample']:.1f} bytes/sample")


if __name__ == "__main__":
    main()
