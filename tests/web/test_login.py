"""The dashboards behind authentication, in Debian's Chromium: an anonymous browser is sent to the
login page, a read token opens an HttpOnly session, and the run page shows the guard's audit trail."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.helpers import app_in_thread, batch, post
from tests.web.test_pages import ARGS, CHROMIUM, READY, require_browser


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    require_browser()
    from fp8guard.service import Settings, create_app
    from fp8guard.service.auth.tokens import issue_token
    from fp8guard.service.kinds import Role
    from fp8guard.service.store import make_engine, upgrade

    url = f"sqlite:///{tmp_path_factory.mktemp('login') / 'fp8guard.db'}"
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    app = create_app(Settings(database_url=url, auth="required"))
    tokens = {role.value: issue_token(app.state.store, name=f"web-{role}", role=role)[0] for role in Role}
    with app_in_thread(app) as base:
        agent = {"authorization": f"Bearer {tokens['ingest']}"}
        with httpx.Client(base_url=base, timeout=30, headers=agent) as client:
            assert client.put("/v1/runs/audited", json={"guard": {"skip_batches": 300}}).status_code == 201
            assert post(client, batch("audited", list(range(20)))).status_code == 200
            r = client.put("/v1/runs/audited/guard", json={"skip_batches": 50, "dry_run": True},
                           headers={"authorization": f"Bearer {tokens['admin']}"})
            assert r.status_code == 200, r.text
        yield base, tokens


@pytest.mark.slow
def test_login_opens_an_httponly_session_and_shows_the_audit(secured: tuple[str, dict[str, str]]) -> None:
    from playwright.sync_api import sync_playwright

    base, tokens = secured
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            context = browser.new_context()
            page: Any = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{base}/runs/audited")
            assert page.url.startswith(f"{base}/login?next="), page.url
            page.fill("#token", "fp8g_wrong")
            page.click("button[type=submit]")
            assert "Unknown or revoked token" in page.text_content("#error")
            page.fill("#token", tokens["read"])
            page.click("button[type=submit]")
            page.wait_for_url(f"{base}/runs/audited")
            page.wait_for_function(READY, timeout=30_000)
            assert page.evaluate("window.fp8guardError || null") is None
            assert "fp8guard_session" not in page.evaluate("document.cookie")  # HttpOnly: scripts never see it
            cookie = next(c for c in context.cookies() if c["name"] == "fp8guard_session")
            assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
            page.wait_for_selector("#timeline td:has-text('guard changed by web-admin')")
            audit = page.text_content("#timeline tbody")
            assert "guard changed by web-ingest" in audit
            assert "skip_batches: 300 -> 50" in audit and "dry_run: default -> true" in audit
            assert not errors, errors
        finally:
            browser.close()
