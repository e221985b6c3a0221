"""GET /metrics: scraped in-process and parsed with prometheus_client's own parser, linted by
``promtool check metrics``, and scraped by a REAL Prometheus (Debian's ``prometheus`` package).

Without promtool/prometheus the tests that need them skip locally; with ``CI=true`` they fail.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fp8guard import wire
from fp8guard.service.domain import IngestResult
from fp8guard.service.queries.metrics import AlertCollector, RunCollector, install_metrics
from fp8guard.service.store.records import GAP_LOOKBACK_STEPS
from tests.helpers import app_in_thread, batch, post, register, tensor_defs

ROOT = Path(__file__).resolve().parents[2]

STATS = ("amax", "saturation", "underflows")


def tool(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    reason = f"{name} is not installed: apt-get install prometheus (it ships promtool too)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; in CI it must be present")
    pytest.skip(reason)


def make_client(url: str, **kw: Any) -> Any:
    from fastapi.testclient import TestClient

    from fp8guard.service import Settings, create_app

    app = create_app(Settings(database_url=url, auth="required"))
    from fp8guard.service.auth.tokens import issue_token
    from fp8guard.service.kinds import Role

    tokens = {role.value: issue_token(app.state.store, name=f"t-{role}", role=role)[0] for role in Role}
    if getattr(app.state, "metrics_registry", None) is None:  # create_app may install them itself
        install_metrics(app, app.state.store, **kw)
    return TestClient(app, headers={"authorization": f"Bearer {tokens['admin']}"})


@pytest.fixture
def mclient(migrated_url: str) -> Iterator[Any]:
    with make_client(migrated_url) as c:
        yield c


def scrape(client: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, keyed by (name, sorted labels)."""
    r = client.get("/metrics", follow_redirects=False)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def run_value(samples: dict[Any, float], name: str, run: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted({"run": run, **labels}.items()))))


def stat_block(steps: list[int], n: int, saturation_last: list[float], underflows_last: list[float]) -> np.ndarray:
    """(steps, stats, tensors): earlier steps saturate harder, so only the latest row may count."""
    vals = np.full((len(steps), len(STATS), n), 100.0, dtype="<f4")
    vals[:, 2, :] = 7.0
    vals[-1, 1, :] = saturation_last
    vals[-1, 2, :] = underflows_last
    return vals


def test_run_gauges(mclient: Any) -> None:
    register(mclient, "m1")
    values = stat_block([10, 11, 12], 6, [0.5, 2.0, math.nan, 20.0, 0.1, 1.0], [0, 0, 3, 0, math.nan, 1])
    r = post(mclient, batch("m1", [10, 11, 12], stats=STATS, values=values, losses=[3.0, 2.5, 2.25]))
    assert r.status_code == 200, r.text
    s = scrape(mclient)
    assert run_value(s, "fp8guard_run_last_step", "m1") == 12
    assert run_value(s, "fp8guard_run_last_loss", "m1") == 2.25
    assert run_value(s, "fp8guard_run_worst_saturation_ratio", "m1") == 20.0  # NaN skipped, step 12 only
    assert run_value(s, "fp8guard_run_tensors_saturating", "m1") == 2
    assert run_value(s, "fp8guard_run_tensors_underflowing", "m1") == 2
    assert run_value(s, "fp8guard_run_layers_bf16", "m1") == 0
    assert run_value(s, "fp8guard_run_findings_total", "m1") is not None
    assert run_value(s, "fp8guard_run_rollbacks_total", "m1") == 0
    assert run_value(s, "fp8guard_run_actions_total", "m1", kind="rollback") == 0
    assert s[("fp8guard_runs_active", ())] == 1
    assert s[("fp8guard_runs_truncated", ())] == 0


def test_a_run_reported_by_rank_1_only(mclient: Any) -> None:
    """``report_ranks=[1]`` (say the last pipeline stage, which holds the loss): the run's gauges,
    its summary and the run list read its lowest reporting rank, not an absent rank 0."""
    register(mclient, "r1", world_size=2)
    values = stat_block([10, 11], 6, [0.5, 3.0, 0.1, 0.1, 0.1, 0.1], [0, 2, 0, 0, 0, 0])
    r = post(mclient, batch("r1", [10, 11], rank=1, stats=STATS, values=values, losses=[3.0, 2.75]))
    assert r.status_code == 200, r.text
    s = scrape(mclient)
    assert run_value(s, "fp8guard_run_last_loss", "r1") == 2.75
    assert run_value(s, "fp8guard_run_worst_saturation_ratio", "r1") == 3.0
    assert run_value(s, "fp8guard_run_tensors_underflowing", "r1") == 1
    assert mclient.get("/v1/runs/r1").json()["last_loss"] == 2.75
    listed = {row["run_id"]: row for row in mclient.get("/v1/runs").json()}
    assert listed["r1"]["last_loss"] == 2.75
    # the series routes answer for the lead rank when none is asked; rank 0 has nothing
    assert mclient.get("/v1/runs/r1/scalars", params={"fields": "loss"}).json()["steps"] == [10, 11]
    assert mclient.get("/v1/runs/r1/tensors/1/series", params={"stat": "saturation"}).json()["max"] == [100.0, 3.0]
    assert mclient.get("/v1/runs/r1/matrix", params={"stat": "amax", "encoding": "json"}).json()["steps"] == [10, 11]
    assert mclient.get("/v1/runs/r1/scalars", params={"fields": "loss", "rank": 0}).json()["steps"] == []


def test_nan_loss_and_no_saturation_stat(mclient: Any) -> None:
    register(mclient, "nan")
    post(mclient, batch("nan", [1], stats=("amax",), losses=[math.nan]))
    s = scrape(mclient)
    assert math.isnan(run_value(s, "fp8guard_run_last_loss", "nan") or 0.0)
    assert run_value(s, "fp8guard_run_worst_saturation_ratio", "nan") is None  # never reported: no series
    assert run_value(s, "fp8guard_run_tensors_underflowing", "nan") is None


def test_latest_segment_wins(mclient: Any) -> None:
    """After a rollback the newest segment's latest row is read, even at a lower step."""
    register(mclient, "seg")
    post(mclient, batch("seg", [50], stats=STATS, values=stat_block([50], 6, [30.0] * 6, [0.0] * 6)))
    post(mclient, batch("seg", [40], segment=1, define_tensors=False, stats=STATS,
                        values=stat_block([40], 6, [0.25] * 6, [0.0] * 6)))
    s = scrape(mclient)
    assert run_value(s, "fp8guard_run_worst_saturation_ratio", "seg") == 0.25
    assert run_value(s, "fp8guard_run_tensors_saturating", "seg") == 0


def test_bf16_layers_from_fallback_event(mclient: Any) -> None:
    register(mclient, "fb")
    post(mclient, batch("fb", [1, 2], stats=STATS))
    ev = [{"kind": "fallback_applied", "step": 3, "data": {"modules": ["blocks.0.fc", "blocks.1.fc"]}}]
    r = post(mclient, batch("fb", [3], stats=STATS, define_tensors=False, events=ev))
    assert r.status_code == 200, r.text
    assert run_value(scrape(mclient), "fp8guard_run_layers_bf16", "fb") == 2


def probe_batch(run_id: str, steps: list[int], gaps: dict[int, float], *, segment: int = 0, rank: int = 0,
                define: bool = True) -> dict[str, Any]:
    """A batch whose steps in ``gaps`` carry the harm probe's scalars."""
    recs = []
    for s in steps:
        rec: dict[str, Any] = {"step": s, "time": 1.7e9 + s, "loss": 2.0, "grad_norm": 1.0}
        if s in gaps:
            rec.update(loss_bf16=2.0, loss_fp8=2.0 * (1 + gaps[s]), fp8_loss_gap=gaps[s])
        recs.append(rec)
    return wire.make_batch(run_id=run_id, rank=rank, segment=segment, tensors=tensor_defs(6) if define else (),
                           steps=recs)


def test_fp8_loss_gap(mclient: Any) -> None:
    """The harm probe's latest gap on rank 0, however many steps since; NaN when it was NaN; no
    series without a probe, or when its newest probe is older than the look-back."""
    for run in ("probed", "plain", "nan-gap", "old"):
        register(mclient, run)
    post(mclient, probe_batch("probed", list(range(0, 30)), {10: 0.01, 20: 0.03}))
    post(mclient, probe_batch("probed", [5], {5: 0.5}, rank=1))  # other ranks' probes are not read
    post(mclient, probe_batch("plain", list(range(0, 30)), {}))
    post(mclient, probe_batch("nan-gap", [1, 2, 3], {2: 0.02, 3: math.nan}))
    post(mclient, probe_batch("old", [1, GAP_LOOKBACK_STEPS + 2], {1: 0.04}))
    s = scrape(mclient)
    assert run_value(s, "fp8guard_run_fp8_loss_gap", "probed") == pytest.approx(0.03)
    assert run_value(s, "fp8guard_run_fp8_loss_gap", "plain") is None
    assert math.isnan(run_value(s, "fp8guard_run_fp8_loss_gap", "nan-gap") or 0.0)
    assert run_value(s, "fp8guard_run_fp8_loss_gap", "old") is None
    # a rollback: the newest segment's probes win, even at lower steps; none there yet -> none
    post(mclient, probe_batch("probed", [15, 16], {}, segment=1, define=False))
    assert run_value(scrape(mclient), "fp8guard_run_fp8_loss_gap", "probed") is None
    post(mclient, probe_batch("probed", [17], {17: 0.002}, segment=1, define=False))
    assert run_value(scrape(mclient), "fp8guard_run_fp8_loss_gap", "probed") == pytest.approx(0.002)


def test_fp8_loss_gap_read_is_bounded(mclient: Any) -> None:
    """The gap comes from the main per-run query (no query per run) and walks the steps key."""
    engine = mclient.app.state.store.engine
    for i in range(3):
        register(mclient, f"q{i}")
        post(mclient, probe_batch(f"q{i}", [1, 2], {2: 0.01}))
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        s = scrape(mclient)
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)
    assert all(run_value(s, "fp8guard_run_fp8_loss_gap", f"q{i}") == pytest.approx(0.01) for i in range(3))
    steps_reads = [q for q in statements if "FROM steps" in q]
    assert len(steps_reads) == 1, statements
    if engine.dialect.name == "sqlite":
        with engine.connect() as conn:
            plan = " ".join(str(r[-1]) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + steps_reads[0],
                                                                     (3,) * steps_reads[0].count("?")))
        assert "SCAN steps" not in plan, plan


def test_finished_runs_drop_out(mclient: Any) -> None:
    register(mclient, "done")
    register(mclient, "live")
    post(mclient, batch("done", [1], stats=STATS))
    post(mclient, batch("live", [5], stats=STATS))
    post(mclient, batch("done", [2], stats=STATS, define_tensors=False, events=[{"kind": "run_finished", "step": 2}]))
    s = scrape(mclient)
    assert run_value(s, "fp8guard_run_last_step", "done") is None
    assert not [k for k in s if dict(k[1]).get("run") == "done"]
    assert run_value(s, "fp8guard_run_last_step", "live") == 5
    assert s[("fp8guard_runs_active", ())] == 1


def test_max_runs_truncates(mclient: Any) -> None:
    for i in range(3):
        register(mclient, f"t{i}")
    registry = CollectorRegistry()
    registry.register(RunCollector(mclient.app.state.store, max_runs=2))
    s = {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
         for fam in text_string_to_metric_families(generate_latest(registry).decode()) for smp in fam.samples}
    assert s[("fp8guard_runs_active", ())] == 3
    assert s[("fp8guard_runs_truncated", ())] == 1
    assert len([k for k in s if k[0] == "fp8guard_run_layers_bf16"]) == 2
    with pytest.raises(ValueError):
        RunCollector(mclient.app.state.store, max_runs=0)


def test_install_twice_is_refused(mclient: Any) -> None:
    with pytest.raises(ValueError, match="already"):
        install_metrics(mclient.app, mclient.app.state.store)


def test_http_metrics_use_route_templates(mclient: Any) -> None:
    register(mclient, "secret-run-id")
    mclient.get("/v1/runs/secret-run-id")
    mclient.get("/no/such/path")
    r = mclient.post("/v1/ingest", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code >= 400
    s = scrape(mclient)
    assert s[("fp8guard_http_requests_total",
              (("code", "200"), ("method", "GET"), ("route", "/v1/runs/{run_id}")))] == 1
    assert s[("fp8guard_http_requests_total", (("code", "404"), ("method", "GET"), ("route", "unmatched")))] == 1
    assert s[("fp8guard_http_request_duration_seconds_count", (("route", "/v1/runs/{run_id}"),))] >= 1
    assert s[("fp8guard_ingest_batches_total", (("outcome", "rejected"),))] == 1
    http_labels = {v for k in s if k[0].startswith("fp8guard_http") for _, v in k[1]}
    assert "secret-run-id" not in " ".join(http_labels)


def test_ingest_observe(mclient: Any) -> None:
    metrics = mclient.app.state.metrics
    metrics.observe(IngestResult(batch_id="b" * 8, duplicate=False, steps=2, samples=12), 1000)
    metrics.observe(IngestResult(batch_id="b" * 8, duplicate=True, steps=2, samples=12), 1000)
    s = scrape(mclient)
    assert s[("fp8guard_ingest_batches_total", (("outcome", "stored"),))] == 1
    assert s[("fp8guard_ingest_batches_total", (("outcome", "duplicate"),))] == 1
    assert s[("fp8guard_ingest_samples_total", ())] == 12
    assert s[("fp8guard_ingest_bytes_total", ())] == 2000


def test_database_errors_counted(mclient: Any) -> None:
    engine = mclient.app.state.store.engine
    with pytest.raises(sa.exc.DBAPIError), engine.connect() as conn:
        conn.execute(sa.text("SELECT * FROM no_such_table"))
    s = scrape(mclient)
    assert sum(v for k, v in s.items() if k[0] == "fp8guard_database_errors_total") == 1


def test_driver_level_database_errors_counted_once(mclient: Any) -> None:
    """The store's driver-level statements raise the driver's own errors: translated, and counted
    once each, by kind."""
    from fp8guard.service.errors import ServiceError
    from fp8guard.service.store import sql

    store = mclient.app.state.store
    with pytest.raises(ServiceError):
        store.loop_pass(1, lambda txn: sql.run(txn.conn, "SELECT * FROM no_such_table"))
    with pytest.raises(ServiceError):  # a NOT NULL column left out
        store.loop_pass(1, lambda txn: sql.run(txn.conn, "INSERT INTO runs (run_id) VALUES ('x')"))
    s = scrape(mclient)
    counted = {dict(k[1])["kind"]: v for k, v in s.items() if k[0] == "fp8guard_database_errors_total"}
    assert sum(counted.values()) == 2
    assert counted.get("integrity") == 1


def test_alert_collector() -> None:
    class Fake:
        def stats(self) -> dict[str, dict[str, int]]:
            return {"slack": {"sent": 3, "failed": 1}}

        def backlog(self) -> dict[str, dict[str, int]]:
            return {"slack": {"pending": 2}}

    reg = CollectorRegistry()
    reg.register(AlertCollector(Fake()))
    text = generate_latest(reg).decode()
    assert 'fp8guard_alert_deliveries_total{outcome="failed",sink="slack"} 1.0' in text
    assert 'fp8guard_alert_outbox_rows{sink="slack",status="pending"} 2.0' in text


def test_metrics_exposition_passes_promtool(mclient: Any) -> None:
    promtool = tool("promtool")
    register(mclient, "lint")
    post(mclient, batch("lint", [1, 2], stats=STATS))
    text = mclient.get("/metrics").text
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- a real Prometheus scraping a real server -------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """The app with metrics and authentication under uvicorn in a thread, on SQLite; yields
    host:port and a token per role."""
    from fp8guard.service import Settings, create_app
    from fp8guard.service.auth.tokens import issue_token
    from fp8guard.service.kinds import Role
    from fp8guard.service.store import make_engine, upgrade

    url = f"sqlite:///{tmp_path / 'prom.db'}"
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    app = create_app(Settings(database_url=url, auth="required"))
    tokens = {role.value: issue_token(app.state.store, name=f"t-{role}", role=role)[0] for role in Role}
    with app_in_thread(app) as base:
        yield base.removeprefix("http://"), tokens


@pytest.mark.slow
def test_real_prometheus_scrapes_run_gauges(served: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    """Prometheus scrapes with a read token from a credentials file, as the provisioning example
    in dashboards/provisioning/prometheus.yml shows."""
    binary = tool("prometheus")
    address, tokens = served
    with httpx.Client(base_url=f"http://{address}") as anonymous:
        assert anonymous.get("/metrics").status_code == 401
    with httpx.Client(base_url=f"http://{address}", headers={"authorization": f"Bearer {tokens['ingest']}"}) as api:
        assert api.get("/metrics").status_code == 403
        register(api, "prom-run")
        assert post(api, batch("prom-run", [7, 8, 9], stats=STATS)).status_code == 200
    port = _free_port()
    secret = tmp_path / "fp8guard-read-token"
    secret.write_text(tokens["read"] + "\n")
    example = (ROOT / "dashboards" / "provisioning" / "prometheus-scrape.yaml").read_text()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        + example.replace("scrape_interval: 15s", "scrape_interval: 1s")
        .replace("/etc/prometheus/fp8guard-token", str(secret)).replace("fp8guard.internal:8000", address)
    )
    log = (tmp_path / "prometheus.log").open("w+")
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        value = None
        deadline = time.monotonic() + 60
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=2.0) as prom:
            while value is None:
                assert proc.poll() is None, "prometheus exited: " + (tmp_path / "prometheus.log").read_text()[-2000:]
                if time.monotonic() > deadline:
                    pytest.fail("prometheus never returned fp8guard_run_last_step: "
                                + (tmp_path / "prometheus.log").read_text()[-2000:])
                try:
                    body = prom.get("/api/v1/query", params={"query": "fp8guard_run_last_step"}).json()
                except (httpx.TransportError, ValueError):
                    body = {}
                result = body.get("data", {}).get("result", [])
                if result:
                    value = result[0]
                else:
                    time.sleep(0.25)
        assert value["metric"]["run"] == "prom-run"
        assert value["metric"]["job"] == "fp8guard"
        assert float(value["value"][1]) == 9
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
