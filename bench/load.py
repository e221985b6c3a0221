"""Many agents, small frequent batches: latency, throughput, durability and decision latency.

Each simulated agent is one run (``PUT /v1/runs/{id}``) that ships its tensor table in its
first batch, then batches of ``--steps-per-batch`` steps (loss, grad_norm, lr, time) with one
gzip-compressed stats block of ``--stats`` stats x ``--tensors`` tensors, healthy values only
(no detector rule fires). Throttled agents (``--rate`` batches/s each) send on absolute times
from a random start offset, so a slow answer does not lower the offered rate; ``--rate 0``
sends back to back. Like the real shipper, an agent sends its next batch only after the
answer to the previous one; there are no retries, a non-2xx answer or a transport error is
counted as an error. Latency is from send to the full answer (body built beforehand); the
percentiles are over 2xx answers.

Afterwards every run's stored ``samples`` and ``ranks[].batches`` (``GET /v1/runs/{id}``)
are compared with what the answers acknowledged (``stored_equals_acked``). ``--decisions K``
probes, spread over the load, each register a run, send a healthy batch, long-poll
``/v1/runs/{id}/commands?wait=10`` (or poll it every 5 ms where ``wait`` is ignored) and send a
batch whose last loss is NaN and one of whose amaxes is infinite: the decision latency is from that batch's answer to the first
non-empty command list (0 and counted ``in_answer`` when the answer itself carried it).

How agents send (``--client``): ``agent``, the default with ``--rate 0``, is the agent's own
transport: each agent a thread with a blocking ``httpx.Client`` that posts one batch and waits
for its answer (``fp8guard/agent/transport/link.py``, ``delivery.py``'s ``Courier``); ``async``,
the default otherwise, runs every agent as a task of one event loop, an ``httpx.AsyncClient``
each. Both report the load generator's CPU per batch; on the 2-core bench host the async client
took ~2x the CPU per request of the blocking one (2.5 vs 1.24 ms), CPU the service on the same
host then lacked, so one unthrottled agent measured the load generator as much as the service.

    python bench/load.py --agents 50 --rate 1 --duration 30 --json
    python bench/load.py --agents 1 --rate 0 --duration 15 --json
    python bench/load.py --database both --agents 200 --rate 0.5
    python bench/load.py --url http://127.0.0.1:8000 --agents 20    # an already running service
    python bench/load.py --auth --agents 50 --rate 1 --json        # as deployed: tokens required

With ``--auth`` the service requires tokens: the agents send one ingest token (each run is then
checked against the token that registered it, as in production) and the stored-equals-acked
check reads with an admin token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._serve import serve_process
from fp8guard import wire

STAT_NAMES = ("amax", "scale", "saturation", "amax_history_max", "overflows", "underflows")
ROLES = (("fwd_input", "e4m3"), ("fwd_weight", "e4m3"), ("bwd_grad_output", "e5m2"))
PG_ADMIN_URL = os.environ.get("FP8GUARD_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
PG_LOAD_DB = f"fp8guard_load_{os.getpid()}"
"""One database per load generator: two runs on one PostgreSQL (side-by-side comparisons) never drop
each other's."""
WARMUP_S = 3.0
"""Latencies of batches sent in the first seconds (every agent's start at once) are left out of
``steady_p99_ms``; ``p99_ms`` and ``first_batch_p99_ms`` include them."""
HEADERS = {"content-type": "application/json", "content-encoding": "gzip"}
WAIT_S = 10.0  # long-poll wait, and the give-up time of a decision probe
POLL_S = 0.005  # polling period where the commands endpoint ignores wait
PRE_ENCODE_RATE = 600.0
"""``--pre-encode --rate 0``: bodies prepared per agent per second of the window."""
VARIANTS = 8  # pre-encoded stats blocks, used in turn
_MARK = "@fp8guard-load-block@"  # where a block's pre-compressed JSON string goes in a body


class Batches:
    """Pre-encodes the float32 blocks once, shared by every agent; a batch adds ids, steps and scalars."""

    def __init__(self, tensors: int, stats: int, steps: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.stats = [*STAT_NAMES[:stats], *(f"extra{k}" for k in range(stats - len(STAT_NAMES)))]
        self.n_tensors, self.steps, self.rng = tensors, steps, random.Random(seed)
        level = rng.lognormal(0.0, 1.0, size=tensors)  # each tensor's typical amax
        hist = level * 1.25  # the amax history's maximum: the delayed-scaling scale keeps headroom
        self.blocks: list[str] = []
        self.gzipped: list[bytes] = []
        """Each block's JSON string, gzipped once: a body is sent as three gzip members (RFC 1952
        allows several; the service reads them whole), so the load generator compresses only the
        few hundred bytes that change. The service inflates exactly as many bytes either way."""
        for _ in range(VARIANTS):
            amax = level * np.exp(rng.normal(0.0, 0.02, size=(steps, tensors)))
            cols = {"amax": amax, "scale": np.broadcast_to(448.0 / hist, amax.shape),
                    "saturation": amax / hist, "amax_history_max": np.broadcast_to(hist, amax.shape)}
            values = np.stack([cols.get(name, np.zeros_like(amax)) for name in self.stats], axis=1)
            self.blocks.append(wire.encode_f32(values.astype("<f4").tobytes()))
            self.gzipped.append(wire.gzip_body(json.dumps(self.blocks[-1]).encode()))
        self.table = [{"index": i, "name": f"layers.{i // 3}.fc:{ROLES[i % 3][0]}",
                       "module": f"layers.{i // 3}.fc", "role": ROLES[i % 3][0], "format": ROLES[i % 3][1]}
                      for i in range(tensors)]

    def body(self, run_id: str, first_step: int, k: int, *, with_tensors: bool,
             nan_last: bool = False) -> bytes:
        head, packed, tail = self.parts(run_id, first_step, k, with_tensors=with_tensors, nan_last=nan_last)
        return head + packed + tail

    def parts(self, run_id: str, first_step: int, k: int, *, with_tensors: bool,
              nan_last: bool = False) -> tuple[bytes, bytes, bytes]:
        """A body as its three gzip members: the gzipped head and tail (ids, steps, scalars) and
        the shared pre-compressed block between them."""
        steps = list(range(first_step, first_step + self.steps))
        now, g = time.time(), self.rng.gauss
        rows = [{"step": s, "time": now, "loss": 2.5 + 0.01 * g(0, 1), "grad_norm": 1.0 + 0.05 * g(0, 1),
                 "lr": 3e-4} for s in steps]
        data, packed = self.blocks[k % VARIANTS], self.gzipped[k % VARIANTS]
        if nan_last:
            # A NaN loss and, on the same step, an infinite amax in one tensor: FP8 evidence, so the
            # service's answer is a BF16 fallback of that module (a NaN alone, with no checkpoint
            # to roll back to, pages a person instead).
            rows[-1]["loss"] = math.nan  # make_batch sends it as "NaN"
            values = np.frombuffer(wire.decode_f32(data), dtype="<f4").reshape(
                self.steps, len(self.stats), self.n_tensors).copy()
            values[-1, 0, 0] = np.inf
            data = wire.encode_f32(values.tobytes())
            packed = wire.gzip_body(json.dumps(data).encode())
        payload = wire.make_batch(
            run_id=run_id, tensors=self.table if with_tensors else (), steps=rows,
            tensor_stats=[{"stats": self.stats, "steps": steps, "n_tensors": self.n_tensors, "dtype": "<f4",
                           "data": _MARK}])
        head, tail = wire.dumps(payload).split(json.dumps(_MARK).encode())
        return wire.gzip_body(head), packed, wire.gzip_body(tail)


class Prepared:
    """``--pre-encode``: one agent's bodies, built before the timed window (distinct batch ids,
    steps increasing), so the window measures the HTTP round trips without the body building that
    a real agent does on the training host. Kept as gzip members (the stats block is shared), so
    thousands of them cost a few MB; an agent that sends more than were prepared builds the rest
    in the window and counts them (``pre_encoded.built_in_window``)."""

    def __init__(self, batches: Batches, run_id: str, count: int) -> None:
        self.parts = [batches.parts(run_id, k * batches.steps, k, with_tensors=k == 0) for k in range(count)]
        self.built_in_window = 0


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)  # seconds, 2xx answers
    first: list[int] = field(default_factory=list)  # indexes into latencies: each agent's first batch
    sent_at: list[float] = field(default_factory=list)  # perf_counter at send, per latency
    errors: int = 0
    examples: list[str] = field(default_factory=list)
    acked: dict[str, list[int]] = field(default_factory=dict)  # run -> [batches, samples]
    lock: threading.Lock = field(default_factory=threading.Lock)  # agent threads (--client agent)

    def error(self, text: str) -> None:
        with self.lock:
            self.errors += 1
            if len(self.examples) < 3:
                self.examples.append(text[:200])

    def answered(self, run_id: str, t0: float, r: httpx.Response, first: bool) -> dict[str, Any] | None:
        """Record one answer (sent at ``t0``, ``perf_counter``): its latency and what it
        acknowledged; None (an error counted) for a non-2xx answer."""
        latency = time.perf_counter() - t0
        if not r.is_success:
            self.error(f"{r.status_code} {r.text}")
            return None
        answer: dict[str, Any] = r.json()
        with self.lock:
            self.latencies.append(latency)
            self.sent_at.append(t0)
            if first:
                self.first.append(len(self.latencies) - 1)
            acked = self.acked.setdefault(run_id, [0, 0])
            if not answer.get("duplicate"):
                acked[0] += 1
                acked[1] += int(answer.get("samples", 0))
        return answer


async def _send(client: httpx.AsyncClient, tally: Tally, run_id: str, body: bytes,
                first: bool = False) -> dict[str, Any] | None:
    t0 = time.perf_counter()
    try:
        r = await client.post("/v1/ingest", content=body, headers=HEADERS)
    except httpx.HTTPError as exc:
        tally.error(f"{type(exc).__name__}: {exc}")
        return None
    return tally.answered(run_id, t0, r, first)


class _Plan:
    """One agent's sending plan, shared by both clients: when each batch is due, its body, and
    whether the run's tensor table went out yet (the first batch that succeeds carries it)."""

    def __init__(self, batches: Batches, run_id: str, rate: float, t_start: float, t_end: float,
                 prepared: Prepared | None) -> None:
        self.batches, self.run_id, self.rate, self.prepared = batches, run_id, rate, prepared
        self.t_start, self.t_end = t_start, t_end
        self.offset = random.uniform(0.0, 1.0 / rate) if rate > 0 else 0.0
        self.due = self.sent = self.step = 0
        self.have_table = False

    def __iter__(self) -> Iterator[tuple[int, float | None]]:
        """(batch number, its absolute due time or None: back to back) until the window ends."""
        limit = math.ceil((self.t_end - self.t_start) * self.rate) + 1 if self.rate > 0 else 10_000_000
        for k in range(limit):
            if self.rate > 0:
                at = self.t_start + self.offset + k / self.rate
                if at >= self.t_end:
                    return
                self.due += 1
                yield k, at
            elif time.monotonic() >= self.t_end:
                return
            else:
                yield k, None

    def body(self, k: int) -> bytes:
        prepared = self.prepared
        if prepared is not None and k < len(prepared.parts) and (k == 0) != self.have_table:
            head, packed, tail = prepared.parts[k]
            body = head + packed + tail  # a copy of ~20 KB: microseconds
        else:
            if prepared is not None:
                prepared.built_in_window += 1
            body = self.batches.body(self.run_id, self.step, k, with_tensors=not self.have_table)
        self.step += self.batches.steps
        self.sent += 1
        return body

    def answered(self, ok: bool) -> None:
        self.have_table = ok or self.have_table

    def counts(self) -> tuple[int, int]:
        """(batches due in the window, batches sent)."""
        return (self.due if self.rate > 0 else self.sent), self.sent


async def _agent(client: httpx.AsyncClient, batches: Batches, tally: Tally, run_id: str, rate: float,
                 t_start: float, t_end: float, prepared: Prepared | None = None) -> tuple[int, int]:
    """Returns (batches due in the window, batches sent)."""
    plan = _Plan(batches, run_id, rate, t_start, t_end, prepared)
    for k, at in plan:
        if at is not None and (delay := at - time.monotonic()) > 0:
            await asyncio.sleep(delay)
        first = not plan.have_table
        plan.answered(await _send(client, tally, run_id, plan.body(k), first=first) is not None)
    return plan.counts()


def _send_sync(client: httpx.Client, tally: Tally, run_id: str, body: bytes, first: bool = False) -> bool:
    """``_send`` as the agent's shipper does it: a blocking ``httpx.Client.post`` from its own thread."""
    t0 = time.perf_counter()
    try:
        r = client.post("/v1/ingest", content=body, headers=HEADERS)
    except httpx.HTTPError as exc:
        tally.error(f"{type(exc).__name__}: {exc}")
        return False
    return tally.answered(run_id, t0, r, first) is not None


def _agent_thread(client: httpx.Client, batches: Batches, tally: Tally, run_id: str, rate: float,
                  t_start: float, t_end: float, prepared: Prepared | None = None) -> tuple[int, int]:
    """``_agent`` in a thread of its own with a blocking client (``--client agent``)."""
    plan = _Plan(batches, run_id, rate, t_start, t_end, prepared)
    for k, at in plan:
        if at is not None and (delay := at - time.monotonic()) > 0:
            time.sleep(delay)
        first = not plan.have_table
        plan.answered(_send_sync(client, tally, run_id, plan.body(k), first=first))
    return plan.counts()


async def _commands(client: httpx.AsyncClient, run_id: str, wait: bool) -> tuple[list[Any], float]:
    params = {"wait": str(WAIT_S), "after": "0"} if wait else {}
    try:
        r = await client.get(f"/v1/runs/{run_id}/commands", params=params)
        got = r.json() if r.is_success else []
    except httpx.HTTPError:
        got = []
    return (got if isinstance(got, list) else []), time.monotonic()


async def _probe(client: httpx.AsyncClient, batches: Batches, tally: Tally, run_id: str,
                 at: float) -> tuple[float | None, bool]:
    """Returns (decision latency in ms or None when no command came, whether it came in the answer)."""
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    try:
        (await client.put(f"/v1/runs/{run_id}", json={"model": "load"})).raise_for_status()
    except httpx.HTTPError as exc:
        tally.error(f"probe PUT: {exc}")
        return None, False
    if await _send(client, tally, run_id, batches.body(run_id, 0, 0, with_tensors=True)) is None:
        return None, False
    poll = asyncio.create_task(_commands(client, run_id, wait=True))
    t_poll = time.monotonic()
    answer = await _send(client, tally, run_id, batches.body(run_id, batches.steps, 1, with_tensors=False,
                                                            nan_last=True))
    t_ack = time.monotonic()
    if answer is None or answer.get("commands"):
        poll.cancel()
        return (None, False) if answer is None else (0.0, True)
    got, t_back = await poll
    if got:
        return (t_back - t_ack) * 1e3, False
    if t_back - t_poll < WAIT_S / 2:  # the endpoint ignored wait: poll it
        while time.monotonic() < t_ack + WAIT_S:
            got, t_back = await _commands(client, run_id, wait=False)
            if got:
                return (t_back - t_ack) * 1e3, False
            await asyncio.sleep(POLL_S)
    tally.error(f"probe {run_id}: no command within {WAIT_S:g} s of the NaN batch")
    return None, False


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


def _tokens(database_url: str) -> dict[str, str]:
    """An ingest and an admin token in a migrated database, made as an operator would."""
    from fp8guard.service.auth.tokens import issue_token
    from fp8guard.service.kinds import Role
    from fp8guard.service.store import Store, make_engine, upgrade

    engine = make_engine(database_url)
    upgrade(engine)
    engine.dispose()
    store = Store.open(database_url)
    try:
        tag = uuid.uuid4().hex[:6]
        return {role: issue_token(store, name=f"load-{role}-{tag}", role=Role(role))[0] for role in ("ingest", "admin")}
    finally:
        store.close()


def _run(database_url: str, args: argparse.Namespace) -> dict[str, Any]:
    tokens = _tokens(database_url) if args.auth else None
    with serve_process(database_url, auth=args.auth) as served:  # serve migrates the database
        return {**asyncio.run(_load(served.base, args, tokens, served.proc.pid)), "auth": args.auth}


def _sqlite(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        return _run(f"sqlite:///{Path(tmp) / 'load.db'}", args)


def _postgres(args: argparse.Namespace) -> dict[str, Any]:
    import psycopg

    with psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=3) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {PG_LOAD_DB} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {PG_LOAD_DB}")
    try:
        return _run(PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{PG_LOAD_DB}", args)
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {PG_LOAD_DB} WITH (FORCE)")


def _print_table(results: dict[str, dict[str, Any]]) -> None:
    print(f"{'database':10} {'agents':>6} {'rate':>5} {'offered/s':>9} {'batches/s':>9} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'max ms':>8} {'errors':>6} {'stored=acked':>12} {'decision ms (med/max)':>22}")
    for name, r in results.items():
        d = r["decision_latency_ms"]
        dec = f"{d['median']}/{d['max']} ({d['in_answer']}/{d['n']} in answer)" if d["n"] else "-"
        print(f"{name:10} {r['agents']:>6} {r['rate']:>5g} {r['offered_per_s']:>9} {r['batches_per_s']:>9} "
              f"{r['p50_ms']!s:>8} {r['p99_ms']!s:>8} {r['max_ms']!s:>8} {r['errors']:>6} "
              f"{r['stored_equals_acked']!s:>12} {dec:>22}")
        for example in r["error_examples"] + r["mismatches"]:
            print(f"  {example}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", choices=("sqlite", "postgresql", "both"), default="sqlite")
    parser.add_argument("--url", help="use this already running service (127.0.0.1) instead of starting one")
    parser.add_argument("--agents", type=int, default=50)
    parser.add_argument("--rate", type=float, default=1.0, help="batches/s per agent; 0: back to back")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load")
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--stats", type=int, default=4, help=f"the first N of {', '.join(STAT_NAMES)}, ...")
    parser.add_argument("--steps-per-batch", type=int, default=10)
    parser.add_argument("--decisions", type=int, default=5, help="decision-latency probes")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--pre-encode", action="store_true",
                        help="build every agent's bodies before the timed window (the agent's encoding runs on the "
                             "training host in production); the default builds each body just before sending it")
    parser.add_argument("--auth", action="store_true", help="require tokens (FP8GUARD_AUTH=required), as deployed")
    parser.add_argument("--client", choices=("agent", "async"),
                        help="agent: each agent a thread with a blocking httpx.Client, as the agent's shipper sends; "
                             "async: every agent a task on one event loop with an httpx.AsyncClient. "
                             "Default: agent with --rate 0, async otherwise")
    args = parser.parse_args()
    args.client = args.client or ("agent" if args.rate == 0 else "async")
    if min(args.agents, args.tensors, args.stats, args.steps_per_batch) < 1 or args.rate < 0 \
            or not 0 < args.duration <= 3600 or args.decisions < 0:
        parser.error("need agents, tensors, stats, steps-per-batch >= 1; rate >= 0; 0 < duration <= 3600; "
                     "decisions >= 0")
    if args.url is not None and httpx.URL(args.url).host not in ("127.0.0.1", "localhost"):
        parser.error("--url must point at 127.0.0.1")

    results: dict[str, dict[str, Any]] = {}
    if args.url is not None:
        args.database = "url"
        results["url"] = asyncio.run(_load(args.url.rstrip("/"), args))
    for name, run in (("sqlite", _sqlite), ("postgresql", _postgres)):
        if args.url is None and args.database in (name, "both"):
            results[name] = run(argparse.Namespace(**{**vars(args), "database": name}))
    if args.json:
        print(json.dumps(results if len(results) > 1 else next(iter(results.values()))))
    else:
        _print_table(results)


if __name__ == "__main__":
    main()
