"""Run-page load time in a real browser on a large run: 1,000 tensors x 100,000 steps.

    python bench/page_load.py            # prints one JSON line

Builds the run with ``bench/query.py``'s ``populate`` (SQLite), starts the service, opens
``/runs/big`` in headless Debian Chromium (Playwright) and measures the time from navigation
start until the page sets ``window.fp8guardReady`` (heatmaps rendered): a cold load (empty
browser cache) and warm reloads (plotly.min.js cached, as for a returning user).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._serve import free_port, serve
from bench.query import populate
from fp8guard.service.store import Store, make_engine, upgrade

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def make_app() -> FastAPI:
    """``create_app()`` (settings from ``FP8GUARD_*`` variables) plus the dashboards."""
    from fp8guard.service import create_app
    from fp8guard.service.web import web_router

    app = create_app()
    if not any(getattr(r, "path", None) == "/static/{name}" for r in app.routes):
        app.include_router(web_router())
    return app


@contextlib.contextmanager
def serve_web(database_url: str, *, timeout: float = 60.0) -> Iterator[str]:
    with serve(database_url, timeout=timeout) as base:
        wired = httpx.get(f"{base}/static/style.css", timeout=5.0).status_code == 200
        if wired:
            yield base
            return
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FP8GUARD_DATABASE_URL": database_url,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = tempfile.TemporaryFile()  # noqa: SIM115 - a file, not a pipe: a full pipe would block the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "bench.page_load:make_app", "--factory", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"uvicorn exited: {log.read().decode(errors='replace')[-2000:]}")
            try:
                if httpx.get(f"{base}/healthz", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the dashboard service did not become healthy in time")
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


READY = "() => window.fp8guardReady === true || !!window.fp8guardError"


def _load(page: Any, url: str) -> dict[str, Any]:
    t = time.perf_counter()
    page.goto(url)
    page.wait_for_function(READY, timeout=60_000)
    wall = (time.perf_counter() - t) * 1e3
    error = page.evaluate("() => window.fp8guardError || null")
    if error:
        raise RuntimeError(f"the page failed: {error}")
    ready = page.evaluate("() => window.fp8guardReadyAt")
    cells = page.evaluate("() => { const d = document.getElementById('hm-amax').data[0];"
                          " return [d.z.length, d.z[0].length]; }")
    return {"ready_ms": float(ready), "wall_ms": wall, "heatmap_rows": cells[0], "heatmap_columns": cells[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5, help="warm reloads")
    parser.add_argument("--viewport", type=int, default=1400, help="browser width in CSS pixels")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/big.db"
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        store = Store.open(url)
        populate_s = populate(store, "big", args.steps, args.tensors)
        store.close()
        with serve_web(url) as base, sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            errors: list[str] = []
            context = browser.new_context(viewport={"width": args.viewport, "height": 1000})
            page = context.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            # warm the service's one-time work (plotly gzip, SQLite page cache) from another client
            warm = browser.new_context().new_page()
            warm.goto(f"{base}/static/plotly.min.js")
            cold = _load(page, f"{base}/runs/big")
            warm_runs = [_load(page, f"{base}/runs/big") for _ in range(args.repeat)]
            browser.close()
    result = {
        "steps": args.steps, "tensors": args.tensors, "viewport": args.viewport, "populate_s": round(populate_s, 1),
        "cold_ready_ms": round(cold["ready_ms"]), "warm_ready_ms_median": round(statistics.median(
            r["ready_ms"] for r in warm_runs)), "warm_ready_ms_max": round(max(r["ready_ms"] for r in warm_runs)),
        "heatmap_cells": [cold["heatmap_rows"], cold["heatmap_columns"]], "console_errors": errors,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
