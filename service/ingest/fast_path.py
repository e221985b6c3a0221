"""``IngestFastPath``: ``POST /v1/ingest`` served without FastAPI's router and request machinery.

The ingest route is the one every agent calls every few seconds; under one busy agent the ASGI
layers between uvicorn and the route function (exception middleware, the exit-stack middleware,
route matching over every route, FastAPI's request handler and its exit stacks) cost as much
event-loop time as parsing the batch. This pure ASGI middleware, installed inside the HTTP metrics
middleware and outside everything else the app adds, answers exactly ``POST /v1/ingest`` by
calling the route function itself, and passes every other request on unchanged.

What the route gets from FastAPI, it still gets:

* the same function (``ingest_routes.ingest``: auth, body limits and gzip, parse, store, answer);
* the same error answers: an exception is answered by the handler the app registered for it,
  found the way Starlette's exception middleware finds it (``errors.error_response``); one with
  no handler propagates to the server-error middleware (a 500), as before;
* the same metrics: the route object goes in ``scope["route"]``, where the router puts it, so
  the metrics middleware labels the request with the route's template;
* the same OpenAPI: the route stays registered (and answers if the fast path is not installed);
* the same traces: with FastAPI's OpenTelemetry on, requests take the full path (the router
  names their spans).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request, Response
from fastapi.routing import APIRoute, APIRouter
from starlette.types import ASGIApp, Receive, Scope, Send

from fp8guard.service.errors import error_response

__all__ = ["IngestFastPath"]

_PATH = "/v1/ingest"
_TRACED = "fastapi.telemetry"
"""In the scope when FastAPI's own OpenTelemetry is on: the router names the request's span after
the route, so such requests take the full path."""


class IngestFastPath:
    """Pure ASGI middleware: ``POST /v1/ingest`` to the route function of ``router``'s route for
    it, anything else to ``app``."""

    def __init__(self, app: ASGIApp, *, router: APIRouter) -> None:
        self.app = app
        routes = [r for r in router.routes if isinstance(r, APIRoute) and r.path == _PATH and "POST" in (r.methods or ())]
        if len(routes) != 1:
            raise ValueError(f"IngestFastPath: the router has {len(routes)} POST {_PATH} routes, not one")
        self.route = routes[0]
        self.endpoint: Callable[[Request], Awaitable[Response]] = self.route.endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != _PATH or scope.get("root_path")
                or _TRACED in scope):
            await self.app(scope, receive, send)
            return
        # What the router sets on a match (the metrics label the request with the route's template)
        scope.update(route=self.route, endpoint=self.endpoint, path_params={})
        request = Request(scope, receive, send)
        try:
            response = await self.endpoint(request)
        except Exception as exc:
            answer = await error_response(request, exc)
            if answer is None:
                raise
            response = answer
        await response(scope, receive, send)
