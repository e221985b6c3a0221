"""Service configuration: one pydantic-settings object, read from ``FP8GUARD_*`` variables."""

from __future__ import annotations

from pathlib import Path

from platformdirs import user_data_dir
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url

from fp8guard.service.alerts.config import AlertSettings

__all__ = ["Settings", "default_database_url"]


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
    max_decompressed_bytes: int = Field(default=256 * 2**20, ge=1024)
    """Largest body after gunzip, a guard against compression bombs."""
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
    loop_threads: int = Field(default=2, ge=1, le=64)
    """Threads judging runs (one run per thread at a time; runs in parallel)."""
    loop_batch_limit: int = Field(default=256, ge=1)
    """Most queued batches one closed-loop pass judges before the run's turn passes on."""
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
