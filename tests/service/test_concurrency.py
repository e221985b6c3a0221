"""Concurrent ingest from several clients into real `fp8guard serve` processes over HTTP;
on PostgreSQL, two service processes share one database."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest

from bench._serve import serve
from fp8guard import wire
from tests.helpers import batch, stat_values


def _send_all(base: str, payloads: list[dict], errors: list[str]) -> None:
    with httpx.Client(base_url=base, timeout=60) as c:
        for p in payloads:
            for _ in range(2):  # every batch twice: a retry must be a no-op even when concurrent
                r = c.post("/v1/ingest", content=wire.dumps(p), headers={"content-type": "application/json"})
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.text[:200]}")


@pytest.mark.slow
def test_concurrent_clients_and_processes(migrated_url: str) -> None:
    n_clients, n_batches, n_tensors = 4, 6, 8
    urls_per_process = 2 if "postgresql" in migrated_url else 1
    with serve(migrated_url) as base1:
        bases = [base1]
        second = serve(migrated_url) if urls_per_process == 2 else None
        if second is not None:
            bases.append(second.__enter__())
        try:
            with httpx.Client(base_url=base1) as c:
                for k in range(n_clients):
                    assert c.put(f"/v1/runs/conc-{k % 2}", json={"world_size": 2}).status_code in (200, 201)
            expected: dict[tuple[int, int], np.ndarray] = {}
            work: list[list[dict]] = []
            for k in range(n_clients):
                run, rank = f"conc-{k % 2}", k // 2
                steps = list(range(n_batches * 20))
                vals = stat_values(steps, n_tensors, seed=k)
                expected[(k % 2, rank)] = vals
                work.append([batch(run, steps[i * 20:(i + 1) * 20], n_tensors=n_tensors, rank=rank,
                                   values=vals[i * 20:(i + 1) * 20], batch_id=f"c{k}-b{i}-xxxx")
                             for i in range(n_batches)])
            errors: list[str] = []
            threads = [threading.Thread(target=_send_all, args=(bases[k % len(bases)], work[k], errors))
                       for k in range(n_clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == []
            with httpx.Client(base_url=bases[-1]) as c:
                for (run, rank), vals in expected.items():
                    d = c.get(f"/v1/runs/conc-{run}").json()
                    assert {r["rank"]: r["batches"] for r in d["ranks"]} == {0: n_batches, 1: n_batches}
                    m = c.get(f"/v1/runs/conc-{run}/matrix",
                              params={"stat": "amax", "rank": rank, "encoding": "json"}).json()
                    np.testing.assert_array_equal(np.asarray(m["max"], dtype=np.float32), vals[:, 0, :].T)
                    lo = c.get(f"/v1/runs/conc-{run}/matrix",
                               params={"stat": "amax", "rank": rank, "width": 2, "encoding": "json"}).json()
                    assert max(lo["max"][0]) == vals[:, 0, 0].max()
        finally:
            if second is not None:
                second.__exit__(None, None, None)
