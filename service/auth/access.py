"""Who is asking, and may they: the one place that turns a request's credentials into a
``Principal`` and checks it against a role and, for ingest tokens, a run.

Credentials, in the order they are looked at:

1. ``Authorization: Bearer fp8g_...`` (agents, curl, Prometheus, Grafana);
2. the ``fp8guard_session`` cookie the login page sets (browsers);
3. a trusted header set by an SSO proxy (``FP8GUARD_TRUSTED_AUTH_HEADER``; off unless set), which
   grants ``read`` to the user it names.

A bearer token that is present but unknown or revoked is refused (401) even if a cookie would
have passed: a client that sends a wrong token should hear so. With ``FP8GUARD_AUTH=off`` every
request is the local administrator, as before authentication existed.

Token and owner look-ups are cached for ``auth_cache_s`` (a revoked token stops working within
that time in every service process); run owners never change once set, so they are cached for
good. The route dependencies are ``async``: a cached answer costs no thread hand-off (the ingest
path's throughput depends on few hops); only a look-up that must read the database moves to the
thread pool.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Path, Request, Security
from fastapi.security import APIKeyCookie, HTTPBearer
from starlette.concurrency import run_in_threadpool

from fp8guard import wire
from fp8guard.service.auth import tokens
from fp8guard.service.domain import TokenRecord
from fp8guard.service.errors import Forbidden, Unauthorized
from fp8guard.service.kinds import Role
from fp8guard.service.settings import AuthMode, Settings
from fp8guard.service.store import Store

__all__ = [
    "AUTH_RESPONSES",
    "OPENAPI_SECURITY",
    "SESSION_COOKIE",
    "AdminAccess",
    "Authenticator",
    "FollowAccess",
    "IngestAccess",
    "Principal",
    "ReadAccess",
    "authorize",
    "require",
]

SESSION_COOKIE = "fp8guard_session"

_CACHE_LIMIT = 10_000
"""Cached look-ups kept at most; past it the cache starts afresh (bounds memory under a flood of
made-up tokens)."""


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller: its name (audit events carry it), role and, for ingest tokens, its run scope."""

    name: str
    role: Role
    token_id: int | None = None
    run_prefix: str | None = None

    def has(self, role: Role) -> bool:
        return self.role is Role.ADMIN or self.role is role

    @classmethod
    def of(cls, token: TokenRecord) -> Principal:
        return cls(name=token.name, role=token.role, token_id=token.id, run_prefix=token.run_prefix)


LOCAL_ADMIN = Principal(name="local (auth off)", role=Role.ADMIN)
"""Everyone, when authentication is off."""


class NeedsLoad(Exception):
    """Raised instead of reading the database when the caller asked for cached answers only."""


class _TtlCache:
    """A dict whose entries expire; thread-safe enough for look-ups (a race only re-reads)."""

    def __init__(self, ttl_s: float) -> None:
        self._ttl = ttl_s
        self._items: dict[str, tuple[float, TokenRecord | None]] = {}

    def get(self, key: str, load: Callable[[], TokenRecord | None], *, cached_only: bool = False) -> TokenRecord | None:
        now = time.monotonic()
        hit = self._items.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        if cached_only:
            raise NeedsLoad
        value = load()
        if len(self._items) >= _CACHE_LIMIT:
            self._items = {}
        self._items[key] = (now + self._ttl, value)
        return value

    def clear(self) -> None:
        self._items = {}


class Authenticator:
    """Resolves and checks credentials for one app (``app.state.auth``)."""

    def __init__(self, store: Store, settings: Settings) -> None:
        self.store = store
        self.enabled = settings.auth is AuthMode.REQUIRED
        self.trusted_header = settings.trusted_auth_header
        self.session_max_age_s = settings.session_max_age_s
        self.secure_cookies = settings.secure_cookies
        self._tokens = _TtlCache(settings.auth_cache_s)
        self._sessions = _TtlCache(settings.auth_cache_s)
        self._owners: dict[str, int | None] = {}
        self._lock = threading.Lock()

    def forget(self) -> None:
        """Drop cached look-ups (after a token is revoked through this process's API)."""
        self._tokens.clear()
        self._sessions.clear()

    # -- who -------------------------------------------------------------------------------

    def token(self, token: str) -> TokenRecord | None:
        """The live token behind a secret, or None."""
        key = tokens.digest(token)
        return self._tokens.get(key, lambda: self.store.token_by_hash(key))

    def principal(self, request: Request, *, cached_only: bool = False) -> Principal | None:
        """The caller, or None for an anonymous request. Raises 401 for a bad bearer token, and
        ``NeedsLoad`` with ``cached_only`` when answering would read the database."""
        if not self.enabled:
            return LOCAL_ADMIN
        header = request.headers.get("authorization")
        if header is not None:
            scheme, _, value = header.partition(" ")
            if scheme.lower() != "bearer" or not value.strip():
                raise Unauthorized("the Authorization header must be 'Bearer <token>'", loc=("header", "authorization"))
            key = tokens.digest(value.strip())
            record = self._tokens.get(key, lambda: self.store.token_by_hash(key), cached_only=cached_only)
            if record is None:
                raise Unauthorized("unknown or revoked token", loc=("header", "authorization"))
            return Principal.of(record)
        cookie = request.cookies.get(SESSION_COOKIE)
        if cookie:
            key = tokens.digest(cookie)
            record = self._sessions.get(key, lambda: self.store.session_token(key), cached_only=cached_only)
            if record is not None:
                return Principal.of(record)
        if self.trusted_header:
            user = request.headers.get(self.trusted_header, "").strip()
            if user:
                return Principal(name=user[:128], role=Role.READ)
        return None

    def require(self, request: Request, role: Role, *, cached_only: bool = False) -> Principal:
        principal = self.principal(request, cached_only=cached_only)
        if principal is None:
            raise Unauthorized("authentication required: send 'Authorization: Bearer <token>' "
                               "(fp8guard token create)")
        if not principal.has(role):
            raise Forbidden(f"token {principal.name!r} has role {principal.role}; this needs {role}")
        return principal

    # -- which runs --------------------------------------------------------------------------

    def check_run(self, principal: Principal, run_id: str, *, cached_only: bool = False) -> None:
        """May ``principal`` write to (or create) ``run_id``? Admins may; ingest tokens with a
        prefix may touch the runs under it; others only the runs they registered."""
        if principal.role is Role.ADMIN:
            return
        if principal.role is not Role.INGEST:
            raise Forbidden(f"token {principal.name!r} has role {principal.role}; writing to a run needs ingest")
        if principal.run_prefix is not None:
            if not run_id.startswith(principal.run_prefix):
                raise Forbidden(f"token {principal.name!r} may write only runs starting with "
                                f"{principal.run_prefix!r}", loc=("run_id",))
            return
        exists, owner = self._owner(run_id, cached_only=cached_only)
        if exists and owner != principal.token_id:
            raise Forbidden(f"run {run_id!r} was registered by another token; token {principal.name!r} may "
                            "write only the runs it registered", loc=("run_id",))

    def _owner(self, run_id: str, *, cached_only: bool = False) -> tuple[bool, int | None]:
        if run_id in self._owners:
            return True, self._owners[run_id]
        if cached_only:
            raise NeedsLoad
        exists, owner = self.store.run_owner(run_id)
        if exists:
            with self._lock:
                if len(self._owners) >= _CACHE_LIMIT:
                    self._owners = {}
                self._owners[run_id] = owner
        return exists, owner


# The two schemes only document the credentials in the OpenAPI schema (and let /docs send a
# token); the Authenticator reads the request itself.
_bearer = HTTPBearer(auto_error=False, description="An fp8guard token: `fp8guard token create --role ...`")
_cookie = APIKeyCookie(name=SESSION_COOKIE, auto_error=False, description="A session from the login page")


def authenticator(request: Request) -> Authenticator:
    auth: Authenticator = request.app.state.auth
    return auth


async def cached_or_loaded(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)`` on the event loop if the caches answer, else in the thread pool."""
    try:
        return call(*args, cached_only=True)
    except NeedsLoad:
        return await run_in_threadpool(call, *args)


OPENAPI_SECURITY: list[dict[str, list[str]]] = [{_bearer.scheme_name: []}, {_cookie.scheme_name: []}]
"""The credentials a gated route takes, as its access dependency documents them: for the OpenAPI
of a route that takes no dependencies (``POST /v1/ingest``)."""


async def authorize(request: Request, role: Role) -> Principal:
    """The caller, if it has ``role`` (401 anonymous, 403 without the role): the check every
    ``require(role)`` dependency makes, for a route that takes no dependencies to make itself."""
    principal: Principal = await cached_or_loaded(authenticator(request).require, request, role)
    return principal


def require(role: Role) -> Callable[..., Any]:
    """A dependency: ``authorize(request, role)``, its credentials documented in the OpenAPI."""

    async def dependency(request: Request, _b: Annotated[object, Security(_bearer)],
                         _c: Annotated[object, Security(_cookie)]) -> Principal:
        return await authorize(request, role)

    dependency.__name__ = f"require_{role}"
    return dependency


async def follow_run(request: Request, run_id: Annotated[str, Path(pattern=wire.RUN_ID_PATTERN)],
                     _b: Annotated[object, Security(_bearer)],
                     _c: Annotated[object, Security(_cookie)]) -> Principal:
    """A reader, or an ingest token on a run it may write (the agent long-polls its commands)."""
    auth = authenticator(request)
    principal: Principal | None = await cached_or_loaded(auth.principal, request)
    if principal is None:
        return auth.require(request, Role.READ)  # raises 401
    if not principal.has(Role.READ):
        await cached_or_loaded(auth.check_run, principal, run_id)
    return principal


AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"description": "No valid token (missing, unknown or revoked)"},
    403: {"description": "The token's role or run scope does not allow this"},
}
"""What every gated route may answer besides its own statuses (documented in the OpenAPI)."""

ReadAccess = Annotated[Principal, Depends(require(Role.READ))]
FollowAccess = Annotated[Principal, Depends(follow_run)]
IngestAccess = Annotated[Principal, Depends(require(Role.INGEST))]
AdminAccess = Annotated[Principal, Depends(require(Role.ADMIN))]
