"""Installs per host: a training host gets torch + httpx and nothing of the service; a service
host gets the service and never torch. Resolved by pip itself (``--dry-run --report``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICE_ONLY = {"fastapi", "sqlalchemy", "alembic", "psycopg", "uvicorn", "plotly", "prometheus-client", "pybase64"}
AGENT_ONLY = {"torch", "triton"}


def _resolve(extra: str, tmp_path: Path) -> set[str]:
    report = tmp_path / f"{extra}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
         f"{ROOT}[{extra}]"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {item["metadata"]["name"].lower().replace("_", "-") for item in json.loads(report.read_text())["install"]}


@pytest.mark.slow
def test_agent_install_has_nothing_of_the_service(tmp_path: Path) -> None:
    names = _resolve("agent", tmp_path)
    assert {"torch", "httpx", "fp8guard"} <= names
    assert not names & SERVICE_ONLY, names & SERVICE_ONLY


@pytest.mark.slow
def test_service_install_has_no_torch(tmp_path: Path) -> None:
    names = _resolve("service", tmp_path)
    assert {"fastapi", "sqlalchemy", "psycopg", "fp8guard"} <= names
    assert not names & AGENT_ONLY, names & AGENT_ONLY
    assert not any(n.startswith("nvidia-") for n in names)


@pytest.mark.slow
def test_the_wheel_carries_the_page_templates(tmp_path: Path) -> None:
    """Built as a user's pip builds it: the pages' Jinja2 templates (the base layout included)
    are package data, so an installed service renders its pages."""
    import zipfile

    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                           "--wheel-dir", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("fp8guard-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (ROOT / "dashboards" / "web" / "templates").glob("*.html"))
    assert "base.html" in sources and len(sources) >= 6
    assert {f"fp8guard/dashboards/web/templates/{n}" for n in sources} <= names
    assert "fp8guard/service/web/templates.py" in names
    # every agent subpackage is listed in pyproject's packages (the kernels' too)
    assert {"fp8guard/agent/kernels/__init__.py", "fp8guard/agent/kernels/tripwire_check.py"} <= names
