"""``POST /v1/ingest`` answered by ``IngestFastPath`` reads exactly as when FastAPI's router
answers it: the same status codes, error bodies, headers and metrics, request by request, for
every outcome the route has (stored, duplicate, 401, 403, 404, 409, 413, 400, 422, 405)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from fp8guard import wire
from fp8guard.service import Settings, create_app
from fp8guard.service.auth.tokens import digest, hint, new_token
from fp8guard.service.ingest.fast_path import IngestFastPath
from fp8guard.service.kinds import Role
from fp8guard.service.store import make_engine, upgrade
from tests.helpers import batch

_HEADERS = ("content-type", "retry-after", "www-authenticate", "allow")
_MAX_BODY = 64 * 1024


def _app(url: str, *, fast: bool) -> Any:
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    app = create_app(Settings(database_url=url, auth="required", max_body_bytes=_MAX_BODY))
    if not fast:  # the middleware stack is built on the first request: take the fast path out before it
        app.user_middleware = [m for m in app.user_middleware if m.cls is not IngestFastPath]
    return app


@pytest.fixture
def clients(tmp_path: Any) -> Iterator[tuple[TestClient, TestClient, dict[str, str]]]:
    fast, routed = _app(f"sqlite:///{tmp_path / 'fast.db'}", fast=True), _app(f"sqlite:///{tmp_path / 'routed.db'}",
                                                                               fast=False)
    tokens: dict[str, str] = {}
    for name, role, prefix in (("agent", Role.INGEST, "fp-"), ("other", Role.INGEST, "zz-"),
                               ("admin", Role.ADMIN, None)):
        tokens[name] = secret = new_token()
        for app in (fast, routed):  # the same secret in both databases
            app.state.store.create_token(name=name, role=role, run_prefix=prefix, secret_hash=digest(secret),
                                         hint=hint(secret))
    with TestClient(fast) as a, TestClient(routed) as b:
        yield a, b, tokens


def _requests(tokens: dict[str, str]) -> list[tuple[str, str, bytes, dict[str, str]]]:
    def auth(name: str) -> dict[str, str]:
        return {"authorization": f"Bearer {tokens[name]}", "content-type": "application/json"}

    good = wire.dumps(batch("fp-run", [0, 1]))
    nxt = batch("fp-run", [2, 3], define_tensors=False)
    conflict = batch("fp-run", [4, 5])
    conflict["tensors"][0]["name"] = "renamed"
    wrong_version = batch("fp-run", [6])
    wrong_version["protocol"] = 2
    undefined = batch("fp-run", [7], n_tensors=9, define_tensors=False)
    return [
        ("POST", "/v1/ingest", good, auth("agent")),  # 200, stored
        ("POST", "/v1/ingest", good, auth("agent")),  # 200, duplicate
        ("POST", "/v1/ingest", wire.gzip_body(wire.dumps(nxt)), {**auth("agent"), "content-encoding": "gzip"}),
        ("POST", "/v1/ingest", good, {"content-type": "application/json"}),  # 401, no token
        ("POST", "/v1/ingest", good, {**auth("agent"), "authorization": "Basic abc"}),  # 401
        ("POST", "/v1/ingest", good, {**auth("agent"), "authorization": "Bearer fp8g_unknown"}),  # 401
        ("POST", "/v1/ingest", good, auth("other")),  # 403: another token's run
        ("POST", "/v1/ingest", wire.dumps(batch("fp-nobody", [0])), auth("admin")),  # 404
        ("POST", "/v1/ingest", wire.dumps(conflict), auth("agent")),  # 409
        ("POST", "/v1/ingest", b"{not json", auth("agent")),  # 422
        ("POST", "/v1/ingest", b"\xff\xfe\x00", auth("agent")),  # 422, not even text
        ("POST", "/v1/ingest", wire.dumps(wrong_version), auth("agent")),  # 422, names the field
        ("POST", "/v1/ingest", wire.dumps(undefined), auth("agent")),  # 422, n_tensors
        ("POST", "/v1/ingest", b"x" * (_MAX_BODY + 1), auth("agent")),  # 413
        ("POST", "/v1/ingest", gzip.compress(b" " * (_MAX_BODY * 4)), {**auth("agent"), "content-encoding": "gzip"}),
        ("POST", "/v1/ingest", b"not gzip", {**auth("agent"), "content-encoding": "gzip"}),  # 400
        ("POST", "/v1/ingest", good, {**auth("agent"), "content-encoding": "br"}),  # 400
        ("GET", "/v1/ingest", b"", auth("agent")),  # 405: not the fast path's
        ("POST", "/v1/ingest/", good, auth("agent")),  # the router's answer to a trailing slash
    ]


def _answer(r: Any) -> tuple[int, Any, dict[str, str]]:
    try:
        body: Any = r.json()
    except json.JSONDecodeError:
        body = r.text
    return r.status_code, body, {h: r.headers[h] for h in _HEADERS if h in r.headers}


def _http_metrics(client: TestClient, admin: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = client.get("/metrics", headers={"authorization": f"Bearer {admin}"}).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if (s.name.startswith(("fp8guard_http_requests", "fp8guard_ingest_")) and not s.name.endswith("_created"))
            or s.name == "fp8guard_http_request_duration_seconds_count"}


def test_fast_path_sits_inside_the_metrics_middleware(clients: Any) -> None:
    fast, routed, _ = clients
    names = [m.cls.__name__ for m in fast.app.user_middleware]
    assert names == ["_HttpMetrics", "IngestFastPath"]
    assert [m.cls.__name__ for m in routed.app.user_middleware] == ["_HttpMetrics"]


def test_fast_path_answers_exactly_as_the_router(clients: Any) -> None:
    fast, routed, tokens = clients
    for k, (method, path, body, headers) in enumerate(_requests(tokens)):
        for c in (fast, routed):
            c.put("/v1/runs/fp-run", json={"model": "m"}, headers={"authorization": f"Bearer {tokens['agent']}"})
        got = [_answer(c.request(method, path, content=body or None, headers=headers, follow_redirects=False))
               for c in (fast, routed)]
        assert got[0] == got[1], f"request {k} ({method} {path}): fast path {got[0]} != router {got[1]}"
    metrics = [_http_metrics(c, tokens["admin"]) for c in (fast, routed)]
    assert metrics[0] == metrics[1]
    codes = {dict(labels)["code"] for name, labels in metrics[0] if name == "fp8guard_http_requests_total"
             and dict(labels)["route"] == "/v1/ingest"}
    assert codes >= {"200", "400", "401", "403", "404", "405", "409", "413", "422"}
    assert metrics[0][("fp8guard_ingest_batches_total", (("outcome", "rejected"),))] >= 14
