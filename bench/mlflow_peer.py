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

Usage::

    python bench/mlflow_peer.py --setup          # (re)create bench/.peer-venv only
    python bench/mlflow_peer.py --json --backend sqlite
    python bench/mlflow_peer.py --json --backend postgres --seconds 10

With ``--json`` exactly one JSON line goes to stdout; all logs, install progress and
server output (on failure) go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

BENCH_DIR = Path(__file__).resolve().parent
VENV_DIR = BENCH_DIR / ".peer-venv"
MLFLOW_PIN = "mlflow==3.17.2"
MLFLOW_FALLBACK = "mlflow>=3,<4"
PG_DRIVER = "psycopg2-binary"
PG_DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
PG_BENCH_DB = "fp8guard_mlflow_bench"

# MLflow's per-call cap for log-batch (mlflow/utils/validation.py: MAX_METRICS_PER_BATCH).
MLFLOW_MAX_METRICS_PER_BATCH = 1000
STATS = ("amax", "scale", "underflow_frac", "overflow_frac")
METRICS_PER_SAMPLE = len(STATS)
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
MIN_WARMUP_CALLS = 3

LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"


def log(msg: str) -> None:
    print(f"[mlflow_peer] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- venv


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


# --------------------------------------------------------------------------- backend store


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


# --------------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group (uvicorn forks workers), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log(f"server did not exit after {sig.name}")
    # Leftover workers in the group (e.g. the CLI parent exited or died first).
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no server log)"


@contextlib.contextmanager
def mlflow_server(store_uri: str, tmp: Path, verbose: bool, job_runner: bool) -> Iterator[tuple[str, int]]:
    port = free_port()
    artifacts = tmp / "artifacts"
    artifacts.mkdir()
    server_log = tmp / "server.log"
    cmd = [
        str(venv_mlflow()),
        "server",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--workers", "1",
        "--backend-store-uri", store_uri,
        "--artifacts-destination", str(artifacts),
    ]  # fmt: skip
    env = dict(os.environ)
    env.update(
        MLFLOW_DISABLE_TELEMETRY="true",
        DO_NOT_TRACK="true",
        PYTHONUNBUFFERED="1",
        MLFLOW_SERVER_ENABLE_JOB_EXECUTION="true" if job_runner else "false",
    )
    env.pop("MLFLOW_TRACKING_URI", None)
    log("$ " + " ".join(cmd))
    with server_log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=tmp,  # any stray ./mlruns or ./mlartifacts lands in tmp
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {proc.returncode} during start-up")
            if time.monotonic() - t0 > READY_TIMEOUT_S:
                raise RuntimeError(f"mlflow server not ready after {READY_TIMEOUT_S:.0f}s")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                ok = conn.getresponse().status == 200
                conn.close()
                if ok:
                    break
            except OSError:
                pass
            time.sleep(0.25)
        log(f"mlflow server ready on 127.0.0.1:{port} after {time.monotonic() - t0:.1f}s")
        yield "127.0.0.1", port
    except BaseException:
        verbose = True  # show the server's side of any failure
        raise
    finally:
        _stop(proc)
        if verbose:
            log("server log tail:\n" + _tail(server_log))
        log("mlflow server stopped")


# --------------------------------------------------------------------------- client


class Client:
    """Minimal keep-alive JSON client for MLflow's REST API (stdlib only)."""

    def __init__(self, host: str, port: int) -> None:
        self.conn = http.client.HTTPConnection(host, port, timeout=60)
        self.headers = {"Content-Type": "application/json"}

    def post(self, path: str, body: bytes) -> dict[str, Any]:
        self.conn.request("POST", path, body=body, headers=self.headers)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"POST {path} -> {resp.status}: {data[:500]!r}")
        return json.loads(data) if data else {}

    def get(self, path: str) -> dict[str, Any]:
        self.conn.request("GET", path)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"GET {path} -> {resp.status}: {data[:500]!r}")
        return json.loads(data) if data else {}

    def close(self) -> None:
        self.conn.close()


def batch_body(run_id: str, keys: list[str], step: int) -> bytes:
    ts = int(time.time() * 1000)
    metrics = [
        {"key": k, "value": 1.0 + ((step * 31 + i) % 997) / 1000.0, "timestamp": ts, "step": step}
        for i, k in enumerate(keys)
    ]
    return json.dumps({"run_id": run_id, "metrics": metrics}).encode()


@dataclass
class Result:
    calls: int
    metrics: int
    seconds: float


def run_load(host: str, port: int, seconds: float, warmup: float, per_call: int) -> Result:
    client = Client(host, port)
    try:
        exp = client.post(
            "/api/2.0/mlflow/experiments/create",
            json.dumps({"name": f"fp8guard-peer-bench-{os.getpid()}-{time.time_ns()}"}).encode(),
        )
        run = client.post(
            "/api/2.0/mlflow/runs/create",
            json.dumps(
                {"experiment_id": exp["experiment_id"], "start_time": int(time.time() * 1000)}
            ).encode(),
        )
        run_id: str = run["run"]["info"]["run_id"]
        tensors = per_call // METRICS_PER_SAMPLE
        keys = [f"layers.{i}.{s}" for i in range(tensors) for s in STATS]

        step = 0
        t_end = time.perf_counter() + warmup
        while step < MIN_WARMUP_CALLS or time.perf_counter() < t_end:
            client.post(LOG_BATCH, batch_body(run_id, keys, step))
            step += 1
        log(f"warm-up: {step} calls; load avg {os.getloadavg()[0]:.2f}; measuring for {seconds:.1f}s")

        calls = 0
        t0 = time.perf_counter()
        deadline = t0 + seconds
        t1 = t0
        latencies: list[float] = []
        while t1 < deadline:
            # Body is built inside the timed loop, as a real logger would have to.
            client.post(LOG_BATCH, batch_body(run_id, keys, step))
            step += 1
            calls += 1
            t_prev, t1 = t1, time.perf_counter()
            latencies.append(t1 - t_prev)
        elapsed = t1 - t0
        latencies.sort()
        log(
            f"measured: {calls} calls in {elapsed:.2f}s; per call p50 {latencies[len(latencies) // 2]:.3f}s"
            f" max {latencies[-1]:.3f}s; load avg {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
        )

        # Sanity check: the server really stored one point per step for a key.
        hist = client.get(f"/api/2.0/mlflow/metrics/get-history?run_id={run_id}&metric_key={keys[0]}")
        stored = len(hist.get("metrics", []))
        if stored != step:
            log(f"WARNING: {keys[0]} has {stored} stored points, expected {step}")
        else:
            log(f"verified: {keys[0]} has {stored} points (warm-up + measured steps)")
        return Result(calls=calls, metrics=calls * len(keys), seconds=elapsed)
    finally:
        client.close()


# --------------------------------------------------------------------------- main


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
