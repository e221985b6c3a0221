"""``create_app(settings)``: the FastAPI application factory. Nothing is built at import time.

The stages, in the order data flows through them::

    ingest (validate, group-commit, answer)  ->  store  ->  loop (detect, decide, issue commands)
        ->  commands (ingest answers, long-poll channel) and alerts (outbox, dispatcher)
        ->  queries (JSON API, /metrics)  ->  web (dashboards)

Every route but ``/healthz``, the login page and static files needs a token with a role
(``service/auth``, ``docs/security.md``), unless ``settings.auth`` is off.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.openapi.utils import get_openapi

from fp8guard import __version__
from fp8guard.service import health
from fp8guard.service.alerts.dispatcher import AlertDispatcher
from fp8guard.service.auth import AUTH_RESPONSES, Authenticator, require
from fp8guard.service.auth import routes as token_routes
from fp8guard.service.domain import Batch, IngestResult
from fp8guard.service.errors import install_handlers
from fp8guard.service.ingest import routes as ingest_routes
from fp8guard.service.ingest.committer import Committer
from fp8guard.service.ingest.fast_path import IngestFastPath
from fp8guard.service.kinds import Role
from fp8guard.service.loop.channel import CommandChannel
from fp8guard.service.loop.process import LoopProcess, loop_worker
from fp8guard.service.loop.worker import LoopWorker
from fp8guard.service.queries import loop as loop_queries
from fp8guard.service.queries import runs as run_queries
from fp8guard.service.queries.metrics import install_metrics
from fp8guard.service.schemas import IngestBatchIn
from fp8guard.service.settings import Settings
from fp8guard.service.store import Store
from fp8guard.service.web import install_page_errors, web_router

__all__ = ["create_app"]


def create_app(settings: Settings | None = None, *, store: Store | None = None) -> FastAPI:
    """Build the service. ``store`` may be passed in (tests); otherwise it is opened from
    ``settings.database_url`` and the schema is checked now, so a bad database fails fast."""
    settings = settings or Settings()
    owns_store = store is None
    store = store or Store.open(settings.database_url, check_schema=settings.check_schema)
    channel = CommandChannel()
    postgres = store.engine.dialect.name == "postgresql"
    loop: LoopWorker | LoopProcess = (LoopProcess(settings, store, on_commands=channel.notify) if settings.loop_process
                                      else loop_worker(settings, store, channel.notify))

    def judge_soon(batch: Batch, result: IngestResult) -> None:
        if result.run_pk is not None and not result.duplicate:
            loop.submit(result.run_pk, result.queue_id, batch)

    writers = settings.ingest_writers or (4 if postgres else 1)
    inline = settings.ingest_inline_max_samples
    committer = Committer(store, writers=writers, max_batches=settings.group_commit_max_batches,
                          on_stored=judge_soon, inline_max_samples=20_000 if inline is None else inline)
    dispatcher = AlertDispatcher(store.engine, settings.alerts)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        channel.bind(asyncio.get_running_loop())
        committer.start()
        loop.start()
        if owns_store:  # a store handed in by a test drives its own dispatcher, if any
            dispatcher.start()
        yield
        committer.close()  # stores what was accepted, then the loop judges it
        loop.drain(timeout=settings.loop_drain_timeout_s)
        loop.close()
        dispatcher.close()
        store.close()

    app = FastAPI(
        title="fp8guard",
        version=__version__,
        summary="Stores FP8 training telemetry, judges it, and orders rollbacks and BF16 fallbacks.",
        lifespan=lifespan,
        docs_url=None, redoc_url=None, openapi_url=None,  # served by web_router, behind a read token
    )
    app.state.settings = settings
    app.state.store = store
    app.state.committer = committer
    app.state.loop = loop
    app.state.commands = channel
    app.state.alerts = dispatcher
    app.state.auth = Authenticator(store, settings)
    install_handlers(app)
    read = [Depends(require(Role.READ))]
    app.include_router(health.router)
    app.include_router(ingest_routes.router)
    app.include_router(run_queries.router, dependencies=read, responses=AUTH_RESPONSES)
    app.include_router(loop_queries.router)
    app.include_router(token_routes.router)
    app.include_router(web_router())
    install_page_errors(app)
    app.add_middleware(IngestFastPath, router=ingest_routes.router)  # before install_metrics: inside its middleware
    install_metrics(app, store, dependencies=read)
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
