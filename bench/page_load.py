"""Run-page load time in a real browser on a large run: 1,000 tensors x 100,000 steps.

    python bench/page_load.py            # prints one JSON line

Builds the run with ``bench/query.py``'s ``populate`` (SQLite), starts the service, opens
``/runs/big`` in headless Debian Chromium (Playwright) and measures the time from navigation
start until the page sets ``window.fp8guardReady`` (heatmaps rendered): a cold load (empty
browser cache) and warm reloads (plotly.min.js cached, as for a returning user).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._serve import serve
from bench.query import populate
from fp8guard.service.store import Store, make_engine, upgrade

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


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
        with serve(url) as base, sync_playwright() as pw:
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
