"""Tokens and session secrets: how they are made and issued, and the only form in which they are
stored.

Secrets carry 256 random bits, so a plain SHA-256 digest is enough to store them (a slow
password hash protects guessable passwords, not random keys) and keeps every request's
lookup to one hash and one indexed read."""

from __future__ import annotations

import hashlib
import re
import secrets

from fp8guard.service.domain import TokenRecord
from fp8guard.service.errors import InvalidPayload
from fp8guard.service.kinds import Role
from fp8guard.service.schemas import RUN_PREFIX_PATTERN, TOKEN_NAME_PATTERN
from fp8guard.service.store import Store

__all__ = ["TOKEN_PREFIX", "digest", "hint", "issue_token", "new_secret", "new_token"]

TOKEN_PREFIX = "fp8g_"
"""Every API token starts with this, so secret scanners and people recognise one."""


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def new_secret() -> str:
    """A browser session's cookie value."""
    return secrets.token_urlsafe(32)


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def hint(token: str) -> str:
    """The first characters of a token: enough to recognise it in ``fp8guard token list``."""
    return token[: len(TOKEN_PREFIX) + 4] + "…"


def issue_token(store: Store, *, name: str, role: Role, run_prefix: str | None = None) -> tuple[str, TokenRecord]:
    """Create a token; returns the secret (shown once, never stored) and its record."""
    if not re.fullmatch(TOKEN_NAME_PATTERN, name):
        raise InvalidPayload(f"token name {name!r} must match {TOKEN_NAME_PATTERN}", loc=("name",))
    if run_prefix is not None and role is not Role.INGEST:
        raise InvalidPayload("only ingest tokens take a run prefix", loc=("run_prefix",))
    if run_prefix is not None and not re.fullmatch(RUN_PREFIX_PATTERN, run_prefix):
        raise InvalidPayload(f"run prefix {run_prefix!r} must match {RUN_PREFIX_PATTERN} (an empty one would cover "
                             "every run: leave it out instead)", loc=("run_prefix",))
    token = new_token()
    record = store.create_token(name=name, role=role, run_prefix=run_prefix, secret_hash=digest(token),
                                hint=hint(token))
    return token, record
