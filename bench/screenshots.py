"""Screenshots of the dashboards for the README and docs/dashboards.md, from a real ``fp8guard demo`` run.

    pip install -e '.[dev]'              # needs the dev extra: torch (the demo trains), the service
                                         # and playwright, plus Debian's chromium at /usr/bin/chromium
    python bench/screenshots.py          # writes docs/screenshots/{runs,run,run-story,run-gap}.png

Runs the demo in-process (its service stays up), adds the web router when the app does not
have it yet, and photographs the pages with headless Debian Chromium (Playwright): the runs
list, the whole run page, the top of the run page (the incident summary and the loss), and the
run page's FP8 loss gap chart (the harm probe; it says how to turn the probe on when the run has none).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

OUT = Path(__file__).resolve().parent.parent / "docs" / "screenshots"
READY = "() => window.fp8guardReady === true || !!window.fp8guardError"
NEEDS = "bench/screenshots.py needs the dev extra (pip install -e '.[dev]': torch, the service, playwright)"


def main() -> None:
    try:
        from playwright.sync_api import sync_playwright

        from bench.page_load import CHROMIUM, CHROMIUM_ARGS
        from fp8guard.demo import DemoConfig, run_demo
        from fp8guard.service.web import web_router
    except ImportError as exc:
        raise SystemExit(f"{NEEDS}; missing: {exc.name}") from None
    if not Path(CHROMIUM).exists():
        raise SystemExit(f"bench/screenshots.py needs Debian's chromium at {CHROMIUM} (apt-get install -y chromium)")

    result = run_demo(DemoConfig(progress=False, port=0))
    service = result.__dict__["_service"]
    if not any(getattr(r, "path", None) == "/static/{name}" for r in service.app.routes):
        service.app.include_router(web_router())
    OUT.mkdir(parents=True, exist_ok=True)
    shots = (("runs", "/", False), ("run", f"/runs/{result.run_id}", True), ("run-story", f"/runs/{result.run_id}", False))
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            for name, path, full in shots:
                page.goto(result.url + path)
                page.wait_for_function(READY, timeout=60_000)
                error = page.evaluate("() => window.fp8guardError || null")
                if error:
                    raise SystemExit(f"{path}: the page failed to draw: {error}")
                page.wait_for_timeout(2000)  # the plots after the heatmaps
                page.screenshot(path=str(OUT / f"{name}.png"), full_page=full)
            page.locator("#gap").screenshot(path=str(OUT / "run-gap.png"))  # the run page is still open
            browser.close()
    finally:
        service.close()
    print(f"wrote {', '.join(str(OUT / f'{name}.png') for name in [*(s[0] for s in shots), 'run-gap'])} for {result.run_id}")


if __name__ == "__main__":
    main()
