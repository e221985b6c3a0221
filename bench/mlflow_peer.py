"""Peer benchmark: MLflow tracking-server metric ingest rate, in fp8guard units.

What it measures
----------------
The sustained rate at which one self-hosted MLflow tracking server (``mlflow server``,
one worker, SQLite or PostgreSQL backend store) accepts metrics over its REST API from
a single loopback client that keeps one HTTP/1.1 connection open and calls
``POST /api/2.0/mlflow/runs/log-batch`` back to back. Each call carries MLflow's
per-call maximum of 1,000 metrics (``MAX_METRICS_PER_BATCH`` in
``mlflow/utils/validation.py``): 250 tensors x 4 stats (``layers.{i}.amax``,
``layers.{i}.scale``, ``layers.{i}.underflow_frac``, ``layers.{i}.overflow_frac``), all at
one step, the step number incrementing with each call. That is exactly what a
training loop mirroring fp8guard's per-tensor stats into MLflow would send.

One fp8guard "sample" is one tensor's 4 stats at one step, so
``samples_per_s = metrics_per_s / 4`` is directly comparable with our own ingest
benchmark's samples/s.

Why MLflow is the peer
----------------------
MLflow's tracking server is the self-hosted experiment tracker teams already run
today next to their training jobs (W&B and friends are SaaS-first); "just log the FP8
amax/scale stats to MLflow" is the status quo fp8guard has to beat on ingest cost.

How it stays out of the project's dependencies
----------------------------------------------
MLflow lives in its own virtualenv at ``bench/.peer-venv`` (git-ignored), created with
``python -m venv`` and filled with ``mlflow==3.17.2`` (newest 3.x if that pin is not on
the index) and ``psycopg2-binary``, the PostgreSQL driver MLflow documents; the
backend-store URL names it (``postgresql+psycopg2://``) because SQLAlchemy 2.1 maps a
bare ``postgresql://`` to psycopg 3. The install runs only with ``--setup`` or when
the venv is missing or incomplete. The client here uses only the standard library
(``http.client``), so this script runs from any Python 3.11 interpreter.

Server setup: ``mlflow server --host 127.0.0.1 --port <free> --workers 1`` (uvicorn,
MLflow 3.x's default; its default would be 4 workers), backend store a temp SQLite
file or a dedicated PostgreSQL database ``fp8guard_mlflow_bench`` created and dropped
around the run (``--backend postgres``, admin URL ``--pg-url``), artifacts in a temp
dir. MLflow 3.x also starts a background job runner by default (8 huey consumer
processes for its GenAI jobs). It plays no part in metric ingest and is idle in steady
state, but those processes boot for several seconds after ``/health`` answers and would
take the 2-core CPU away from the measurement, so it is disabled
(``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``) unless ``--with-job-runner`` is given.
The server is always stopped (SIGTERM to its process group, then SIGKILL), the temp dir
removed and the database dropped.

Where the parts live: the peer venv bench/_mlflow_venv.py, the backend store
bench/_mlflow_store.py, the server bench/_mlflow_server.py, the client and its measured
``log-batch`` loop bench/_mlflow_load.py, the stderr log bench/_mlflow_log.py.

Usage::

    python bench/mlflow_peer.py --setup          # (re)create bench/.peer-venv only
    python bench/mlflow_peer.py --json --backend sqlite
    python bench/mlflow_peer.py --json --backend postgres --seconds 10

With ``--json`` exactly one JSON line goes to stdout; all logs, install progress and
server output (on failure) go to stderr.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._mlflow_load import METRICS_PER_SAMPLE, MIN_WARMUP_CALLS, MLFLOW_MAX_METRICS_PER_BATCH, run_load
from bench._mlflow_log import log
from bench._mlflow_server import mlflow_server
from bench._mlflow_store import backend_store
from bench._mlflow_venv import _venv_has, setup_venv, venv_ready

PG_DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"


def _sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # run the finally blocks (server stop, DB drop)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--backend", choices=("sqlite", "postgres"), default=None, help="backend store (default sqlite)"
    )
    p.add_argument("--pg-url", default=PG_DEFAULT_URL, help=f"admin URL (default {PG_DEFAULT_URL})")
    p.add_argument("--seconds", type=float, default=10.0, help="measured duration (default 10)")
    p.add_argument(
        "--warmup",
        type=float,
        default=3.0,
        help=f"warm-up duration, at least {MIN_WARMUP_CALLS} calls (default 3)",
    )
    p.add_argument(
        "--with-job-runner",
        action="store_true",
        help="keep MLflow's background job runner (huey consumers) enabled, as by default",
    )
    p.add_argument(
        "--metrics-per-call",
        type=int,
        default=MLFLOW_MAX_METRICS_PER_BATCH,
        help=f"metrics per log-batch call, multiple of 4, max {MLFLOW_MAX_METRICS_PER_BATCH}",
    )
    p.add_argument("--json", action="store_true", help="print one JSON line to stdout")
    p.add_argument(
        "--setup",
        action="store_true",
        help="(re)install the peer venv, then exit unless --backend is given too",
    )
    p.add_argument("--verbose", action="store_true", help="show the server log tail on stderr")
    args = p.parse_args(argv)
    if not (0 < args.metrics_per_call <= MLFLOW_MAX_METRICS_PER_BATCH) or args.metrics_per_call % 4:
        p.error(f"--metrics-per-call must be a positive multiple of 4, <= {MLFLOW_MAX_METRICS_PER_BATCH}")
    if args.seconds <= 0 or args.warmup < 0:
        p.error("--seconds must be > 0 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm)
    backend: str = args.backend or "sqlite"

    if args.setup or not venv_ready():
        version = setup_venv()
        if args.setup and args.backend is None:
            return 0
    else:
        version = _venv_has("mlflow") or "unknown"

    tmp = Path(tempfile.mkdtemp(prefix="fp8guard-mlflow-peer-"))
    try:
        with (
            backend_store(backend, tmp, args.pg_url) as store_uri,
            mlflow_server(store_uri, tmp, args.verbose, args.with_job_runner) as (host, port),
        ):
            res = run_load(host, port, args.seconds, args.warmup, args.metrics_per_call)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        log(f"FAILED: {exc}")
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    metrics_per_s = res.metrics / res.seconds
    out = {
        "peer": "mlflow",
        "mlflow_version": version,
        "backend": backend,
        "metrics_per_s": round(metrics_per_s, 1),
        "samples_per_s": round(metrics_per_s / METRICS_PER_SAMPLE, 1),
        "calls": res.calls,
        "seconds": round(res.seconds, 3),
    }
    if args.json:
        print(json.dumps(out), flush=True)
    else:
        print(
            f"mlflow {version} ({backend}, 1 worker): {out['metrics_per_s']:,.0f} metrics/s = "
            f"{out['samples_per_s']:,.0f} samples/s ({res.calls} log-batch calls x "
            f"{args.metrics_per_call} metrics in {res.seconds:.2f}s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
