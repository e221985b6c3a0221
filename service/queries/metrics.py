"""Prometheus metrics: ``install_metrics(app, store)`` adds ``GET /metrics`` to the service.

Everything lives in one ``CollectorRegistry`` made per app (no module globals), so tests and
several apps in one process never share series. Three kinds of metrics:

* service health, kept by a pure ASGI middleware: requests by route *template* (never the raw
  path, so run ids do not become labels), method and status code, and latency by route;
* ingest counters, fed by the ingest route through ``app.state.metrics.observe(result, n_bytes)``
  (rejections are counted by the middleware from the status code), database errors (an
  SQLAlchemy ``handle_error`` listener) and alert deliveries (``AlertDispatcher.stats()``);
* per-run gauges, computed at scrape time from the database by ``RunCollector`` for runs whose
  status is ``running`` only, at most ``max_runs`` of them (the rest counted in
  ``fp8guard_runs_truncated``). Finished runs drop out of the exposition by themselves.

One uvicorn process is assumed: custom collectors do not work in prometheus_client's
multiprocess mode (see docs/metrics.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import sqlalchemy as sa
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fp8guard.service.errors import StorageUnavailable
from fp8guard.service.kinds import ActionKind
from fp8guard.service.store.records import RunMetrics

__all__ = ["ACTION_KINDS", "AlertCollector", "IngestMetrics", "LoopCollector", "RunCollector", "install_metrics"]

log = logging.getLogger(__name__)

ACTION_KINDS = tuple(str(k) for k in ActionKind)
"""The ``kind`` values of ``fp8guard_run_actions_total``; a fixed set bounds the label."""

_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_UNMATCHED = "unmatched"
_INGEST_ROUTE = "/v1/ingest"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _IngestResult(Protocol):
    """What ``observe`` needs of ``fp8guard.service.domain.IngestResult``."""

    @property
    def duplicate(self) -> bool: ...

    @property
    def samples(self) -> int: ...


class _AlertStats(Protocol):
    def stats(self) -> dict[str, dict[str, int]]: ...

    def backlog(self) -> dict[str, dict[str, int]]: ...


class _RunMetricsSource(Protocol):
    """What the collectors need of ``Store``."""

    @property
    def engine(self) -> sa.Engine: ...

    @property
    def on_database_error(self) -> list[Callable[[BaseException], None]]: ...

    def run_metrics(self, max_runs: int) -> tuple[list[RunMetrics], int]: ...


class _LoopStats(Protocol):
    passes: int
    batches: int
    commands: int
    failures: int
    dropped: int
    seconds: float
    restarts: int
    up: int


class LoopCollector(Collector):
    """The closed loop's counters (kept by the loop worker) and the ingest group commits."""

    def __init__(self, stats: _LoopStats, committer: Any | None = None) -> None:
        self._stats = stats
        self._committer = committer

    def describe(self) -> Iterable[Metric]:
        return list(self.collect())

    def collect(self) -> Iterable[Metric]:
        s = self._stats
        yield CounterMetricFamily("fp8guard_loop_passes", "Closed-loop passes over a run.", value=s.passes)
        yield CounterMetricFamily("fp8guard_loop_batches", "Stored batches the closed loop judged.", value=s.batches)
        yield CounterMetricFamily("fp8guard_loop_commands", "Commands the closed loop issued.", value=s.commands)
        yield CounterMetricFamily("fp8guard_loop_failures", "Closed-loop passes that failed (retried).",
                                  value=s.failures)
        yield CounterMetricFamily("fp8guard_loop_dropped", "Batches the closed loop could not judge (a bug: logged).",
                                  value=s.dropped)
        yield CounterMetricFamily("fp8guard_loop_seconds", "Time spent in closed-loop passes.", value=s.seconds)
        yield CounterMetricFamily("fp8guard_loop_restarts", "Times the closed loop's process died and was started "
                                  "again.", value=s.restarts)
        yield GaugeMetricFamily("fp8guard_loop_up", "Whether the closed loop is running (0 while its process "
                                "restarts).", value=s.up)
        if self._committer is not None:
            yield CounterMetricFamily("fp8guard_ingest_commits", "Ingest transactions (group commits).",
                                      value=self._committer.groups)


class IngestMetrics:
    """Ingest counters, reachable as ``app.state.metrics``.

    The ingest route calls ``observe`` once per answered batch::

        request.app.state.metrics.observe(result, len(body))
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.batches = Counter("fp8guard_ingest_batches", "Ingest batches by outcome (stored, duplicate, rejected).",
                               ["outcome"], registry=registry)
        self.samples = Counter("fp8guard_ingest_samples", "Tensor-samples stored (one tensor's stats at one step).",
                               registry=registry)
        self.bytes = Counter("fp8guard_ingest_bytes", "Bytes of stored or duplicate ingest bodies, after gunzip.",
                             registry=registry)
        self.database_errors = Counter("fp8guard_database_errors", "Errors raised by the database driver.",
                                       ["kind"], registry=registry)
        for outcome in ("stored", "duplicate", "rejected"):
            self.batches.labels(outcome)  # present as 0 from the start, so rate() and alerts see them
        for kind in ("operational", "integrity", "data", "other"):
            self.database_errors.labels(kind)

    def observe(self, result: _IngestResult, n_bytes: int) -> None:
        """Count one answered batch: ``duplicate`` batches add bytes but no samples."""
        self.batches.labels("duplicate" if result.duplicate else "stored").inc()
        if not result.duplicate:
            self.samples.inc(max(0, int(result.samples)))
        self.bytes.inc(max(0, int(n_bytes)))

    def reject(self) -> None:
        """Count one refused batch (any 4xx/5xx answer from the ingest route)."""
        self.batches.labels("rejected").inc()

    def database_error(self, exc: BaseException) -> None:
        """Count a database error: SQLAlchemy's wrapper, or the driver's own (DB-API) exception
        from the store's driver-level statements; both name their class after the DB-API's."""
        if isinstance(exc, sa.exc.DBAPIError) and exc.orig is not None:
            exc = exc.orig
        names = {cls.__name__ for cls in type(exc).__mro__}
        kind = next((k for name, k in _ERROR_KINDS if name in names), "other")
        self.database_errors.labels(kind).inc()


_ERROR_KINDS = (("OperationalError", "operational"), ("IntegrityError", "integrity"), ("DataError", "data"))


class _HttpMetrics:
    """A pure ASGI middleware (no BaseHTTPMiddleware: it would buffer and re-task every request)."""

    def __init__(self, app: ASGIApp, *, requests: Counter, duration: Histogram, ingest: IngestMetrics) -> None:
        self.app = app
        self.requests = requests
        self.duration = duration
        self.ingest = ingest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the client sees if the app raises before answering
        started = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self._record(scope, status, time.perf_counter() - started)

    def _record(self, scope: Scope, status: int, seconds: float) -> None:
        route = scope.get("route")  # set by the router on a match; a template such as /v1/runs/{run_id}
        template = getattr(route, "path", None) if route is not None else None
        template = template if isinstance(template, str) else _UNMATCHED
        method = str(scope.get("method", "GET"))
        method = method if method in _METHODS else "OTHER"
        self.requests.labels(template, method, str(status)).inc()
        self.duration.labels(template).observe(seconds)
        if template == _INGEST_ROUTE and status >= 400:
            self.ingest.reject()


class RunCollector(Collector):
    """Per-run gauges read from the database at scrape time, for active (``running``) runs only
    (two queries per scrape whatever the number of runs: ``store.records.active_run_metrics``)."""

    def __init__(self, store: _RunMetricsSource, *, max_runs: int = 100) -> None:
        if max_runs < 1:
            raise ValueError(f"max_runs must be at least 1, got {max_runs}")
        self._store = store
        self._max_runs = max_runs

    def describe(self) -> Iterable[Metric]:
        # Declared without touching the database, so registering never queries it.
        return list(self._families([], 0, 0))

    def collect(self) -> Iterable[Metric]:
        try:
            runs, active = self._store.run_metrics(self._max_runs)
        except (sa.exc.SQLAlchemyError, StorageUnavailable):
            log.warning("metrics: reading runs from the database failed", exc_info=True)
            return []  # the handle_error listener has counted it; a scrape still answers
        return list(self._families(runs, active, max(0, active - len(runs))))

    @staticmethod
    def _families(runs: list[RunMetrics], active: int, truncated: int) -> Iterator[Metric]:
        def gauge(name: str, doc: str, pick: Any) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["run"])
            for r in runs:
                value = pick(r)
                if value is not None:
                    g.add_metric([r.run_id], float(value))
            return g

        def counter(name: str, doc: str, pick: Any) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["run"])
            for r in runs:
                c.add_metric([r.run_id], float(pick(r)))
            return c

        yield GaugeMetricFamily("fp8guard_runs_active", "Runs whose status is running.", value=active)
        yield GaugeMetricFamily("fp8guard_runs_truncated",
                                "Active runs left out of the per-run series (over max_runs).", value=truncated)
        yield gauge("fp8guard_run_last_step", "Highest step reported by any rank.", lambda r: r.last_step)
        yield gauge("fp8guard_run_last_loss", "The lead rank's last reported loss (NaN when it was NaN).",
                    lambda r: r.last_loss)
        yield gauge("fp8guard_run_worst_saturation_ratio",
                    "Largest saturation over tensors at the lead rank's latest step (above 1 means clipping).",
                    lambda r: r.worst_saturation)
        yield gauge("fp8guard_run_tensors_saturating", "Tensors whose latest saturation is above 1.",
                    lambda r: r.saturating)
        yield gauge("fp8guard_run_tensors_underflowing", "Tensors with underflows at the lead rank's latest step.",
                    lambda r: r.underflowing)
        yield gauge("fp8guard_run_layers_bf16", "Modules currently running in BF16 (fallen back or pinned).",
                    lambda r: r.layers_bf16)
        yield gauge("fp8guard_run_fp8_loss_gap",
                    "Harm probe's latest (loss_fp8 - loss_bf16) / loss_bf16 on the lead rank: what FP8 costs the loss.",
                    lambda r: r.fp8_loss_gap)
        yield counter("fp8guard_run_findings", "Findings of the detection rules.", lambda r: r.findings)
        yield counter("fp8guard_run_rollbacks", "Rollbacks decided (pending or applied).", lambda r: r.rollbacks)
        actions = CounterMetricFamily("fp8guard_run_actions", "Policy actions by kind, any status.",
                                      labels=["run", "kind"])
        for r in runs:
            for kind in ActionKind:
                actions.add_metric([r.run_id, str(kind)], float(r.actions.get(kind, 0)))
        yield actions


class AlertCollector(Collector):
    """Alert deliveries by sink and outcome (counters kept by the dispatcher) and the outbox backlog."""

    def __init__(self, alerts: _AlertStats) -> None:
        self._alerts = alerts

    def describe(self) -> Iterable[Metric]:
        return list(self._families({}, {}))

    def collect(self) -> Iterable[Metric]:
        stats = self._alerts.stats()
        try:
            backlog = self._alerts.backlog()
        except sa.exc.SQLAlchemyError:
            log.warning("metrics: reading the alert outbox failed", exc_info=True)
            backlog = {}
        return list(self._families(stats, backlog))

    @staticmethod
    def _families(stats: Mapping[str, Mapping[str, int]],
                  backlog: Mapping[str, Mapping[str, int]]) -> Iterator[Metric]:
        deliveries = CounterMetricFamily("fp8guard_alert_deliveries",
                                         "Alert delivery attempts by sink and outcome since the service started.",
                                         labels=["sink", "outcome"])
        for sink, outcomes in sorted(stats.items()):
            for outcome, n in sorted(outcomes.items()):
                deliveries.add_metric([sink, outcome], float(n))
        yield deliveries
        outbox = GaugeMetricFamily("fp8guard_alert_outbox_rows", "Alert outbox rows by sink and status.",
                                   labels=["sink", "status"])
        for sink, statuses in sorted(backlog.items()):
            for status, n in sorted(statuses.items()):
                outbox.add_metric([sink, status], float(n))
        yield outbox


def install_metrics(app: FastAPI, store: _RunMetricsSource, *, max_runs: int = 100,
                    dependencies: Sequence[Any] = ()) -> None:
    """Add ``GET /metrics`` and the request middleware to ``app``.

    ``app.state.metrics`` becomes the ``IngestMetrics`` the ingest route reports to, and
    ``app.state.metrics_registry`` the registry; ``dependencies`` gate the route (a read token). Call it once, before the app starts::

        app = create_app(settings)
        install_metrics(app, app.state.store, max_runs=100)
    """
    if getattr(app.state, "metrics_registry", None) is not None:
        raise ValueError("install_metrics was already called on this app; call it once")
    registry = CollectorRegistry(auto_describe=True)
    ingest = IngestMetrics(registry)
    requests = Counter("fp8guard_http_requests", "HTTP requests by route template, method and status code.",
                       ["route", "method", "code"], registry=registry)
    duration = Histogram("fp8guard_http_request_duration_seconds", "HTTP request latency by route template.",
                         ["route"], buckets=_LATENCY_BUCKETS, registry=registry)
    registry.register(RunCollector(store, max_runs=max_runs))
    alerts = getattr(app.state, "alerts", None)
    if alerts is not None:
        registry.register(AlertCollector(alerts))
    loop = getattr(app.state, "loop", None)
    if loop is not None:
        registry.register(LoopCollector(loop.stats, getattr(app.state, "committer", None)))

    def on_db_error(context: sa.engine.ExceptionContext) -> None:
        ingest.database_error(context.sqlalchemy_exception or context.original_exception)

    sa.event.listen(store.engine, "handle_error", on_db_error)
    store.on_database_error.append(ingest.database_error)
    app.add_middleware(_HttpMetrics, requests=requests, duration=duration, ingest=ingest)
    app.state.metrics = ingest
    app.state.metrics_registry = registry

    @app.get("/metrics", include_in_schema=False, dependencies=list(dependencies))
    def metrics(request: Request) -> Response:
        # A plain route (sync, so the database reads run in the threadpool): no Mount, no 307.
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(registry), media_type=content_type)
