"""Authentication and roles, against the real app on SQLite and PostgreSQL.

The route table below is checked against the app's own routes: a route that nobody classified
fails ``test_every_route_is_gated``, so a new endpoint cannot ship open by accident."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.routing import Route

from fp8guard import wire
from fp8guard.service import Settings, create_app
from fp8guard.service.auth import SESSION_COOKIE
from fp8guard.service.auth.tokens import issue_token
from fp8guard.service.kinds import Role
from tests.helpers import batch

PUBLIC = {("GET", "/healthz"), ("GET", "/login"), ("POST", "/login"), ("POST", "/logout"), ("GET", "/static/{name}")}
"""Routes anyone may call."""

R, W, A = Role.READ, Role.INGEST, Role.ADMIN
ACCESS: dict[tuple[str, str], set[Role]] = {
    ("PUT", "/v1/runs/{run_id}"): {W, A},
    ("POST", "/v1/ingest"): {W, A},
    ("PUT", "/v1/runs/{run_id}/guard"): {A},
    ("GET", "/v1/runs/{run_id}/commands"): {R, W, A},  # ingest: its own runs (the agent's long-poll)
    ("GET", "/v1/tokens"): {A},
    ("POST", "/v1/tokens"): {A},
    ("DELETE", "/v1/tokens/{name}"): {A},
}
"""Who may call what, beyond the rule that every other GET needs read (admin may do anything)."""

PAGES = {"/", "/runs/{run_id}", "/compare", "/docs"}
"""HTML: an anonymous browser is sent to the login page instead of a 401."""


def _routes(app: Any) -> list[tuple[str, str]]:
    """Every (method, path) the app serves, included routers flattened."""
    try:  # FastAPI >= 0.165 keeps included routers as lazy nodes in app.routes
        from fastapi.routing import _iter_routes_with_context

        pairs: Iterator[tuple[Any, Any]] = _iter_routes_with_context(app.routes)
    except ImportError:
        pairs = ((r, None) for r in app.routes)
    out = []
    for route, context in pairs:
        source = context or route
        if isinstance(route, APIRoute | Route):
            out += [(m, source.path) for m in sorted(source.methods or ()) if m not in ("HEAD", "OPTIONS")]
    return out


def _allowed(method: str, path: str) -> set[Role]:
    if (method, path) in ACCESS:
        return ACCESS[(method, path)]
    assert method == "GET", f"unclassified write route {method} {path}: add it to ACCESS"
    return {R, A}


@pytest.fixture
def app_and_tokens(migrated_url: str) -> Iterator[tuple[TestClient, dict[str, str]]]:
    app = create_app(Settings(database_url=migrated_url, auth="required"))
    tokens = {
        "read": issue_token(app.state.store, name="reader", role=Role.READ)[0],
        "ingest": issue_token(app.state.store, name="agent-a", role=Role.INGEST)[0],
        "other": issue_token(app.state.store, name="agent-b", role=Role.INGEST)[0],
        "team": issue_token(app.state.store, name="team-agent", role=Role.INGEST, run_prefix="team-")[0],
        "admin": issue_token(app.state.store, name="alice", role=Role.ADMIN)[0],
    }
    with TestClient(app, follow_redirects=False) as client:
        yield client, tokens


def _h(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def _call(client: TestClient, method: str, path: str, headers: dict[str, str]) -> int:
    url = re.sub(r"\{run_id\}", "owned", path)
    url = url.replace("{index}", "0").replace("{name}", "nobody")
    body: dict[str, Any] | None = None
    if path == "/v1/ingest":
        return client.post(url, content=wire.dumps(batch("owned", [1])),
                           headers={**headers, "content-type": "application/json"}).status_code
    if method in ("PUT", "POST"):
        body = {"name": "new-token", "role": "read"} if path == "/v1/tokens" else {}
    return client.request(method, url, json=body, headers=headers).status_code


def test_every_route_is_gated(app_and_tokens: tuple[TestClient, dict[str, str]]) -> None:
    client, tokens = app_and_tokens
    assert client.put("/v1/runs/owned", json={}, headers=_h(tokens["ingest"])).status_code == 201
    routes = _routes(client.app)
    assert ("GET", "/metrics") in routes and ("GET", "/openapi.json") in routes and ("GET", "/docs") in routes
    who = {Role.READ: tokens["read"], Role.INGEST: tokens["ingest"], Role.ADMIN: tokens["admin"]}
    for method, path in routes:
        if (method, path) in PUBLIC:
            continue
        anonymous = _call(client, method, path, {})
        if path in PAGES:
            assert anonymous == 303, (method, path, anonymous)
        else:
            assert anonymous == 401, (method, path, anonymous)
        assert _call(client, method, path, _h("fp8g_not-a-token")) == 401, (method, path)
        for role, token in who.items():
            status = _call(client, method, path, _h(token))
            if role in _allowed(method, path):
                assert status not in (401, 403), (role, method, path, status)
            else:
                assert status == 403, (role, method, path, status)


def test_public_routes_answer_without_a_token(app_and_tokens: tuple[TestClient, dict[str, str]]) -> None:
    client, _ = app_and_tokens
    assert client.get("/healthz").status_code == 200
    assert client.get("/login").status_code == 200
    assert client.get("/static/style.css").status_code == 200
    assert client.get("/v1/runs").headers["www-authenticate"] == "Bearer"


def test_ingest_tokens_write_only_their_runs(app_and_tokens: tuple[TestClient, dict[str, str]]) -> None:
    client, tokens = app_and_tokens
    mine, other, team = _h(tokens["ingest"]), _h(tokens["other"]), _h(tokens["team"])
    assert client.put("/v1/runs/victim", json={}, headers=mine).status_code == 201
    # Another ingest token can neither resume, ingest into, acknowledge for, nor finish the run.
    assert client.put("/v1/runs/victim", json={}, headers=other).status_code == 403
    forged = [batch("victim", [5], events=[{"kind": "command_acknowledged", "step": 5,
                                             "data": {"command_id": 1, "status": "ignored"}}]),
              batch("victim", [6], events=[{"kind": "run_finished", "step": 6}])]
    for payload in forged:
        r = client.post("/v1/ingest", content=wire.dumps(payload), headers={**other, "content-type": "application/json"})
        assert r.status_code == 403, r.text
    assert client.get("/v1/runs/victim/commands", headers=other).status_code == 403
    assert client.get("/v1/runs/victim/commands", headers=mine).status_code == 200
    r = client.post("/v1/ingest", content=wire.dumps(batch("victim", [5])), headers={**mine, "content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert client.get("/v1/runs/victim", headers=_h(tokens["read"])).json()["status"] == "running"
    # A prefix-scoped token writes any run under its prefix, whoever registered it, and nothing else.
    assert client.put("/v1/runs/team-a", json={}, headers=team).status_code == 201
    assert client.put("/v1/runs/team-a", json={}, headers=mine).status_code == 403
    assert client.put("/v1/runs/teammate", json={}, headers=team).status_code == 403
    assert client.put("/v1/runs/victim", json={}, headers=team).status_code == 403


def test_guard_changes_need_an_admin_and_are_audited(app_and_tokens: tuple[TestClient, dict[str, str]]) -> None:
    client, tokens = app_and_tokens
    agent, admin, reader = _h(tokens["ingest"]), _h(tokens["admin"]), _h(tokens["read"])
    assert client.put("/v1/runs/g", json={"guard": {"skip_batches": 300}}, headers=agent).status_code == 201
    assert client.put("/v1/runs/g", json={"guard": {"skip_batches": 300}}, headers=agent).status_code == 200
    assert client.put("/v1/runs/g", json={}, headers=agent).status_code == 200  # a resume keeps the guard
    # The attack of issue 15: a huge skip at LR x1e-30 and dry-run, through the agent's own token.
    attack = {"skip_batches": 1_000_000_000, "rollback_lr_scale": 1e-30, "dry_run": True}
    r = client.put("/v1/runs/g", json={"guard": attack}, headers=agent)
    assert r.status_code == 403 and "admin" in r.text
    assert client.put("/v1/runs/g/guard", json={"dry_run": True}, headers=agent).status_code == 403
    assert client.get("/v1/runs/g/guard", headers=reader).json()["skip_batches"] == 300
    r = client.put("/v1/runs/g/guard", json={"skip_batches": 100, "dry_run": True}, headers=admin)
    assert r.status_code == 200 and r.json()["skip_batches"] == 100 and r.json()["dry_run"] is True
    events = [e for e in client.get("/v1/runs/g/events", headers=reader).json() if e["kind"] == "guard_changed"]
    assert [(e["data"]["by"], e["data"]["old"], e["data"]["new"]) for e in events] == [
        ("agent-a", None, {"skip_batches": 300}),
        ("alice", {"skip_batches": 300}, {"skip_batches": 100, "dry_run": True}),
    ]
    # Agents cannot forge the audit trail: the kind is not one ingest accepts.
    forged = batch("g", [1], events=[{"kind": "guard_changed", "step": 1, "data": {"by": "alice"}}])
    r = client.post("/v1/ingest", content=wire.dumps(forged), headers={**agent, "content-type": "application/json"})
    assert r.status_code == 422


def test_revoked_tokens_stop_at_once_in_this_process(app_and_tokens: tuple[TestClient, dict[str, str]]) -> None:
    client, tokens = app_and_tokens
    admin = _h(tokens["admin"])
    assert client.get("/v1/runs", headers=_h(tokens["read"])).status_code == 200
    created = client.post("/v1/tokens", json={"name": "ci", "role": "ingest", "run_prefix": "ci-"}, headers=admin)
    assert created.status_code == 201 and created.json()["token"].startswith("fp8g_")
    listed = client.get("/v1/tokens", headers=admin).json()
    assert "ci" in {t["name"] for t in listed} and all("token" not in t for t in listed)
    assert client.post("/v1/tokens", json={"name": "ci", "role": "read"}, headers=admin).status_code == 409
    assert client.delete("/v1/tokens/reader", headers=admin).status_code == 200
    assert client.get("/v1/runs", headers=_h(tokens["read"])).status_code == 401
    assert client.delete("/v1/tokens/reader", headers=admin).status_code == 404
    names = {t["name"] for t in client.get("/v1/tokens", params={"revoked": True}, headers=admin).json()}
    assert "reader" in names


def test_browser_login_session_and_logout(app_and_tokens: tuple[TestClient, dict[str, str]]) -> None:
    client, tokens = app_and_tokens
    r = client.get("/runs/x?tab=1")
    assert r.status_code == 303 and r.headers["location"] == "/login?next=%2Fruns%2Fx%3Ftab%3D1"
    form = {"content-type": "application/x-www-form-urlencoded"}
    r = client.post("/login", content="token=fp8g_wrong&next=/", headers=form)
    assert r.status_code == 401 and "Unknown or revoked token" in r.text
    r = client.post("/login", content=f"token={tokens['ingest']}&next=/", headers=form)
    assert r.status_code == 403 and "cannot read dashboards" in r.text
    r = client.post("/login", content=f"token={tokens['read']}&next=https://evil.example/", headers=form)
    assert r.status_code == 303 and r.headers["location"] == "/"  # never an open redirect
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Max-Age=" in cookie
    assert tokens["read"] not in cookie  # the cookie is a session, not the token
    assert client.get("/").status_code == 200
    assert client.get("/v1/runs").status_code == 200
    assert client.get("/metrics").status_code == 200
    assert client.get("/v1/tokens").status_code == 403  # the session has the token's role, no more
    r = client.post("/logout")
    assert r.status_code == 303 and SESSION_COOKIE in r.headers["set-cookie"]
    assert client.get("/v1/runs").status_code == 401


def test_sessions_end_with_their_token(app_and_tokens: tuple[TestClient, dict[str, str]]) -> None:
    client, tokens = app_and_tokens
    r = client.post("/login", content=f"token={tokens['read']}", headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 303
    assert client.get("/v1/runs").status_code == 200
    assert client.delete("/v1/tokens/reader", headers=_h(tokens["admin"])).status_code == 200
    client.app.state.auth.forget()  # type: ignore[attr-defined]
    assert client.get("/v1/runs").status_code == 401


def test_trusted_proxy_header_is_opt_in(migrated_url: str) -> None:
    for header, expected in ((None, 401), ("X-Forwarded-Email", 200)):
        app = create_app(Settings(database_url=migrated_url, auth="required", trusted_auth_header=header))
        with TestClient(app, follow_redirects=False) as client:
            sso = {"X-Forwarded-Email": "ana@example.com"}
            assert client.get("/v1/runs", headers=sso).status_code == expected
            assert client.get("/", headers=sso).status_code == (303 if header is None else 200)
            if header:  # the proxy's user reads; writing still needs a token
                assert client.put("/v1/runs/x", json={}, headers=sso).status_code == 403


def test_openapi_documents_the_credentials(app_and_tokens: tuple[TestClient, dict[str, str]]) -> None:
    client, tokens = app_and_tokens
    schema = client.get("/openapi.json", headers=_h(tokens["read"])).json()
    assert {"HTTPBearer", "APIKeyCookie"} <= set(schema["components"]["securitySchemes"])
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            if (method.upper(), path) in PUBLIC:
                continue
            assert {"401", "403"} <= set(op["responses"]), (method, path)
