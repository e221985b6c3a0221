"""The simulated agents of ``bench/load.py``: each sends its run's batches one at a time, and a
tally of their answers.

Throttled agents (``--rate`` batches/s each) send on absolute times from a random start offset,
so a slow answer does not lower the offered rate; ``--rate 0`` sends back to back. Like the real
shipper, an agent sends its next batch only after the answer to the previous one; there are no
retries, a non-2xx answer or a transport error is counted as an error. Latency is from send to
the full answer (body built beforehand); the percentiles are over 2xx answers.

How agents send (``--client``): ``agent``, the default with ``--rate 0``, is the agent's own
transport: each agent a thread with a blocking ``httpx.Client`` that posts one batch and waits
for its answer (``fp8guard/agent/transport/link.py``, ``delivery.py``'s ``Courier``); ``async``,
the default otherwise, runs every agent as a task of one event loop, an ``httpx.AsyncClient``
each. Both report the load generator's CPU per batch; on the 2-core bench host the async client
took ~2x the CPU per request of the blocking one (2.5 vs 1.24 ms), CPU the service on the same
host then lacked, so one unthrottled agent measured the load generator as much as the service.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench._load_bodies import Batches, Prepared

HEADERS = {"content-type": "application/json", "content-encoding": "gzip"}


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
