"""The peer's own virtualenv for ``bench/mlflow_peer.py``: ``bench/.peer-venv`` (git-ignored) with
MLflow (pinned, or the newest 3.x) and psycopg2, created or refreshed only when asked (``--setup``)
or when it is missing or incomplete; never a project dependency."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench._mlflow_log import log

BENCH_DIR = Path(__file__).resolve().parent
VENV_DIR = BENCH_DIR / ".peer-venv"
MLFLOW_PIN = "mlflow==3.17.2"
MLFLOW_FALLBACK = "mlflow>=3,<4"
PG_DRIVER = "psycopg2-binary"


def venv_python() -> Path:
    return VENV_DIR / "bin" / "python"


def venv_mlflow() -> Path:
    return VENV_DIR / "bin" / "mlflow"


def _venv_has(dist: str) -> str | None:
    """Version of ``dist`` installed in the peer venv, or None."""
    if not venv_python().exists():
        return None
    proc = subprocess.run(
        [str(venv_python()), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.stdout.strip() if proc.returncode == 0 else None


def venv_ready() -> bool:
    return venv_mlflow().exists() and _venv_has("mlflow") is not None and _venv_has(PG_DRIVER) is not None


def _pip(*args: str) -> int:
    cmd = [str(venv_python()), "-m", "pip", "--disable-pip-version-check", *args]
    log("$ " + " ".join(cmd))
    # stdout of pip goes to our stderr: stdout is reserved for the result line.
    return subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False).returncode


def setup_venv() -> str:
    """Create/refresh bench/.peer-venv with MLflow + psycopg2; return the MLflow version."""
    if not venv_python().exists():
        log(f"creating virtualenv {VENV_DIR}")
        subprocess.run(
            [sys.executable, "-m", "venv", str(VENV_DIR)], stdout=sys.stderr, stderr=sys.stderr, check=True
        )
    if _pip("install", MLFLOW_PIN, PG_DRIVER) != 0:
        log(f"{MLFLOW_PIN} not installable here; falling back to the newest {MLFLOW_FALLBACK!r}")
        if _pip("install", MLFLOW_FALLBACK, PG_DRIVER) != 0:
            raise SystemExit("mlflow_peer: could not install MLflow into the peer venv")
    version = _venv_has("mlflow")
    if version is None or not venv_mlflow().exists():
        raise SystemExit("mlflow_peer: MLflow install in the peer venv is incomplete")
    if version != MLFLOW_PIN.split("==")[1]:
        log(f"NOTE: using mlflow {version} instead of {MLFLOW_PIN}")
    log(f"peer venv ready: mlflow {version}")
    return version
