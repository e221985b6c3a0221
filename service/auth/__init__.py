"""Authentication and roles: tokens (``tokens``), who may do what (``access``), the token API
(``routes``); the login page lives with the other pages (``service/web``). ``docs/security.md`` has the
threat model."""

from fp8guard.service.auth.access import (
    AUTH_RESPONSES,
    OPENAPI_SECURITY,
    SESSION_COOKIE,
    AdminAccess,
    Authenticator,
    FollowAccess,
    IngestAccess,
    Principal,
    ReadAccess,
    authorize,
    require,
)

__all__ = ["AUTH_RESPONSES", "OPENAPI_SECURITY", "SESSION_COOKIE", "AdminAccess", "Authenticator", "FollowAccess",
           "IngestAccess", "Principal", "ReadAccess", "authorize", "require"]
