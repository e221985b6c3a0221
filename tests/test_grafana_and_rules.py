"""The Grafana dashboard provisions as is, and the Prometheus rules load and pass their unit tests.

promtool comes with Debian's ``prometheus`` package; without it the promtool tests skip locally
and fail with ``CI=true``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "dashboards" / "grafana" / "fp8guard.json"
PROMETHEUS = ROOT / "dashboards" / "prometheus"
PROVISIONING = ROOT / "dashboards" / "provisioning"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def promtool() -> str:
    found = shutil.which("promtool")
    if found:
        return found
    reason = "promtool is not installed: apt-get install prometheus"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; in CI it must be present")
    pytest.skip(reason)


def load_dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="ascii"))
    return data


def all_panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for p in panels:
        out.append(p)
        out.extend(all_panels(p.get("panels", [])))
    return out


def test_dashboard_provisions_as_is() -> None:
    text = DASHBOARD.read_text(encoding="ascii")
    assert "${DS_" not in text and "__inputs" not in text  # UI-import placeholders break file provisioning
    dash = load_dashboard()
    assert dash["uid"] == "fp8guard-overview"
    assert dash["id"] is None
    assert isinstance(dash["schemaVersion"], int)


def test_dashboard_variables() -> None:
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    run = variables["run"]
    assert run["type"] == "query" and run["datasource"] == DATASOURCE
    query = run["query"]["query"] if isinstance(run["query"], dict) else run["query"]
    assert query == "label_values(fp8guard_run_last_step, run)"


def test_dashboard_panels() -> None:
    panels = all_panels(load_dashboard()["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        g = p["gridPos"]
        assert 1 <= g["w"] <= 24 and g["x"] + g["w"] <= 24 and g["h"] >= 1, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == DATASOURCE, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t.get("datasource", DATASOURCE) == DATASOURCE
            assert "fp8guard_" in t["expr"]
    titles = " ".join(p["title"].lower() for p in panels)
    for needed in ("last step", "loss", "loss gap", "saturation", "bf16", "rollbacks", "ingest", "latency", "alert"):
        assert needed in titles


def test_dashboard_loss_gap_panel() -> None:
    """The harm probe's gap is a fraction: drawn as a percentage, with the alert rule's threshold."""
    (panel,) = [p for p in all_panels(load_dashboard()["panels"]) if "fp8guard_run_fp8_loss_gap" in str(p.get("targets"))]
    defaults = panel["fieldConfig"]["defaults"]
    assert defaults["unit"] == "percentunit"
    assert [s["value"] for s in defaults["thresholds"]["steps"]] == [None, 0.02]
    assert "fp8guard_run_fp8_loss_gap > 0.02" in (PROMETHEUS / "rules.yml").read_text(encoding="ascii")


def test_dashboard_metrics_exist() -> None:
    """Every metric the dashboard queries is one the service exposes (names from docs/metrics.md)."""
    doc = (ROOT / "docs" / "metrics.md").read_text(encoding="ascii")
    exprs = " ".join(t["expr"] for p in all_panels(load_dashboard()["panels"]) for t in p.get("targets", []))
    for name in set(re.findall(r"fp8guard_[a-z0-9_]+", exprs)):
        base = re.sub(r"_(bucket|count|sum)$", "", name)
        assert base in doc, f"{name} is not documented in docs/metrics.md"


def test_provisioning_examples() -> None:
    dashboards = (PROVISIONING / "dashboards.yaml").read_text(encoding="ascii")
    datasources = (PROVISIONING / "datasources.yaml").read_text(encoding="ascii")
    assert "apiVersion: 1" in dashboards and "type: file" in dashboards
    assert "apiVersion: 1" in datasources and "type: prometheus" in datasources


def test_rules_check() -> None:
    proc = subprocess.run([promtool(), "check", "rules", str(PROMETHEUS / "rules.yml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "7 rules found" in proc.stdout


def test_rules_unit_tests() -> None:
    proc = subprocess.run([promtool(), "test", "rules", "rules_test.yml"], cwd=PROMETHEUS,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
