"""Screenshots of the dashboards for docs/dashboards.md, from a real ``fp8guard demo`` run.

    python bench/screenshots.py          # writes docs/screenshots/{runs,run,compare}.png

Runs the demo in-process (its service stays up), adds the web router when the app does not
have it yet, and photographs the pages with headless Debian Chromium (Playwright).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.page_load import CHROMIUM, CHROMIUM_ARGS
from fp8guard.demo import DemoConfig, run_demo
from fp8guard.service.web import web_router

OUT = Path(__file__).resolve().parent.parent / "docs" / "screenshots"
READY = "() => window.fp8guardReady === true || !!window.fp8guardError"


def main() -> None:
    from playwright.sync_api import sync_playwright

    result = run_demo(DemoConfig(progress=False, port=0))
    service = result.__dict__["_service"]
    if not any(getattr(r, "path", None) == "/static/{name}" for r in service.app.routes):
        service.app.include_router(web_router())
    OUT.mkdir(parents=True, exist_ok=True)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            for name, path, full in (("runs", "/", False), ("run", f"/runs/{result.run_id}", True)):
                page.goto(result.url + path)
                page.wait_for_function(READY, timeout=60_000)
                page.wait_for_timeout(1500)
                page.screenshot(path=str(OUT / f"{name}.png"), full_page=full)
            browser.close()
    finally:
        service.close()
    print(f"wrote {OUT}/runs.png, {OUT}/run.png for {result.run_id}")


if __name__ == "__main__":
    main()
