"""The decision-latency probes of ``bench/load.py`` (``--decisions``).

``--decisions K`` probes, spread over the load, each register a run, send a healthy batch,
long-poll ``/v1/runs/{id}/commands?wait=10`` (or poll it every 5 ms where ``wait`` is ignored)
and send a batch whose last loss is NaN and one of whose amaxes is infinite: the decision latency
is from that batch's answer to the first non-empty command list (0 and counted ``in_answer`` when
the answer itself carried it).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from bench._load_agents import Tally, _send
from bench._load_bodies import Batches

WAIT_S = 10.0  # long-poll wait, and the give-up time of a decision probe
POLL_S = 0.005  # polling period where the commands endpoint ignores wait


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
