"""Browser tests of the dashboards (Playwright driving Debian's Chromium).

Skipped when Playwright or /usr/bin/chromium is missing, except under CI=true, where that fails.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import batch, post, register

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
XSS_TENSOR = "<img src=x onerror=window.__xss=1>"
XSS_MODULE = "<script>window.__xss=2</script>"
XSS_MODEL = "<b onmouseover=window.__xss=3>model</b>"
READY = "() => window.fp8guardReady === true || !!window.fp8guardError"


def _missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright)"
    if not (Path(CHROMIUM).exists() or shutil.which("chromium")):
        return f"Debian chromium is not installed at {CHROMIUM} (apt-get install -y chromium)"
    return None


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    reason = _missing()
    if reason:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"browser tests cannot run under CI: {reason}")
        pytest.skip(reason)
    import uvicorn

    from fp8guard.service import Settings, create_app
    from fp8guard.service.store import make_engine, upgrade
    from fp8guard.service.web import web_router

    url = f"sqlite:///{tmp_path_factory.mktemp('web') / 'fp8guard.db'}"
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    app = create_app(Settings(database_url=url, auth="off"))
    if not any(getattr(r, "path", None) == "/static/{name}" for r in app.routes):
        app.include_router(web_router(poll_seconds=1.0))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the service did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    try:
        _populate(base)
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _populate(base: str) -> None:
    with httpx.Client(base_url=base, timeout=30) as client:
        register(client, "xss-run", model=XSS_MODEL)
        payload = batch("xss-run", list(range(0, 40)), n_tensors=3)
        payload["tensors"] = [
            {"index": 0, "name": XSS_TENSOR, "module": XSS_MODULE, "role": "fwd_input", "format": "e4m3"},
            {"index": 1, "name": "ok:fwd_weight", "module": XSS_MODULE, "role": "fwd_weight", "format": "e4m3"},
            {"index": 2, "name": "<a href=javascript:window.__xss=4>x</a>", "module": "m2"},
        ]
        r = post(client, payload)
        assert r.status_code == 200, r.text
        register(client, "baseline")
        r = post(client, batch("baseline", list(range(0, 40)), losses=[3.0 - 0.01 * s for s in range(40)]))
        assert r.status_code == 200, r.text
        # a rollback: segment 0 runs to step 59, the run resumes from step 30 in segment 1
        register(client, "rolled")
        r = post(client, batch("rolled", list(range(0, 60)), batch_id="rolled-seg0",
                               events=[{"kind": "rollback_applied", "step": 59,
                                        "data": {"checkpoint_step": 30}}]))
        assert r.status_code == 200, r.text
        r = post(client, batch("rolled", list(range(31, 80)), segment=1, define_tensors=False, batch_id="rolled-seg1",
                               losses=[2.0 + 0.05 * i for i in range(49)]))
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def browser(base_url: str) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any, base_url: str) -> Iterator[Any]:
    """A page that may only talk to the service: any other request is aborted and recorded."""
    context = browser.new_context(viewport={"width": 1300, "height": 900})
    page = context.new_page()
    page.errors = []
    page.external = []
    page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: page.errors.append(str(e)))

    def guard(route: Any) -> None:
        if route.request.url.startswith(base_url + "/"):
            route.continue_()
        else:
            page.external.append(route.request.url)
            route.abort()

    page.route("**/*", guard)
    yield page
    context.close()


def _open(page: Any, url: str) -> None:
    page.goto(url)
    page.wait_for_function(READY, timeout=30_000)
    assert page.evaluate("() => window.fp8guardError || null") is None
    page.wait_for_timeout(300)


def _plot_points(page: Any, div: str) -> int:
    return int(page.evaluate(
        "(id) => { const d = document.getElementById(id); if (!d || !d.data) return -1;"
        " return d.data.reduce((n, t) => n + (t.z ? t.z.length * t.z[0].length : (t.y ? t.y.length : 0)), 0); }", div))


def _clean(page: Any) -> None:
    assert page.errors == [], page.errors
    assert page.external == [], page.external
    assert page.evaluate("() => typeof window.__xss") == "undefined"


def test_runs_page(page: Any, base_url: str) -> None:
    _open(page, base_url + "/")
    ids = page.locator("#runs tbody tr").evaluate_all("rows => rows.map(r => r.dataset.runId)")
    assert set(ids) == {"xss-run", "baseline", "rolled"}
    row = page.locator("tr[data-run-id='xss-run']")
    assert XSS_MODEL in row.inner_text()  # shown as text
    assert page.locator("tr[data-run-id='xss-run'] b").count() == 0  # never parsed as HTML
    page.fill("#filter", "rolled")
    visible = page.locator("#runs tbody tr:visible").evaluate_all("rows => rows.map(r => r.dataset.runId)")
    assert visible == ["rolled"]
    _clean(page)


def test_run_page_plots_and_escaping(page: Any, base_url: str) -> None:
    _open(page, base_url + "/runs/xss-run")
    page.wait_for_function("() => document.getElementById('scale').data !== undefined", timeout=10_000)
    assert _plot_points(page, "hm-amax") == 3 * 40
    assert _plot_points(page, "hm-saturation") == 3 * 40
    assert _plot_points(page, "loss") >= 40
    assert _plot_points(page, "grad") >= 40
    assert _plot_points(page, "scale") >= 40
    options = page.locator("#tensor-pick option").all_inner_texts()
    assert any(XSS_TENSOR in o for o in options)
    assert XSS_MODEL in page.locator("#title").inner_text()
    # names reach plotly escaped: the heatmap's y labels hold the literal text
    labels = page.evaluate("() => Array.from(document.querySelectorAll('#hm-amax .ytick text')).map(t => t.textContent)")
    assert XSS_TENSOR in labels
    assert page.locator("#hm-amax img, #hm-amax a[href^='javascript']").count() == 0
    _clean(page)


def test_run_page_rollback_and_live_update(page: Any, base_url: str) -> None:
    _open(page, base_url + "/runs/rolled")
    names = page.evaluate("() => document.getElementById('loss').data.map(t => t.name)")
    assert "abandoned, segment 0" in names
    abandoned = page.evaluate("() => document.getElementById('loss').data.find(t => t.name === 'abandoned, segment 0').x")
    assert min(abandoned) >= 30 and max(abandoned) == 59
    assert "rollback_applied" in page.locator("#timeline").inner_text()
    # live: new steps arrive, the page redraws without a reload
    page.evaluate("() => { window.__marker = 1; }")
    with httpx.Client(base_url=base_url, timeout=30) as client:
        r = post(client, batch("rolled", list(range(80, 120)), segment=1, define_tensors=False, batch_id="rolled-more"))
        assert r.status_code == 200, r.text
    page.wait_for_function("() => Math.max(...document.getElementById('loss').data.find(t => t.name === 'loss').x) >= 119",
                           timeout=15_000)
    assert page.evaluate("() => window.__marker") == 1
    _clean(page)


def test_compare_page(page: Any, base_url: str) -> None:
    _open(page, base_url + "/compare?run=rolled&baseline=baseline")
    verdict = page.locator("#verdict").inner_text()
    assert verdict.startswith("diverging from step") or verdict.startswith("within noise"), verdict
    assert _plot_points(page, "diff") > 0
    _open(page, base_url + "/compare?run=baseline&baseline=baseline")
    assert page.locator("#verdict").inner_text().startswith("within noise")
    _clean(page)


def test_static_and_errors(base_url: str) -> None:
    r = httpx.get(base_url + "/static/plotly.min.js", headers={"accept-encoding": "gzip"})
    assert r.status_code == 200 and "max-age=31536000" in r.headers["cache-control"]
    assert r.headers["content-encoding"] == "gzip" and len(r.content) > 1_000_000
    assert httpx.get(base_url + "/static/..%2Fweb.py").status_code == 404
    assert httpx.get(base_url + "/static/nope.js").status_code == 404
    assert httpx.get(base_url + "/runs/no-such-run").status_code == 404
    csp = httpx.get(base_url + "/").headers["content-security-policy"]
    assert "script-src 'self'" in csp
