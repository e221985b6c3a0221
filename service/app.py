"""``create_app(settings)``: the FastAPI application factory. Nothing is built at import time."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from fp8guard import __version__
from fp8guard.service.alerts.dispatcher import AlertDispatcher
from fp8guard.service.alerts.hook import OutboxAlerts
from fp8guard.service.errors import install_handlers
from fp8guard.service.metrics import install_metrics
from fp8guard.service.routes import health, ingest, runs
from fp8guard.service.schemas import IngestBatchIn
from fp8guard.service.settings import Settings
from fp8guard.service.store import Store
from fp8guard.service.web import web_router

__all__ = ["create_app"]


def create_app(settings: Settings | None = None, *, store: Store | None = None) -> FastAPI:
    """Build the service. ``store`` may be passed in (tests); otherwise it is opened from
    ``settings.database_url`` and the schema is checked now, so a bad database fails fast."""
    settings = settings or Settings()
    owns_store = store is None
    store = store or Store.open(settings.database_url, check_schema=settings.check_schema)
    store.alert_hook = OutboxAlerts(settings.alerts)
    dispatcher = AlertDispatcher(store.engine, settings.alerts)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if owns_store:  # a store handed in by a test drives its own dispatcher, if any
            dispatcher.start()
        yield
        dispatcher.close()
        store.close()

    app = FastAPI(
        title="fp8guard",
        version=__version__,
        summary="Stores FP8 training telemetry and answers queries for dashboards.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.store = store
    app.state.alerts = dispatcher
    install_handlers(app)
    app.include_router(health.router)
    app.include_router(ingest.router)
    app.include_router(runs.router)
    app.include_router(web_router())
    install_metrics(app, store)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The ingest body is parsed by hand (for gzip and size limits), so publish its schema here."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    body = IngestBatchIn.model_json_schema(ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(body.pop("$defs", {}))
    components["IngestBatchIn"] = body
    app.openapi_schema = schema
    return schema
