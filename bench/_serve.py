"""Start a real ``fp8guard serve`` process for benchmarks and stop it afterwards."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx

__all__ = ["free_port", "serve"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve(database_url: str, *, timeout: float = 60.0, auth: bool = False) -> Iterator[str]:
    """``fp8guard serve`` on 127.0.0.1 (no tokens there unless ``auth``: FP8GUARD_AUTH=required)."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FP8GUARD_AUTH": "required" if auth else "off"}
    log = tempfile.TemporaryFile()  # noqa: SIM115 - a file, not a pipe: a full pipe would block the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "fp8guard", "serve", "--database-url", database_url, "--port", str(port),
         "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=log,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"fp8guard serve exited: {log.read().decode(errors='replace')[-2000:]}")
            try:
                if httpx.get(f"{base}/healthz", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("fp8guard serve did not become healthy in time")
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
