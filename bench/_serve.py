"""Start a real ``fp8guard serve`` process for benchmarks and tests, and stop it afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import IO

import httpx

__all__ = ["Served", "free_port", "serve", "serve_process"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Served:
    """A running ``fp8guard serve``: its URL, its process (tests stop and resume it) and its log."""

    base: str
    proc: subprocess.Popen[bytes]
    _log: IO[bytes]

    def log_text(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")


@contextlib.contextmanager
def serve_process(database_url: str, *, timeout: float = 60.0, auth: bool = False,
                  env: Mapping[str, str] | None = None) -> Iterator[Served]:
    """``fp8guard serve`` on 127.0.0.1 (no tokens there unless ``auth``: FP8GUARD_AUTH=required),
    healthy before it is yielded; ``env`` adds FP8GUARD_* settings."""
    port = free_port()
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "FP8GUARD_AUTH": "required" if auth else "off", **(env or {})}
    log = tempfile.TemporaryFile()  # noqa: SIM115 - a file, not a pipe: a full pipe would block the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "fp8guard", "serve", "--database-url", database_url, "--port", str(port),
         "--log-level", "warning"],
        env=full_env, stdout=subprocess.DEVNULL, stderr=log,
    )
    served = Served(base=f"http://127.0.0.1:{port}", proc=proc, _log=log)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"fp8guard serve exited: {served.log_text()[-2000:]}")
            try:
                if httpx.get(f"{served.base}/healthz", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("fp8guard serve did not become healthy in time")
            time.sleep(0.1)
        yield served
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)  # a test may have stopped it
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def serve(database_url: str, *, timeout: float = 60.0, auth: bool = False) -> Iterator[str]:
    """``serve_process``, yielding only its base URL."""
    with serve_process(database_url, timeout=timeout, auth=auth) as served:
        yield served.base
