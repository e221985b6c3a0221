"""Service configuration: one pydantic-settings object, read from ``FP8GUARD_*`` variables."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

from platformdirs import user_data_dir
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url

from fp8guard.service.alerts.config import AlertSettings

__all__ = ["AuthMode", "Settings", "default_database_url", "is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether a listen address stays on this machine (a host name may resolve beyond it)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class AuthMode(StrEnum):
    REQUIRED = "required"
    """Every route but ``/healthz`` and the login page needs a token (``docs/security.md``)."""
    OFF = "off"
    """Anyone who reaches the port is the administrator: for a service on loopback only."""


def default_database_url() -> str:
    """A SQLite file in the user's data directory (e.g. ~/.local/share/fp8guard/fp8guard.db)."""
    return f"sqlite:///{Path(user_data_dir('fp8guard')) / 'fp8guard.db'}"


class Settings(BaseSettings):
    """Everything the service can be told. ``create_app(Settings(...))`` in code and tests;
    environment variables (``FP8GUARD_DATABASE_URL``...) for deployments."""

    model_config = SettingsConfigDict(env_prefix="FP8GUARD_", env_nested_delimiter="__", extra="forbid")

    database_url: str = Field(default_factory=default_database_url)
    """SQLAlchemy URL: ``sqlite:///path.db`` (default) or ``postgresql://user@host/db`` (psycopg 3)."""
    max_body_bytes: int = Field(default=64 * 2**20, ge=1024)
    """Largest request body accepted as sent (compressed or not); larger gets 413."""
    max_decompressed_bytes: int = Field(default=64 * 2**20, ge=1024)
    """Largest body after gunzip: the same ceiling as ``max_body_bytes``, so compression saves
    bandwidth but never raises what one request may carry (at 256 MiB a 255 KB gzip bomb was
    inflated whole and peaked at 1.45 GB RSS). The agent's default batch (50 steps) of 10,000
    tensors x 8 stats is ~21 MB of base64; the large-batch benchmark's 2.1 MB."""
    max_inflight_body_bytes: int = Field(default=128 * 2**20, ge=1024)
    """Bytes of request bodies this process holds at once (being read or parsed); a body
    that would pass it gets 503 with Retry-After, which agents retry. Parsing and decoding hold
    about two more copies, so the ingest path's memory stays near 3x this whatever arrives (three
    concurrent bombs used to take 2.3 GB). Never below ``max_decompressed_bytes``."""
    max_event_data_bytes: int = Field(default=64 * 2**10, ge=256)
    """Largest ``data`` of one event, as compact JSON. The agent's events (acks, checkpoints, notes,
    precision changes) are under 2 KB; a stored event is served to every dashboard load, so a
    250 MB one cost 7.6 s and 262 MB per page view."""
    max_batch_event_bytes: int = Field(default=1 * 2**20, ge=256)
    """Largest total ``data`` of a batch's events: 16 events at the per-event ceiling, or ~500 of
    the agent's."""
    max_width: int = Field(default=20_000, ge=1)
    """Most columns a downsampled query may ask for."""
    alerts: AlertSettings = Field(default_factory=AlertSettings)
    """Where alerts go: ``FP8GUARD_ALERTS__WEBHOOKS='[{"url": ..., "secret": "whsec_..."}]'``,
    ``FP8GUARD_ALERTS__SLACK``, ``FP8GUARD_ALERTS__ALERTMANAGER`` (see ``service/alerts/config.py``)."""
    ingest_writers: int | None = Field(default=None, ge=1, le=64)
    """Threads storing ingest groups: default 1 on SQLite (one writer at a time), 4 on PostgreSQL
    (a run's first batches wait on the database server, not on Python: 50 agents starting at
    once queued behind one writer for seconds)."""
    group_commit_max_batches: int = Field(default=64, ge=1, le=10_000)
    """Most batches stored in one ingest transaction (group commit under many agents)."""
    ingest_inline_max_samples: int | None = Field(default=None, ge=0)
    """A batch of at most this many samples that finds no writer busy and nothing queued is stored
    on the event loop, without the two thread hand-offs (``service/ingest/committer.py``); 0: off.
    Default 20,000 on both databases: a 2,000-sample batch is written in 1-2.5 ms on SQLite, and
    on PostgreSQL in one round trip once its rank is known (``store/telemetry_writer.py``). One
    unthrottled agent on PostgreSQL sent 213-239 batches/s with it against 208-213 without, side
    by side; 50 agents x 1/s kept p99 at 44-68 ms (34-43 without: a run's first batch, which
    reads its tensor table back, holds the event loop for its round trips) (``docs/benchmarks.md``,
    seventh session)."""
    loop_threads: int | None = Field(default=None, ge=1, le=64)
    """Threads judging runs (one run per thread at a time; runs in parallel): default 1 on SQLite
    (a pass holds the database's one write lock from its start, so a second thread only waits)
    and 2 on PostgreSQL."""
    loop_process: bool = False
    """Run the closed loop in a process of its own, started, supervised (restarted if it dies) and
    drained by this one (``service/loop/process.py``; ``fp8guard serve --loop-process`` or
    ``FP8GUARD_LOOP_PROCESS=1``). Off by default. In the serving process, the loop's passes took about
    a fifth of its GIL time under one unthrottled agent (py-spy), time the ingest path waited for;
    in a process of its own they cost the serving process one frame per batch, and its CPU per
    batch fell from 6.8-11 ms to 5.3-7.5 ms (``docs/benchmarks.md``, fifth session, a shared
    2-core host). On that host, with the load generator on the same cores, throughput and p99 were
    the same either way within its noise, and the loop process costs more CPU in all (its own
    wake-ups per batch, ~2 s to start), and under 50 agents on PostgreSQL a decision took up to
    119-123 ms to reach the agent against 17-69 ms in threads (the issue's target: 50 ms): the
    gain needs a core the serving process does not use, so it is for hosts that have one."""
    loop_batch_limit: int = Field(default=256, ge=1)
    """Most queued batches one closed-loop pass judges before the run's turn passes on."""
    loop_gather_s: float = Field(default=0.02, ge=0, le=1)
    """A run that ships faster than one batch per this many seconds has its healthy batches judged
    this long after the first of them came, with whatever else came meanwhile: one pass for several
    batches (a pass's fixed work was half its CPU for a small batch). Delays a decision on healthy
    numbers (a spike, saturation) of such a run by up to this much; a run's batch that follows its
    previous one by more than this, and a non-finite loss, grad norm or amax, are judged at once.
    0: every batch at once."""
    loop_sweep_interval_s: float = Field(default=1.0, gt=0, le=3600)
    """How often the loop looks for batches other processes (or a crash) left unjudged."""
    loop_drain_timeout_s: float = Field(default=10.0, ge=0)
    """On shutdown, how long the loop may take to judge what was already acknowledged (what is
    left stays queued in the database and is judged after the restart)."""
    command_poll_interval_s: float = Field(default=0.5, gt=0, le=60)
    """A long-poll on commands re-reads the database this often (commands decided by another
    service process; those of this process wake it at once)."""
    long_poll_max_s: float = Field(default=60.0, gt=0, le=300)
    """Longest wait a long-poll on commands may ask for."""
    auth: AuthMode = AuthMode.REQUIRED
    """``required``: tokens with roles (``fp8guard token create``). ``fp8guard serve`` turns it off
    on a loopback address unless ``FP8GUARD_AUTH`` says otherwise, and refuses to serve beyond
    loopback with it off unless told ``--insecure``."""
    auth_cache_s: float = Field(default=5.0, ge=0, le=300)
    """How long a token look-up is reused: a revoked token stops working within this time in
    every process (each request would otherwise cost a database read)."""
    trusted_auth_header: str | None = Field(default=None, min_length=1, max_length=64)
    """A header an SSO proxy sets to the signed-in user (e.g. ``X-Forwarded-Email`` from
    oauth2-proxy); its value is trusted as a ``read`` user. Off by default: set it only when the
    service is reachable through that proxy alone, since anyone else could send the header."""
    session_max_age_s: int = Field(default=12 * 3600, ge=60, le=30 * 86400)
    """How long a browser session opened on the login page lasts."""
    secure_cookies: bool = False
    """Mark the session cookie ``Secure`` even when the request arrived over plain HTTP (a TLS
    proxy in front); requests that arrive over HTTPS always get a ``Secure`` cookie."""
    check_schema: bool = True
    """Refuse to start unless the schema is at the newest migration (turn off only in tests)."""

    @field_validator("database_url")
    @classmethod
    def _valid_url(cls, value: str) -> str:
        try:
            url = make_url(value)
        except Exception as exc:  # sqlalchemy raises ArgumentError with a terse message
            raise ValueError(f"not a database URL: {value!r} (expected sqlite:///file.db or postgresql://...)") from exc
        if url.get_backend_name() not in ("sqlite", "postgresql"):
            raise ValueError(f"unsupported database {url.get_backend_name()!r}: use sqlite or postgresql")
        return value
