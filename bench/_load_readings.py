"""What a load run of ``bench/load.py`` reads besides the answers: each run's stored counts, the
service process's CPU time, the load generator's event-loop lag, and the service's own latency
histogram of ``/v1/ingest``."""

from __future__ import annotations

import asyncio
import math
import os
import time
from pathlib import Path

import httpx


async def _stored(client: httpx.AsyncClient, run_id: str) -> tuple[int, int] | str:
    try:
        r = await client.get(f"/v1/runs/{run_id}")
        r.raise_for_status()
        ranks = r.json()["ranks"]
        return sum(int(x["batches"]) for x in ranks), sum(int(x["samples"]) for x in ranks)
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        return f"GET {run_id}: {exc}"


def _cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) a process has used so far, from /proc (0 without a pid)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _lag_probe(lags: list[float], stop: asyncio.Event) -> None:
    """How late this process's event loop wakes a 5 ms sleep: the load generator's own delay,
    which every latency it measures includes."""
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.005)
        lags.append((time.perf_counter() - t - 0.005) * 1e3)


async def _server_histogram(client: httpx.AsyncClient) -> dict[float, float]:
    """The service's own latency histogram of ``/v1/ingest`` (cumulative counts by bucket bound)."""
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return {}
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("fp8guard_http_request_duration_seconds_bucket{") and 'route="/v1/ingest"' in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[math.inf if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def _within(before: dict[float, float], after: dict[float, float]) -> dict[str, float] | None:
    """Share of the ingest answers the service itself timed within each bucket bound (ms)."""
    total = after.get(math.inf, 0.0) - before.get(math.inf, 0.0)
    if not total:
        return None
    return {f"{le * 1e3:g}": round((n - before.get(le, 0.0)) / total, 4) for le, n in sorted(after.items())
            if 0.05 <= le <= 0.5}
