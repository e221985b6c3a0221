"""The load of ``bench/mlflow_peer.py``: a keep-alive stdlib client that posts ``log-batch`` calls of
up to 1,000 metrics (250 tensors x 4 stats at one step) back to back, a warm-up and then the
measured stretch, and a check that the server stored one point per step."""

from __future__ import annotations

import http.client
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from bench._mlflow_log import log

# MLflow's per-call cap for log-batch (mlflow/utils/validation.py: MAX_METRICS_PER_BATCH).
MLFLOW_MAX_METRICS_PER_BATCH = 1000
STATS = ("amax", "scale", "underflow_frac", "overflow_frac")
METRICS_PER_SAMPLE = len(STATS)
MIN_WARMUP_CALLS = 3

LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"


class Client:
    """Minimal keep-alive JSON client for MLflow's REST API (stdlib only)."""

    def __init__(self, host: str, port: int) -> None:
        self.conn = http.client.HTTPConnection(host, port, timeout=60)
        self.headers = {"Content-Type": "application/json"}

    def post(self, path: str, body: bytes) -> dict[str, Any]:
        self.conn.request("POST", path, body=body, headers=self.headers)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"POST {path} -> {resp.status}: {data[:500]!r}")
        return json.loads(data) if data else {}

    def get(self, path: str) -> dict[str, Any]:
        self.conn.request("GET", path)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"GET {path} -> {resp.status}: {data[:500]!r}")
        return json.loads(data) if data else {}

    def close(self) -> None:
        self.conn.close()


def batch_body(run_id: str, keys: list[str], step: int) -> bytes:
    ts = int(time.time() * 1000)
    metrics = [
        {"key": k, "value": 1.0 + ((step * 31 + i) % 997) / 1000.0, "timestamp": ts, "step": step}
        for i, k in enumerate(keys)
    ]
    return json.dumps({"run_id": run_id, "metrics": metrics}).encode()


@dataclass
class Result:
    calls: int
    metrics: int
    seconds: float


def run_load(host: str, port: int, seconds: float, warmup: float, per_call: int) -> Result:
    client = Client(host, port)
    try:
        exp = client.post(
            "/api/2.0/mlflow/experiments/create",
            json.dumps({"name": f"fp8guard-peer-bench-{os.getpid()}-{time.time_ns()}"}).encode(),
        )
        run = client.post(
            "/api/2.0/mlflow/runs/create",
            json.dumps(
                {"experiment_id": exp["experiment_id"], "start_time": int(time.time() * 1000)}
            ).encode(),
        )
        run_id: str = run["run"]["info"]["run_id"]
        tensors = per_call // METRICS_PER_SAMPLE
        keys = [f"layers.{i}.{s}" for i in range(tensors) for s in STATS]

        step = 0
        t_end = time.perf_counter() + warmup
        while step < MIN_WARMUP_CALLS or time.perf_counter() < t_end:
            client.post(LOG_BATCH, batch_body(run_id, keys, step))
            step += 1
        log(f"warm-up: {step} calls; load avg {os.getloadavg()[0]:.2f}; measuring for {seconds:.1f}s")

        calls = 0
        t0 = time.perf_counter()
        deadline = t0 + seconds
        t1 = t0
        latencies: list[float] = []
        while t1 < deadline:
            # Body is built inside the timed loop, as a real logger would have to.
            client.post(LOG_BATCH, batch_body(run_id, keys, step))
            step += 1
            calls += 1
            t_prev, t1 = t1, time.perf_counter()
            latencies.append(t1 - t_prev)
        elapsed = t1 - t0
        latencies.sort()
        log(
            f"measured: {calls} calls in {elapsed:.2f}s; per call p50 {latencies[len(latencies) // 2]:.3f}s"
            f" max {latencies[-1]:.3f}s; load avg {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
        )

        # Sanity check: the server really stored one point per step for a key.
        hist = client.get(f"/api/2.0/mlflow/metrics/get-history?run_id={run_id}&metric_key={keys[0]}")
        stored = len(hist.get("metrics", []))
        if stored != step:
            log(f"WARNING: {keys[0]} has {stored} stored points, expected {step}")
        else:
            log(f"verified: {keys[0]} has {stored} points (warm-up + measured steps)")
        return Result(calls=calls, metrics=calls * len(keys), seconds=elapsed)
    finally:
        client.close()
