"""One batch to the service: a POST retried with the same bytes, the run registered on the way.

:class:`Courier` knows HTTP and nothing about ordering, the spool or counting (that is
:class:`~fp8guard.agent.transport.link.Link`'s job): it answers with a typed :class:`Answer`:
delivered (a duplicate or not, with the commands that rode on it), refused for what it is
(never retry it), or could not be delivered (keep it). ``fp8guard spool flush`` uses it too.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import httpx

from fp8guard.agent.transport.base import RunInfo
from fp8guard.agent.transport.ratelimit import RateLimiter, suppressed_note
from fp8guard.agent.transport.responses import describe_exception, error_detail, retry_after_s

__all__ = ["AUTH_STATUSES", "Answer", "Courier", "Outcome", "auth_headers"]

log = logging.getLogger("fp8guard.agent.transport")

AUTH_STATUSES = (401, 403)
"""Not transient and not the payload's fault: the token is missing, invalid or lacks the role.
Retrying at once cannot help, dropping would lose good data: such batches are spooled."""


class Outcome(Enum):
    DELIVERED = "delivered"  # stored, or a duplicate of a stored batch
    REJECTED = "rejected"  # the service refused the payload itself: never retry it
    FAILED = "failed"  # transient trouble (or a refused token) outlasted the attempts: keep the payload


@dataclass(frozen=True)
class Answer:
    """What became of one body: the outcome, and what the service said about it."""

    outcome: Outcome
    reason: str = ""
    """Why it was refused or failed, in one line (the service's ``detail`` for a refusal)."""
    status: int | None = None
    """The HTTP status of the last answer (None: no answer, a connection error or a timeout)."""
    duplicate: bool = False
    """Delivered, and the service had stored this ``batch_id`` already."""
    commands: list[dict[str, Any]] = field(default_factory=list)
    """Remediation commands that rode on the ingest answer."""
    retries: int = 0
    """Requests repeated on the way (a re-registration after 404 included)."""


class _Retryable(Exception):
    """A transient failure inside one attempt (registration refused with 5xx, ...)."""

    def __init__(self, reason: str, retry_after: float | None = None, *, status: int | None = None,
                 auth: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after
        self.status = status
        self.auth = auth


def auth_headers(token: str | None) -> dict[str, str]:
    """The headers every request of the agent carries (none without a token)."""
    return {"authorization": f"Bearer {token}"} if token else {}


class Courier:
    """POSTs bodies to ``/v1/ingest`` (registering the run first, and again on 404).

    Connection errors, timeouts, 408, 429 and 5xx are retried with the same bytes (exponential
    backoff with full jitter, numeric ``Retry-After`` honoured up to ``backoff_max_s``); other
    4xx are the payload's fault: logged with the service's ``detail``, never retried. 401 and
    403 are the token's fault: one clear error line (again only after the token worked in
    between), no retries, and the caller keeps the batch.
    """

    def __init__(self, *, url: str, run: RunInfo | None, client: httpx.Client, prefix: str, token: str | None,
                 backoff_base_s: float, backoff_max_s: float, sleep: Callable[[float], None],
                 rng: random.Random, limiter: RateLimiter) -> None:
        self._url = url
        self._run = run
        self._client = client
        self._prefix = prefix
        self._headers = auth_headers(token)
        self._backoff_base_s = backoff_base_s
        self._backoff_max_s = backoff_max_s
        self._sleep = sleep
        self._rng = rng
        self._limiter = limiter
        self._registered = run is None  # without a RunInfo, batches go to a run registered earlier
        self._auth_reported: set[int] = set()
        self.last_failure = ""
        self.auth_refused = False
        """Whether the last failure was a refused token (the breaker then says so, not 'unreachable')."""

    def deliver(self, body: bytes, *, gzipped: bool, batch_id: str, attempts: int,
                deadline: float | None = None, clock: Callable[[], float] = time.monotonic,
                spool_note: str = "") -> Answer:
        """POST one body, retrying transient failures with these exact bytes."""
        headers = {**self._headers, "content-type": "application/json"}
        if gzipped:
            headers["content-encoding"] = "gzip"
        attempt = 1
        retries = 0
        may_reregister = True
        status: int | None = None
        while True:
            retry_after: float | None = None
            status = None
            try:
                if not self._registered:
                    self._register(spool_note)
                response = self._client.post(f"{self._prefix}/v1/ingest", content=body, headers=headers)
            except _Retryable as exc:
                reason, retry_after = exc.reason, exc.retry_after
                if exc.auth:
                    self.last_failure, self.auth_refused = reason, True
                    return Answer(Outcome.FAILED, reason, exc.status, retries=retries)
            except Exception as exc:  # httpx errors, and anything a custom client throws
                reason = describe_exception(exc)
            else:
                status = response.status_code
                if 200 <= status < 300:
                    return self._accepted(response, retries)
                if status in AUTH_STATUSES:
                    self._auth_refused(status, response, "sending telemetry", spool_note)
                    self.last_failure, self.auth_refused = f"HTTP {status} (token refused)", True
                    return Answer(Outcome.FAILED, self.last_failure, status, retries=retries)
                if status == 404:
                    # The run is unknown (say the service came back on a fresh database): register
                    # again and retry at once; once per call this costs no attempt, so even a
                    # single-attempt probe survives it.
                    self._registered = self._run is None
                    if may_reregister and self._run is not None:
                        may_reregister = False
                        retries += 1
                        continue
                    reason = "HTTP 404 (run not registered)"
                elif 400 <= status < 500 and status not in (408, 429):
                    return Answer(Outcome.REJECTED, f"HTTP {status}: {error_detail(response)}", status,
                                  retries=retries)
                else:
                    retry_after = retry_after_s(response)
                    reason = f"HTTP {status}"
            self.last_failure, self.auth_refused = reason, False
            if attempt >= attempts:
                break
            delay = self._backoff(attempt, retry_after)
            if deadline is not None and clock() + delay >= deadline:
                break
            log.debug("batch %s: attempt %d/%d failed (%s); retrying in %.2f s", batch_id, attempt,
                      attempts, reason, delay)
            retries += 1
            if delay > 0:
                self._sleep(delay)
            attempt += 1
        return Answer(Outcome.FAILED, self.last_failure, status, retries=retries)

    def _register(self, spool_note: str) -> None:
        assert self._run is not None  # _registered starts True without a RunInfo
        try:
            response = self._client.put(f"{self._prefix}/v1/runs/{self._run.run_id}",
                                        json=self._run.registration_body(), headers=self._headers)
        except Exception as exc:
            raise _Retryable(f"registering the run: {describe_exception(exc)}") from exc
        if response.status_code in (200, 201):
            self._registered = True
            self._auth_reported.clear()  # a later refusal (a revoked token) is news again
            return
        if response.status_code in AUTH_STATUSES:
            self._auth_refused(response.status_code, response, f"registering run {self._run.run_id}", spool_note)
            raise _Retryable(f"registering the run: HTTP {response.status_code} (token refused)",
                             status=response.status_code, auth=True)
        # A 4xx here is not transient, but the batches themselves are fine: keep them (spool) until
        # someone fixes the url or the run info and restarts, rather than dropping good data.
        refused = 400 <= response.status_code < 500 and response.status_code not in (408, 429)
        if refused and (suppressed := self._limiter.allow("register")) is not None:
            log.error("fp8guard: registering run %s at %s was refused: HTTP %d %s; batches are kept in "
                      "the spool%s", self._run.run_id, self._url, response.status_code, error_detail(response),
                      suppressed_note(suppressed))
        raise _Retryable(f"registering the run: HTTP {response.status_code}", retry_after_s(response),
                         status=response.status_code)

    def _auth_refused(self, status: int, response: httpx.Response, doing: str, spool_note: str) -> None:
        """One line per refusal kind, not one per batch: the token will not fix itself."""
        if status in self._auth_reported:
            return
        self._auth_reported.add(status)
        why = ("no valid token was sent: set MonitorConfig(token=...) or $FP8GUARD_TOKEN to an ingest token"
               if status == 401 else
               "the token lacks the ingest role or is not scoped to "
               + (f"run {self._run.run_id!r}" if self._run is not None else "this run"))
        log.error("fp8guard: the service at %s refused %s with HTTP %d (%s; %s); telemetry is kept%s and sent "
                  "once the service accepts the token", self._url, doing, status, error_detail(response)[:200],
                  why, spool_note)

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self._backoff_max_s)
        # Full jitter: ranks that failed together do not retry together.
        return self._rng.uniform(0.0, min(self._backoff_max_s, self._backoff_base_s * 2.0 ** (attempt - 1)))

    def _accepted(self, response: httpx.Response, retries: int) -> Answer:
        self._auth_reported.clear()
        try:
            body = response.json()
            duplicate = body.get("duplicate") is True
            commands = body.get("commands") or []
        except Exception:  # the status is authoritative; the body is informative
            duplicate, commands = False, []
        return Answer(Outcome.DELIVERED, status=response.status_code, duplicate=duplicate,
                      commands=list(commands) if isinstance(commands, list) else [], retries=retries)
