"""One load run of ``bench/load.py`` against a service: the agents and the probes over the
window, then the figures.

Afterwards every run's stored ``samples`` and ``ranks[].batches`` (``GET /v1/runs/{id}``)
are compared with what the answers acknowledged (``stored_equals_acked``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench._load_agents import Tally, _agent, _agent_thread
from bench._load_bodies import Batches, Prepared
from bench._load_probes import _probe
from bench._load_readings import _cpu_s, _lag_probe, _server_histogram, _stored, _within

WARMUP_S = 3.0
"""Latencies of batches sent in the first seconds (every agent's start at once) are left out of
``steady_p99_ms``; ``p99_ms`` and ``first_batch_p99_ms`` include them."""
PRE_ENCODE_RATE = 600.0
"""``--pre-encode --rate 0``: bodies prepared per agent per second of the window."""


async def _load(base: str, args: argparse.Namespace, tokens: dict[str, str] | None = None,
                server_pid: int | None = None) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:6]
    batches = Batches(args.tensors, args.stats, args.steps_per_batch)
    agent = {"authorization": f"Bearer {tokens['ingest']}"} if tokens else {}
    admin = {"authorization": f"Bearer {tokens['admin']}"} if tokens else {}

    def connection(n: int = 1) -> httpx.AsyncClient:
        # One client per agent, as in production: a single pool of 50+ connections cost the load
        # generator as much CPU per batch as the service (httpcore scans its whole pool per request)
        return httpx.AsyncClient(base_url=base, timeout=30.0, headers=agent,
                                 limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))

    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as stack:
        runs = [f"load-{tag}-{i}" for i in range(args.agents)]
        if args.client == "agent":
            # As the agent's shipper (fp8guard/agent/transport/link.py): its own blocking
            # httpx.Client, posting from a background thread, one batch at a time.
            blocking = [stack.enter_context(httpx.Client(base_url=base, timeout=30.0, headers=agent))
                        for _ in range(args.agents)]
            pool = stack.enter_context(ThreadPoolExecutor(max_workers=args.agents, thread_name_prefix="agent"))
            registered = await asyncio.gather(*(loop.run_in_executor(pool, functools.partial(
                c.put, f"/v1/runs/{run}", json={"model": "load"})) for c, run in zip(blocking, runs, strict=True)))
        else:
            clients = [await stack.enter_async_context(connection()) for _ in range(args.agents)]
            registered = await asyncio.gather(*(c.put(f"/v1/runs/{run}", json={"model": "load"})
                                                for c, run in zip(clients, runs, strict=True)))
        probers = [await stack.enter_async_context(connection(2)) for _ in range(args.decisions)]
        reader = await stack.enter_async_context(httpx.AsyncClient(base_url=base, timeout=30.0, headers=admin))
        for r in registered:
            r.raise_for_status()
        prepared = None
        if args.pre_encode:
            count = math.ceil(args.duration * (args.rate or PRE_ENCODE_RATE)) + 1
            prepared = [Prepared(batches, run, count) for run in runs]
        tally, probe_tally = Tally(), Tally()
        hist_start = await _server_histogram(reader)
        lags: list[float] = []
        stop = asyncio.Event()
        lag_task = asyncio.create_task(_lag_probe(lags, stop))
        cpu_start, client_cpu_start = _cpu_s(server_pid), time.process_time()
        t_start = time.monotonic() + 0.05
        t_end = t_start + args.duration
        probes = [asyncio.create_task(_probe(probers[i], batches, probe_tally, f"probe-{i}-{tag}",
                                             t_start + args.duration * (i + 0.5) / args.decisions))
                  for i in range(args.decisions)]
        if args.client == "agent":
            counts = await asyncio.gather(*(loop.run_in_executor(pool, _agent_thread, c, batches, tally, run, args.rate,
                                                                 t_start, t_end, prepared[i] if prepared else None)
                                            for i, (c, run) in enumerate(zip(blocking, runs, strict=True))))
        else:
            counts = await asyncio.gather(*(_agent(c, batches, tally, run, args.rate, t_start, t_end,
                                                   prepared[i] if prepared else None)
                                            for i, (c, run) in enumerate(zip(clients, runs, strict=True))))
        wall = time.monotonic() - t_start
        decisions = await asyncio.gather(*probes)
        server_cpu, client_cpu = _cpu_s(server_pid) - cpu_start, time.process_time() - client_cpu_start
        stop.set()
        await lag_task
        hist_end = await _server_histogram(reader)
        acked = {**tally.acked, **probe_tally.acked}
        stored = await asyncio.gather(*(_stored(reader, run) for run in acked))
    mismatched = []
    for (run, (batches_acked, samples_acked)), got in zip(acked.items(), stored, strict=True):
        if got != (batches_acked, samples_acked):
            mismatched.append(got if isinstance(got, str) else f"{run}: stored {got[0]} batches/{got[1]} "
                              f"samples, acked {batches_acked}/{samples_acked}")
    lat = np.array(tally.latencies) * 1e3
    is_first = np.zeros(lat.size, dtype=bool)
    is_first[tally.first] = True
    sent = np.array(tally.sent_at)
    # steady state: batches sent after WARMUP_S, once every agent's run exists with its tensor table
    steady, first = lat[sent >= sent.min() + WARMUP_S] if lat.size else lat, lat[is_first]
    ms = [d for d, _ in decisions if d is not None]
    if os.environ.get("FP8GUARD_LOAD_TRACE"):  # every answer: seconds since the start, latency ms
        Path(os.environ["FP8GUARD_LOAD_TRACE"]).write_text(json.dumps(
            [[round(t - sent.min(), 4), round(x, 2)] for t, x in zip(sent.tolist(), lat.tolist(), strict=True)]))
    return {
        "database": args.database, "client": args.client, "agents": args.agents, "rate": args.rate, "duration_s": args.duration,
        "tensors": args.tensors, "stats": len(batches.stats), "steps_per_batch": args.steps_per_batch,
        "samples_per_batch": args.steps_per_batch * args.tensors, "batches": len(tally.latencies),
        "batches_per_s": round(len(tally.latencies) / wall, 2),
        "offered_per_s": round(sum(due for due, _ in counts) / args.duration, 2),
        "p50_ms": round(float(np.percentile(lat, 50)), 2) if lat.size else None,
        "p99_ms": round(float(np.percentile(lat, 99)), 2) if lat.size else None,
        "max_ms": round(float(lat.max()), 2) if lat.size else None,
        # each agent's first batch carries its tensor table and starts its run's state; with every
        # agent starting in the same second they come as one burst, reported on its own
        "warmup_s": WARMUP_S,
        "steady_p99_ms": round(float(np.percentile(steady, 99)), 2) if steady.size else None,
        "first_batch_p99_ms": round(float(np.percentile(first, 99)), 2) if first.size else None,
        # the service process's CPU time over the load (all its threads), per batch answered
        "server_cpu_ms_per_batch": round(server_cpu * 1e3 / max(1, len(tally.latencies)), 2)
        if server_pid is not None else None,
        # the load generator's own CPU per batch (all its threads) and how late its event loop ran:
        # on a shared machine its delays are part of every latency above
        "client_cpu_ms_per_batch": round(client_cpu * 1e3 / max(1, len(tally.latencies)), 2),
        "client_loop_lag_ms": {"p99": round(float(np.percentile(lags, 99)), 1) if lags else None,
                               "max": round(max(lags), 1) if lags else None},
        # the service's own timing of /v1/ingest (its latency histogram): share answered within N ms
        "server_within_ms": _within(hist_start, hist_end),
        # --pre-encode: bodies built before the window (per agent) and any built in it after all
        "pre_encoded": {"bodies_per_agent": len(prepared[0].parts),
                        "built_in_window": sum(p.built_in_window for p in prepared)} if prepared else None,
        "errors": tally.errors,
        "error_examples": tally.examples + probe_tally.examples[:3 - len(tally.examples)],
        "stored_equals_acked": not mismatched and bool(acked), "mismatches": mismatched[:3],
        "decision_latency_ms": {"median": round(statistics.median(ms), 2) if ms else None,
                                "max": round(max(ms), 2) if ms else None, "n": len(ms),
                                "in_answer": sum(1 for _, inside in decisions if inside),
                                "failed": len(decisions) - len(ms)},
    }
