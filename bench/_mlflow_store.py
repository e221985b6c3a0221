"""The MLflow server's backend store for ``bench/mlflow_peer.py``: a temp SQLite file, or a dedicated
PostgreSQL database created before the run and dropped after it (``--backend postgres``), its
admin steps run with the peer venv's psycopg2."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from bench._mlflow_log import log
from bench._mlflow_venv import venv_python

PG_BENCH_DB = "fp8guard_mlflow_bench"


def _mlflow_store_url(admin_url: str, dbname: str) -> str:
    """Admin URL -> backend-store URL for ``dbname``, pinned to the psycopg2 driver.

    SQLAlchemy 2.1 (what MLflow 3.17 pulls in) maps a bare ``postgresql://`` to psycopg 3,
    not psycopg2, so the driver is named explicitly (``postgresql+psycopg2://``, a form
    MLflow's SQLAlchemy store accepts).
    """
    parts = urlsplit(admin_url)
    scheme = parts.scheme
    if scheme in ("postgresql", "postgres"):
        scheme = "postgresql+psycopg2"
    return urlunsplit((scheme, parts.netloc, "/" + dbname, parts.query, parts.fragment))


def _pg_admin(admin_url: str, *statements: str) -> None:
    """Run autocommit statements against the admin DB with the venv's psycopg2."""
    code = (
        "import sys, psycopg2\n"
        "conn = psycopg2.connect(sys.argv[1])\n"
        "conn.autocommit = True\n"
        "with conn.cursor() as cur:\n"
        "    for stmt in sys.argv[2:]:\n"
        "        cur.execute(stmt)\n"
        "conn.close()\n"
    )
    proc = subprocess.run(
        [str(venv_python()), "-c", code, admin_url, *statements],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    if proc.returncode != 0:
        err = proc.stderr.strip().splitlines()
        raise RuntimeError(f"PostgreSQL admin step failed on {admin_url}: {' / '.join(err[-2:])}")


@contextlib.contextmanager
def backend_store(backend: str, tmp: Path, pg_url: str) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{tmp / 'mlflow.db'}"  # removed with tmp
        return
    drop = f'DROP DATABASE IF EXISTS "{PG_BENCH_DB}" WITH (FORCE)'
    _pg_admin(pg_url, drop, f'CREATE DATABASE "{PG_BENCH_DB}"')
    log(f"created PostgreSQL database {PG_BENCH_DB}")
    try:
        yield _mlflow_store_url(pg_url, PG_BENCH_DB)
    finally:
        try:
            _pg_admin(pg_url, drop)
            log(f"dropped PostgreSQL database {PG_BENCH_DB}")
        except Exception as exc:  # keep the original error, if any
            log(f"WARNING: could not drop database {PG_BENCH_DB}: {exc}")
