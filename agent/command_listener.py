"""``CommandListener``: long-polls ``GET /v1/runs/{run_id}/commands?wait=S&after=ID`` on a thread
of its own, so a decision reaches the training loop as soon as the service takes it (used after
the tripwire fires; the ingest answers still carry every pending command as well)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from fp8guard.agent.transport.delivery import AUTH_STATUSES, auth_headers

__all__ = ["CommandListener"]

log = logging.getLogger(__name__)


class CommandListener:
    def __init__(self, url: str, run_id: str, on_commands: Callable[[list[dict[str, Any]]], None], *,
                 timeout_s: float = 10.0, client: httpx.Client | None = None, token: str | None = None) -> None:
        self._path = f"/v1/runs/{run_id}/commands"
        self._on_commands = on_commands
        self._owns_client = client is None
        self._client = client or httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s)
        self._headers = auth_headers(token)  # never logged
        self._auth_refused = False
        self._lock = threading.Lock()
        self._until = 0.0
        self._after = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    def listen(self, seconds: float, *, after: int) -> None:
        """Long-poll for up to ``seconds`` from now for commands with an id above ``after``."""
        with self._lock:
            if self._closed:
                return
            self._until = max(self._until, time.monotonic() + seconds)
            self._after = max(self._after, after)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fp8guard-commands", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                left, after = self._until - time.monotonic(), self._after
                if left <= 0 or self._closed:
                    self._thread = None
                    return
            try:
                r = self._client.get(self._path, params={"wait": f"{min(left, 30.0):.3f}", "after": after},
                                     headers=self._headers, timeout=min(left, 30.0) + 10.0)
                if r.status_code in AUTH_STATUSES:
                    # Not transient: say so once and stop this listening window (no hot loop); the
                    # ingest answers still carry commands if the token gains the role later.
                    if not self._auth_refused:
                        self._auth_refused = True
                        log.error("fp8guard: the service refused the command long-poll with HTTP %d (token "
                                  "missing, invalid or without access to this run); commands arrive with the "
                                  "ingest answers only", r.status_code)
                    with self._lock:
                        self._thread = None
                        self._until = 0.0
                    return
                got = r.json() if r.status_code == 200 else []
            except (httpx.HTTPError, ValueError) as exc:  # monitoring never takes training down
                log.debug("fp8guard: command long-poll failed: %s", exc)
                time.sleep(0.2)
                continue
            if isinstance(got, list) and got:
                ids = [int(c["id"]) for c in got if isinstance(c, dict) and isinstance(c.get("id"), int)]
                with self._lock:
                    self._after = max([self._after, *ids])
                self._on_commands(got)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        if self._owns_client:
            self._client.close()
