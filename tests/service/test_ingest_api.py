"""Ingest and query through the HTTP API, on SQLite and PostgreSQL."""

from __future__ import annotations

import base64
import gzip
import math

import numpy as np
import pytest

from fp8guard import wire
from tests.helpers import STATS, batch, post, register, stat_values


def _matrix(client, run_id: str, stat: str, **params) -> tuple[dict, np.ndarray, np.ndarray]:
    r = client.get(f"/v1/runs/{run_id}/matrix", params={"stat": stat, **params})
    assert r.status_code == 200, r.text
    body = r.json()
    shape = (len(body["tensors"]), len(body["steps"]))
    lo = np.frombuffer(base64.b64decode(body["min"]), dtype="<f4").reshape(shape)
    hi = np.frombuffer(base64.b64decode(body["max"]), dtype="<f4").reshape(shape)
    return body, lo, hi


def test_register_is_idempotent_and_resumes(client) -> None:
    r1 = client.put("/v1/runs/gpt-1", json={"model": "gpt", "world_size": 2, "recipe": {"kind": "delayed"}})
    assert r1.status_code == 201
    r2 = client.put("/v1/runs/gpt-1", json={"model": "gpt", "world_size": 4})
    assert r2.status_code == 200
    detail = client.get("/v1/runs/gpt-1").json()
    assert detail["world_size"] == 4 and detail["recipe"] == {"kind": "delayed"}
    assert [r["run_id"] for r in client.get("/v1/runs").json()] == ["gpt-1"]


def test_ingest_then_query_back_exactly(client) -> None:
    register(client, "r1")
    steps = list(range(0, 40))
    vals = stat_values(steps, 6)
    r = post(client, batch("r1", steps, values=vals))
    assert r.status_code == 200, r.text
    body = r.json()
    assert {k: body[k] for k in ("duplicate", "steps", "samples")} == {"duplicate": False, "steps": 40, "samples": 240}

    body, lo, hi = _matrix(client, "r1", "saturation", width=1000)
    assert body["bucket"] == 1 and body["steps"] == steps
    np.testing.assert_array_equal(lo, vals[:, 2, :].T)
    np.testing.assert_array_equal(hi, vals[:, 2, :].T)

    series = client.get("/v1/runs/r1/tensors/4/series", params={"stat": "amax", "width": 1000}).json()
    assert series["steps"] == steps
    assert series["min"] == [float(v) for v in vals[:, 0, 4]]
    assert series["tensor"]["name"] == "blocks.1.fc:fwd_weight"

    scalars = client.get("/v1/runs/r1/scalars", params={"fields": "loss,tokens"}).json()
    assert scalars["steps"] == steps
    assert scalars["min"]["loss"] == pytest.approx([3.0 - s * 1e-3 for s in steps])
    assert scalars["max"]["tokens"] == [4096 * (s + 1) for s in steps]

    detail = client.get("/v1/runs/r1").json()
    assert detail["last_step"] == 39 and detail["num_tensors"] == 6 and detail["stats"] == sorted(STATS)
    assert detail["samples"] == 240
    assert len(client.get("/v1/runs/r1/tensors").json()) == 6


def test_nan_and_inf_round_trip(client) -> None:
    register(client, "nan-run")
    steps = [0, 1, 2, 3]
    vals = stat_values(steps, 3)
    vals[1, 0, 0] = np.nan
    vals[2, 0, 1] = np.inf
    vals[3, 0, 2] = -np.inf
    payload = batch("nan-run", steps, n_tensors=3, values=vals, losses=[1.0, math.nan, math.inf, -math.inf])
    payload["steps"][0]["grad_norm"] = "NaN"
    assert post(client, payload).status_code == 200

    s = client.get("/v1/runs/nan-run/scalars", params={"fields": ["loss", "grad_norm"]}).json()
    assert s["min"]["loss"] == [1.0, "NaN", "Infinity", "-Infinity"]
    assert s["max"]["grad_norm"] == ["NaN", 1.0, 1.0, 1.0]
    _, lo, hi = _matrix(client, "nan-run", "amax")
    assert math.isnan(lo[0, 1]) and math.isnan(hi[0, 1])
    assert hi[1, 2] == np.inf and lo[2, 3] == -np.inf
    js = client.get("/v1/runs/nan-run/matrix", params={"stat": "amax", "encoding": "json"}).json()
    assert js["min"][0][1] == "NaN" and js["max"][1][2] == "Infinity" and js["min"][2][3] == "-Infinity"
    t = client.get("/v1/runs/nan-run/tensors/0/series", params={"stat": "amax"}).json()
    assert t["min"][1] == "NaN"
    # NaN survives roll-ups too: zoomed out to one column, tensor 0 reports NaN.
    _, lo1, _ = _matrix(client, "nan-run", "amax", width=1, start=0, end=5000)
    assert math.isnan(lo1[0, 0]) and lo1[1, 0] == pytest.approx(vals[:, 0, 1].min())
    assert client.get("/v1/runs/nan-run").json()["last_loss"] == "-Infinity"


def test_retried_batch_is_stored_once(client) -> None:
    register(client, "retry")
    payload = batch("retry", list(range(10)), batch_id="batch-0001")
    first = post(client, payload).json()
    again = post(client, payload).json()
    assert first["duplicate"] is False and again["duplicate"] is True and again["samples"] == 0
    detail = client.get("/v1/runs/retry").json()
    assert detail["samples"] == 60 and detail["ranks"][0]["batches"] == 1


def test_gzip_body(client) -> None:
    register(client, "gz")
    body = gzip.compress(wire.dumps(batch("gz", [0, 1, 2])))
    r = client.post("/v1/ingest", content=body, headers={"content-encoding": "gzip", "content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["samples"] == 18


def test_batches_accumulate_and_rollups_merge(client) -> None:
    register(client, "acc")
    all_steps = list(range(0, 600))
    vals = stat_values(all_steps, 6)
    for lo in range(0, 600, 70):  # batch edges do not align with roll-up blocks
        chunk = all_steps[lo:lo + 70]
        assert post(client, batch("acc", chunk, values=vals[lo:lo + 70], define_tensors=lo == 0)).status_code == 200
    body, mn, mx = _matrix(client, "acc", "amax", width=3)
    assert body["level"] > 1 and body["bucket"] % body["level"] == 0
    cols = np.asarray(body["steps"])
    for c, first in enumerate(cols):
        sel = (np.asarray(all_steps) >= first) & (np.asarray(all_steps) < first + body["bucket"])
        np.testing.assert_array_equal(mn[:, c], vals[sel, 0, :].min(axis=0))
        np.testing.assert_array_equal(mx[:, c], vals[sel, 0, :].max(axis=0))


def test_tensors_added_later_show_no_data_before(client) -> None:
    register(client, "grow")
    assert post(client, batch("grow", [0, 1], n_tensors=3)).status_code == 200
    assert post(client, batch("grow", [2, 3], n_tensors=5)).status_code == 200
    js = client.get("/v1/runs/grow/matrix", params={"stat": "amax", "encoding": "json"}).json()
    assert js["min"][4][:2] == [None, None] and js["min"][4][2] is not None
    _, lo, hi = _matrix(client, "grow", "amax", width=1, end=4095)
    assert lo[4, 0] <= hi[4, 0]  # merged across both batches


def test_segments_show_effective_timeline(client) -> None:
    register(client, "rb")
    post(client, batch("rb", list(range(0, 20)), losses=[1.0] * 20))
    # rollback to step 10: segment 1 re-runs steps 10.. with different losses
    post(client, batch("rb", list(range(10, 30)), segment=1, define_tensors=False, losses=[2.0] * 20))
    s = client.get("/v1/runs/rb/scalars", params={"fields": "loss"}).json()
    assert s["steps"] == list(range(30))
    assert s["min"]["loss"] == [1.0] * 10 + [2.0] * 20
    old = client.get("/v1/runs/rb/scalars", params={"fields": "loss", "segment": 0}).json()
    assert old["steps"] == list(range(20)) and old["min"]["loss"] == [1.0] * 20
    assert client.get("/v1/runs/rb").json()["ranks"][0]["last_segment"] == 1


def test_events_and_status(client) -> None:
    register(client, "ev")
    post(client, batch("ev", [0, 1], events=[{"kind": "run_started", "step": 0},
                                             {"kind": "checkpoint_saved", "step": 1, "data": {"path": "/ck/1"}}]))
    post(client, wire.make_batch(run_id="ev", events=[{"kind": "run_finished", "step": 1}]))
    ev = client.get("/v1/runs/ev/events").json()
    assert [e["kind"] for e in ev] == ["run_started", "checkpoint_saved", "run_finished"]
    assert ev[1]["data"] == {"path": "/ck/1"}
    assert [e["kind"] for e in client.get("/v1/runs/ev/events", params={"kind": "checkpoint_saved"}).json()] == [
        "checkpoint_saved"]
    assert client.get("/v1/runs/ev").json()["status"] == "finished"
    assert client.get("/v1/runs", params={"status": "running"}).json() == []


def test_ranks_are_separate(client) -> None:
    register(client, "mr", world_size=2)
    v0, v1 = stat_values([0, 1], 6, seed=0), stat_values([0, 1], 6, seed=1)
    post(client, batch("mr", [0, 1], values=v0, rank=0))
    post(client, batch("mr", [0, 1], values=v1, rank=1))
    _, lo1, _ = _matrix(client, "mr", "amax", rank=1)
    np.testing.assert_array_equal(lo1, v1[:, 0, :].T)
    assert [r["rank"] for r in client.get("/v1/runs/mr").json()["ranks"]] == [0, 1]


def test_healthz(client) -> None:
    r = client.get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok"
