"""Browser tests of the dashboards (Playwright driving Debian's Chromium).

Skipped when Playwright or /usr/bin/chromium is missing, except under CI=true, where that fails.
"""

from __future__ import annotations

import html
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from fp8guard import wire
from tests.helpers import app_in_thread, batch, post, register, tensor_defs

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
XSS_TENSOR = "<img src=x onerror=window.__xss=1>"
XSS_MODULE = "<script>window.__xss=2</script>"
XSS_MODEL = "<b onmouseover=window.__xss=3>model</b>"
READY = "() => window.fp8guardReady === true || !!window.fp8guardError"


def require_browser() -> None:
    """Skip without Playwright or Debian's Chromium, except under CI=true, where that fails."""
    reason = _missing()
    if reason:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"browser tests cannot run under CI: {reason}")
        pytest.skip(reason)


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
    require_browser()
    from fp8guard.service import Settings, create_app
    from fp8guard.service.store import make_engine, upgrade

    url = f"sqlite:///{tmp_path_factory.mktemp('web') / 'fp8guard.db'}"
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    with app_in_thread(create_app(Settings(database_url=url, auth="off"))) as base:
        _populate(base)
        yield base


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
        _populate_story(client)
        _populate_probed(client)


STORY_STATS = ("amax", "scale", "saturation")
COUNTS = ("overflows", "underflows")
COUNT_EVERY = 5
BF16 = (71, 85)
"""blocks.1.fc (tensors 3-5) runs in BF16 over steps [71, 85): fallback applied at 70, promotion at 84."""
ZERO = (75, 80)
"""blocks.0.fc:fwd_input (tensor 0), in FP8, has a true amax of 0 over these steps."""


def _story_batch(steps: list[int], segment: int, losses: list[float], events: list[dict[str, Any]],
                 define: bool, rng: np.random.Generator) -> dict[str, Any]:
    n = 6
    vals = (1.0 + rng.random((len(steps), len(STORY_STATS), n))).astype("<f4")
    for i, s in enumerate(steps):
        if BF16[0] <= s < BF16[1]:
            vals[i, :, 3:] = 0.0  # what a module in BF16 reports: amax 0, no FP8 statistic
        if ZERO[0] <= s < ZERO[1]:
            vals[i, 0, 0] = 0.0
    counted = [s for s in steps if s % COUNT_EVERY == 0]
    counts = rng.integers(0, 20, (len(counted), len(COUNTS), n)).astype("<f4")
    if counted and counted[0] == 0:
        counts[0, 1, :] = 1e6  # step 0's underflows: must not swamp the colour scale
    blocks = [wire.tensor_stats_block(stats=STORY_STATS, steps=steps, n_tensors=n, data=vals.tobytes())]
    if counted:
        blocks.append(wire.tensor_stats_block(stats=COUNTS, steps=counted, n_tensors=n, data=counts.tobytes()))
    return wire.make_batch(run_id="story", rank=0, segment=segment, tensors=tensor_defs(n) if define else (),
                           steps=[{"step": s, "time": 1.7e9 + s, "loss": loss, "grad_norm": 1.0}
                                  for s, loss in zip(steps, losses, strict=True)],
                           tensor_stats=blocks, events=events)


def _populate_story(client: httpx.Client) -> None:
    """A loss spike at step 55 -> the service orders a rollback -> the agent applies it at 57 (back
    to 30, segment 1); later blocks.1.fc falls back to BF16 and is re-promoted; counts every 5th step."""
    rng = np.random.default_rng(1)
    register(client, "story")
    steps = list(range(58))
    losses = [2.0 + 0.02 * float(rng.standard_normal()) for _ in steps]
    losses[55] = losses[56] = losses[57] = 9.0
    saved = [{"kind": "checkpoint_saved", "step": s, "data": {"path": f"/ck/{s}"}} for s in range(0, 58, 10)]
    r = post(client, _story_batch(steps[:56], 0, losses[:56], saved, True, rng))
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while not (actions := client.get("/v1/runs/story/actions").json()):
        assert time.monotonic() < deadline, "no decision for the loss spike"
        time.sleep(0.1)
    (rollback,) = actions
    assert rollback["kind"] == "rollback", rollback
    target = rollback["payload"]["checkpoint_step"]
    ack = wire.CommandAck(command_id=rollback["id"], status=wire.AckStatus.APPLIED, applied_step=57, error=None)
    r = post(client, _story_batch(steps[56:], 0, losses[56:], [
        {"kind": "command_acknowledged", "step": 57, "data": {"kind": "rollback", **ack.to_json()}},
        {"kind": "rollback_applied", "step": 57, "data": {"command_id": rollback["id"], "modules": None,
                                                         "checkpoint_step": target, "resume_step": target + 1,
                                                         "skip_batches": rollback["payload"]["skip_batches"]}}],
        False, rng))
    assert r.status_code == 200, r.text
    rerun = list(range(target + 1, 100))
    switches = [{"kind": "fallback_applied", "step": BF16[0] - 1, "data": {"modules": ["blocks.1.fc"]}},
                {"kind": "promotion_applied", "step": BF16[1] - 1, "data": {"modules": ["blocks.1.fc"]}}]
    r = post(client, _story_batch(rerun, 1, [2.0 + 0.02 * float(rng.standard_normal()) for _ in rerun], switches,
                                  False, rng))
    assert r.status_code == 200, r.text


PROBE_EVERY = 10
HARM_STEP = 150
"""The probe at this step measures a 4 % gap, far over its band; the agent bisects at the next step."""


def _probe_gaps() -> dict[int, float]:
    gaps = {s: 0.002 + 0.0005 * float(np.sin(s)) for s in range(PROBE_EVERY, 200, PROBE_EVERY)}
    gaps[HARM_STEP] = 0.04
    return gaps


def _populate_probed(client: httpx.Client) -> None:
    """A run with the harm probe on, through the real ingest API: every 10th step carries loss_fp8,
    loss_bf16 and fp8_loss_gap; the probe at step 150 leaves the band, a bisection names
    blocks.1.fc (harm_attributed), and later probes trial it back in FP8 (promotion_trial)."""
    register(client, "probed")
    gaps = _probe_gaps()
    steps = []
    for s in range(200):
        rec: dict[str, Any] = {"step": s, "time": 1.7e9 + s, "loss": 3.0 - 0.002 * s, "grad_norm": 1.0}
        if s in gaps:
            bf16 = 3.0 - 0.002 * s
            rec.update(loss_bf16=bf16, loss_fp8=bf16 * (1 + gaps[s]), fp8_loss_gap=gaps[s])
        steps.append(rec)
    events = [
        {"kind": "harm_attributed", "step": HARM_STEP + 1, "data": {
            "modules": ["blocks.1.fc"], "gap": 0.038, "gap_after": 0.001, "band_high": 0.0075,
            "probe_step": HARM_STEP, "forwards": 5}},
        {"kind": "fallback_applied", "step": HARM_STEP + 2, "data": {"modules": ["blocks.1.fc"]}},
        *({"kind": "promotion_trial", "step": s, "data": {"modules": ["blocks.1.fc"], "gap": 0.0021,
                                                          "band_high": 0.0075, "harmful": False}}
          for s in (170, 180)),
    ]
    n = 6
    blocks = [wire.tensor_stats_block(stats=("amax",), steps=list(range(200)), n_tensors=n,
                                      data=np.ones((200, 1, n), dtype="<f4").tobytes())]
    r = post(client, wire.make_batch(run_id="probed", tensors=tensor_defs(n), steps=steps, tensor_stats=blocks,
                                     events=events))
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
        " return d.data.filter(t => t.yaxis !== 'y2')"  # the incident markers
        " .reduce((n, t) => n + (t.z ? t.z.length * t.z[0].length : (t.y ? t.y.length : 0)), 0); }", div))


def _clean(page: Any) -> None:
    assert page.errors == [], page.errors
    assert page.external == [], page.external
    assert page.evaluate("() => typeof window.__xss") == "undefined"


def test_runs_page(page: Any, base_url: str) -> None:
    _open(page, base_url + "/")
    ids = page.locator("#runs tbody tr").evaluate_all("rows => rows.map(r => r.dataset.runId)")
    assert set(ids) == {"xss-run", "baseline", "rolled", "story", "probed"}
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


@pytest.mark.slow
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


def _pixel(page: Any, div: str, row: int, step: int) -> list[int]:
    """The RGB the heatmap's canvas paints for (display row, the column holding step)."""
    return list(page.evaluate(
        "([id, row, step]) => { const d = document.getElementById(id), m = d.fp8Hover.info.m;"
        " const c = FP8.heatmap.columnAt(m, step); if (c < 0) return [-1, -1, -1];"
        " const p = d.fp8Canvas.getContext('2d').getImageData(c, row, 1, 1).data; return [p[0], p[1], p[2]]; }",
        [div, row, step]))


def _cell_text(page: Any, div: str, row: int, step: int) -> str:
    return str(page.evaluate(
        "([id, row, step]) => { const h = document.getElementById(id).fp8Hover.info;"
        " return FP8.heatmap.cellText(h, row, FP8.heatmap.columnAt(h.m, step)).join(' | '); }", [div, row, step]))


def test_run_page_tells_the_story(page: Any, base_url: str) -> None:
    _open(page, base_url + "/runs/story")
    page.wait_for_selector("#incidents li")
    story = page.locator("#incidents").inner_text()
    assert "step 55" in story and "loss spike (z=" in story, story
    assert "rollback to checkpoint 30, skipping" in story and "applied at 57" in story, story
    assert "resumed at step 31; loss back in band" in story, story
    assert page.locator("#story-lead").inner_text().startswith("1 incident in 100 steps."), page.locator("#story-lead").inner_text()
    # evidence as key/value tables, never raw JSON
    assert page.locator("#timeline td.evidence table.kv").count() >= 3
    cells = page.locator("#timeline td.evidence").all_inner_texts()
    assert not [c for c in cells if c.lstrip().startswith("{")], cells
    assert "checkpoint_step" in page.locator("#timeline td.evidence th").all_inner_texts()
    # every chart on one step axis, with the incident markers
    ranges = page.evaluate("() => ['loss', 'grad', 'gap', 'precision-strip', 'hm-amax', 'hm-underflows', 'scale']"
                           ".map(id => document.getElementById(id)._fullLayout.xaxis.range.map(Math.round))")
    assert all(r == ranges[0] for r in ranges), ranges
    areas = page.evaluate("() => ['loss', 'grad', 'gap', 'precision-strip', 'hm-amax', 'hm-saturation', 'hm-underflows', 'scale']"
                          ".map(id => { const s = document.getElementById(id)._fullLayout._size; return [s.l, Math.round(s.w)]; })")
    assert all(a == areas[0] for a in areas), areas  # the step axes line up on the page
    for div in ("hm-amax", "hm-overflows", "precision-strip", "scale"):
        names = page.evaluate("(id) => document.getElementById(id).data.map(t => t.name)", div)
        assert "finding: critical" in names and "action: rollback" in names, (div, names)
    # the precision strip: blocks.1.fc in BF16 over [71, 85)
    bars = page.evaluate("() => document.getElementById('precision-strip').data.filter(t => t.name === 'BF16')"
                         ".map(t => [t.y, t.base, t.x])")
    assert bars == [[["blocks.1.fc"], [BF16[0]], [BF16[1] - BF16[0]]]], bars
    _clean(page)


def test_bf16_cells_are_absent_not_zero(page: Any, base_url: str) -> None:
    _open(page, base_url + "/runs/story")
    absent = page.evaluate("() => FP8.heatmap.ABSENT")
    # rows in module order: 0-2 blocks.0.fc (FP8 throughout), 3-5 blocks.1.fc (BF16 over [71, 85))
    for row in (3, 4, 5):
        assert _pixel(page, "hm-amax", row, 78) == absent, row
        assert _pixel(page, "hm-saturation", row, 78) == absent, row
        assert "absent, not 0" in _cell_text(page, "hm-amax", row, 78)
        assert _pixel(page, "hm-amax", row, BF16[0] - 1) != absent and _pixel(page, "hm-amax", row, BF16[1]) != absent
    # a true amax of 0 in FP8 is a value (the bottom of the scale), not absent
    zero = _pixel(page, "hm-amax", 0, 77)
    assert zero != absent and zero == [0x44, 0x01, 0x54], zero
    assert "bucket max): 0" in _cell_text(page, "hm-amax", 0, 77)
    hatch = page.evaluate("() => document.getElementById('hm-amax').data.filter(t => t.name === 'absent (BF16)')"
                          ".map(t => [Math.min(...t.x.filter(v => v !== null)), Math.max(...t.x.filter(v => v !== null))])")
    assert hatch == [[BF16[0], BF16[1]]], hatch
    _clean(page)


def test_count_heatmaps_only_over_counted_steps(page: Any, base_url: str) -> None:
    _open(page, base_url + "/runs/story")
    no_data = page.evaluate("() => FP8.heatmap.NO_DATA")
    for div in ("hm-overflows", "hm-underflows"):
        for step in range(0, 100):
            if BF16[0] <= step < BF16[1]:
                continue
            assert _pixel(page, div, 0, step) != no_data, (div, step)  # no zebra stripes
        assert "counted at step 20" in _cell_text(page, div, 0, 23)
    # step 0's 1e6 underflows do not set the scale: the rest (0-19) spans it
    lo, hi = page.evaluate("() => document.getElementById('hm-underflows').fp8Hover.info.range")
    assert lo == 0 and hi < 20, (lo, hi)
    # the saturation legend says what 1 means
    ticks = page.evaluate("() => document.getElementById('hm-saturation').data[1].marker.colorbar.ticktext")
    assert "1 = FP8 max" in ticks, ticks
    _clean(page)


def test_not_found_pages(page: Any, base_url: str) -> None:
    accept = {"accept": "text/html"}
    for path, words in (("/runs/no-such-run", "No run 'no-such-run'"), ("/runs/bad%20id", "is not a run id"),
                        ("/compare?run=story&baseline=nope", "No run 'nope'"), ("/runs/story/extra", "Nothing at"),
                        ("/no/such/page", "Nothing at")):
        r = httpx.get(base_url + path, headers=accept)
        assert r.status_code == 404 and r.headers["content-type"].startswith("text/html"), (path, r.status_code)
        assert words in html.unescape(r.text) and "Not found" in r.text, (path, r.text)
        assert "script-src 'self'" in r.headers["content-security-policy"]
    # the JSON API keeps JSON, and so does a client that does not ask for HTML
    for path, headers in (("/v1/runs/no-such-run", accept), ("/v1/nope", accept), ("/no/such/page", {})):
        r = httpx.get(base_url + path, headers=headers)
        assert r.status_code == 404 and r.headers["content-type"] == "application/json", path
    # names are escaped
    r = httpx.get(base_url + "/runs/%3Cb%3Ex", headers=accept)
    assert r.status_code == 404 and "<b>x" not in r.text
    page.goto(base_url + "/runs/no-such-run")
    assert page.locator("h1").inner_text() == "Not found (404)"
    assert "No run 'no-such-run'" in page.locator("#what").inner_text()
    assert [e for e in page.errors if "status of 404" not in e] == [] and page.external == []


def test_static_and_errors(base_url: str) -> None:
    r = httpx.get(base_url + "/static/plotly.min.js", headers={"accept-encoding": "gzip"})
    assert r.status_code == 200 and "max-age=31536000" in r.headers["cache-control"]
    assert r.headers["content-encoding"] == "gzip" and len(r.content) > 1_000_000
    vendored = sorted((Path(__file__).parents[2] / "dashboards/web/static/vendor").glob("plotly-*.min.js"))
    assert len(vendored) == 1 and httpx.get(base_url + "/static/plotly.min.js").content == vendored[0].read_bytes()
    shell = httpx.get(base_url + "/runs/story").text
    assert f'src="/static/plotly.min.js?v={vendored[0].name[len("plotly-"):-len(".min.js")]}"' in shell
    assert httpx.get(base_url + "/static/..%2Fweb.py").status_code == 404
    assert httpx.get(base_url + "/static/nope.js").status_code == 404
    assert httpx.get(base_url + "/runs/no-such-run").status_code == 404
    csp = httpx.get(base_url + "/").headers["content-security-policy"]
    assert "script-src 'self'" in csp


def _traces(page: Any, div: str) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in page.evaluate(
        "(id) => document.getElementById(id).data.map(t => ({name: t.name, x: t.x, y: t.y}))", div)}


def test_run_page_draws_the_fp8_loss_gap(page: Any, base_url: str) -> None:
    import torch

    from fp8guard.agent.harm import HarmProbe, ProbeReading

    _open(page, base_url + "/runs/probed")
    page.wait_for_function("() => (document.getElementById('gap').data || []).length > 0", timeout=10_000)
    traces = _traces(page, "gap")
    gaps = _probe_gaps()
    line = traces["gap per probe"]
    assert line["x"] == [s for s in gaps if s != HARM_STEP]
    assert line["y"] == pytest.approx([100 * g for s, g in gaps.items() if s != HARM_STEP])
    assert traces["out of band"]["x"] == [HARM_STEP]
    # the band is the agent's own: replay its judgement over the same probes
    (band,) = [t for name, t in traces.items() if name == "band (recomputed here as the agent does)"]
    probe = HarmProbe([], interval_steps=PROBE_EVERY, band_z=4.0, min_gap=0.005, warmup_probes=5,
                      device=torch.device("cpu"))
    expected = {}
    for i, (s, g) in enumerate(gaps.items()):
        if i >= 5:
            expected[s] = 100 * probe.band_high()
        probe.judge(ProbeReading(step=s, loss_fp8=0.0, loss_bf16=0.0, gap=g))
    assert dict(zip(band["x"], band["y"], strict=True)) == pytest.approx(expected)
    bisection = traces["bisection: gap -> with named modules in BF16"]
    assert bisection["x"][:2] == [HARM_STEP + 1] * 2 and bisection["y"][:2] == pytest.approx([3.8, 0.1])
    assert traces["agent's band_high (harm_attributed)"]["y"] == pytest.approx([0.75])
    assert traces["promotion trial (green: no harm)"]["x"] == [170, 180]
    # one step axis and the incident markers, the harm attribution among them
    ranges = page.evaluate("() => ['loss', 'gap', 'hm-amax'].map(id => document.getElementById(id)._fullLayout.xaxis.range)")
    assert ranges[0] == ranges[1] == ranges[2], ranges
    assert "FP8 harm attributed" in _traces(page, "loss") and "FP8 harm attributed" in traces
    # the bisection in the story and the timeline
    story = page.locator("#incidents").inner_text()
    assert f"step {HARM_STEP}: FP8 loss gap 3.8 % over its band (0.75 %)" in story, story
    assert "named blocks.1.fc" in story and "gap 3.8 % -> 0.1 % with them in BF16" in story, story
    assert "promotion trial of blocks.1.fc x2 to step 180" in story and "no harm (gap 0.21 % <= band 0.75 %)" in story, story
    lead = page.locator("#story-lead").inner_text()
    assert "Harm probe, step 190: FP8 costs " in lead, lead
    timeline = page.locator("#timeline").inner_text()
    assert "harm attributed" in timeline and "promotion trial (no harm)" in timeline, timeline
    row = page.locator("#timeline tr", has_text="harm attributed")
    assert "gap_after" in row.locator("td.evidence th").all_inner_texts()
    _clean(page)


def test_run_page_without_probe_says_how_to_turn_it_on(page: Any, base_url: str) -> None:
    _open(page, base_url + "/runs/story")
    page.wait_for_function("() => (document.getElementById('gap').layout || {}).annotations !== undefined", timeout=10_000)
    notes = page.evaluate("() => document.getElementById('gap').layout.annotations.map(a => a.text)")
    assert any("monitor.step(loss, loss_fn=...)" in n for n in notes), notes
    assert "Harm probe" not in page.locator("#story-lead").inner_text()
    _clean(page)


def test_compare_page_without_a_twin(page: Any, base_url: str) -> None:
    _open(page, base_url + "/compare?run=probed")
    verdict = page.locator("#verdict").inner_text()
    latest = 100 * _probe_gaps()[190]
    assert verdict.startswith(f"FP8 costs {float(f'{latest:.3g}'):g} % of the loss, measured on the run's own batches"), verdict
    assert "latest probe, step 190" in verdict and "over 19 probes" in verdict and "1 out of band" in verdict, verdict
    assert _plot_points(page, "diff") >= 19 and _plot_points(page, "losses") == 2 * 19
    assert page.locator("#cmp-baseline").input_value() == ""
    _open(page, base_url + "/compare?run=baseline")
    assert page.locator("#verdict").inner_text().startswith("No harm probe data in run baseline"), page.locator("#verdict").inner_text()
    _clean(page)
