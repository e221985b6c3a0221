"""The service's exception tree, translated to HTTP in exactly one place (``install_handlers``).

* ServiceError
  + NotFound            404  an unknown run, tensor or stat
  + Conflict            409  data that contradicts what is stored (a tensor index re-used with another name)
  + InvalidPayload      422  a request that parses but is wrong; ``loc`` names the field
  + Unauthorized        401  no credentials, or a token that is unknown, revoked or expired
  + Forbidden           403  a valid token whose role or run scope does not allow the request
  + PayloadTooLarge     413
  + BadEncoding         400  undecodable gzip or JSON
  (request validation   422  FastAPI's errors, without the echoed input)
  + StorageUnavailable  503  the database is down or locked; safe to retry
    + Overloaded        503  the process holds its budget of request bodies; safe to retry
  + SchemaNotAtHead          startup refusal (never reaches HTTP)

Routes never catch SQLAlchemy errors; the store converts them at its boundary.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from fastapi import FastAPI, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

__all__ = [
    "BadEncoding",
    "Conflict",
    "Forbidden",
    "InvalidPayload",
    "NotFound",
    "Overloaded",
    "PayloadTooLarge",
    "SchemaNotAtHead",
    "ServiceError",
    "StorageUnavailable",
    "Unauthorized",
    "error_response",
    "install_handlers",
]

log = logging.getLogger(__name__)


class ServiceError(Exception):
    status_code = 500
    error_type = "service_error"

    def __init__(self, message: str, *, loc: Sequence[str | int] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.loc = tuple(loc)

    def to_detail(self) -> list[dict[str, object]]:
        # Same shape as FastAPI's own 422 bodies, so clients parse one format.
        return [{"loc": list(self.loc), "msg": self.message, "type": self.error_type}]


class NotFound(ServiceError):
    status_code = 404
    error_type = "not_found"


class Conflict(ServiceError):
    status_code = 409
    error_type = "conflict"


class InvalidPayload(ServiceError, ValueError):
    status_code = 422
    error_type = "value_error"


class Unauthorized(ServiceError):
    status_code = 401
    error_type = "unauthorized"


class Forbidden(ServiceError):
    status_code = 403
    error_type = "forbidden"


class PayloadTooLarge(ServiceError):
    status_code = 413
    error_type = "too_large"


class BadEncoding(ServiceError):
    status_code = 400
    error_type = "bad_encoding"


class StorageUnavailable(ServiceError):
    status_code = 503
    error_type = "storage_unavailable"


class Overloaded(StorageUnavailable):
    """Too many request bytes in flight (``max_inflight_body_bytes``): like an unavailable
    database, answered 503 with Retry-After, and the agent retries the same batch."""

    error_type = "overloaded"


class SchemaNotAtHead(ServiceError):
    """Raised at startup; the message says which command brings the schema to head."""


def install_handlers(app: FastAPI) -> None:
    async def handle(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ServiceError)
        headers = ({"Retry-After": "1"} if isinstance(exc, StorageUnavailable)
                   else {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthorized) else None)
        return JSONResponse({"detail": exc.to_detail()}, status_code=exc.status_code, headers=headers)

    app.add_exception_handler(ServiceError, handle)

    async def http_error(request: Request, exc: Exception) -> Response:
        """FastAPI's own 400 and 405, made to say what the OpenAPI says: a body that is not even
        JSON text (undecodable bytes) is a 422 like any other invalid body, not a bare 400; a 405
        lists in ``Allow`` every method the OpenAPI has for the path (Starlette listed those of
        one route, and ``/v1/runs/{run_id}`` is two, GET and PUT). Keyed by status code, so the
        pages' 404 handler and this one never replace each other."""
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            return JSONResponse({"detail": [{"loc": ["body"], "msg": "the body is not JSON text (undecodable bytes)",
                                             "type": "json_invalid"}]}, status_code=422)
        if exc.status_code == 405:
            path = request.url.path
            methods = sorted({m.upper() for template, ops in request.app.openapi().get("paths", {}).items()
                              if compile_path(template)[0].match(path) for m in ops})
            return JSONResponse({"detail": exc.detail}, status_code=405, headers={"Allow": ", ".join(methods)})
        return await http_exception_handler(request, exc)

    app.add_exception_handler(400, http_error)
    app.add_exception_handler(405, http_error)

    async def invalid(_: Request, exc: Exception) -> JSONResponse:
        # FastAPI's own 422 body, less the echoed "input": it may be megabytes, or text that is
        # not even valid Unicode (a lone surrogate made rendering the error itself fail).
        assert isinstance(exc, RequestValidationError)
        errors = [{k: v for k, v in e.items() if k not in ("input", "ctx", "url")} for e in exc.errors()]
        return JSONResponse({"detail": jsonable_encoder(errors)}, status_code=422)

    app.add_exception_handler(RequestValidationError, invalid)


async def error_response(request: Request, exc: Exception) -> Response | None:
    """The answer the app's exception handlers (those ``install_handlers`` and FastAPI register)
    give ``exc``, found the way Starlette's exception middleware finds one: an HTTP exception's
    status code first, then the exception's classes, most specific first; handlers for 500 and
    ``Exception`` belong to the server-error middleware and are skipped. None when no handler
    applies: the caller re-raises, and the server-error middleware answers 500.

    For code that answers a request outside FastAPI's router (``ingest.fast_path``), so its
    errors read exactly like every other route's."""
    handlers = request.app.exception_handlers
    handler = None
    if isinstance(exc, StarletteHTTPException) and exc.status_code != 500:
        handler = handlers.get(exc.status_code)
    if handler is None:
        handler = next((handlers[cls] for cls in type(exc).__mro__ if cls in handlers and cls is not Exception), None)
    if handler is None:
        return None
    answer = await handler(request, exc) if asyncio.iscoroutinefunction(handler) \
        else await run_in_threadpool(handler, request, exc)
    assert isinstance(answer, Response)
    return answer
