"""The MLflow tracking server of ``bench/mlflow_peer.py``: ``mlflow server`` from the peer venv on a
free loopback port, one worker, the job runner off unless asked for, up once ``/health`` answers;
always stopped (SIGTERM to its process group, then SIGKILL), its log tail shown on failure."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from bench._mlflow_log import log
from bench._mlflow_venv import venv_mlflow

READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0


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
