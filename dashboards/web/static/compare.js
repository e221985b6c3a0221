/* Compare page: loss(run) - loss(baseline) over steps against the baseline's noise band. Without a
   baseline (no BF16 twin), the run's measured FP8 harm instead: the harm probe's gap series with
   its band (harm.js) and the probed batches' loss with FP8 and with BF16. */
"use strict";
(function () {
  const F = window.FP8;
  const { api, colors, ptext } = F;
  const runId = document.body.dataset.run, baseId = document.body.dataset.baseline;
  const WINDOW = 25, SIGMAS = 3, PERSIST = 5;

  async function fillForm() {
    const runs = await api("/v1/runs", { limit: 1000 });
    const opts = runs.map((r) => [r.run_id, r.run_id + (r.model ? " (" + r.model + ")" : "")]);
    F.fillSelect(document.getElementById("cmp-run"), opts, runId || undefined);
    const none = [["", "none: the run's own harm probe"]];
    F.fillSelect(document.getElementById("cmp-baseline"), none.concat(opts), baseId || (runId || opts.length < 2 ? "" : opts[1][0]));
  }

  function mid(series, j) {
    const lo = F.num(series.min.loss[j]), hi = F.num(series.max.loss[j]);
    if (lo === null || hi === null) return NaN;
    return (lo + hi) / 2;
  }

  /* Pure computation, exposed for tests: aligned steps, diff, band, verdict. */
  function analyse(a, b) {
    const bIndex = new Map(b.steps.map((s, j) => [s, j]));
    const steps = [], diff = [], base = [], run = [];
    a.steps.forEach((s, i) => {
      const j = bIndex.get(s);
      if (j === undefined) return;
      const va = mid(a, i), vb = mid(b, j);
      steps.push(s); run.push(va); base.push(vb); diff.push(va - vb);
    });
    const band = steps.map((_, k) => {
      const w = base.slice(Math.max(0, k - WINDOW + 1), k + 1).filter(Number.isFinite);
      if (w.length < 5) return NaN;
      const m = w.reduce((x, y) => x + y, 0) / w.length;
      const sd = Math.sqrt(w.reduce((x, y) => x + (y - m) * (y - m), 0) / (w.length - 1));
      return SIGMAS * sd;
    });
    let onset = null, streak = 0, start = null;
    for (let k = 0; k < steps.length; k++) {
      const out = !Number.isFinite(diff[k]) ? Number.isFinite(base[k]) : (Number.isFinite(band[k]) && Math.abs(diff[k]) > band[k]);
      if (out) { if (streak === 0) start = steps[k]; streak++; if (streak >= PERSIST) { onset = start; break; } }
      else streak = 0;
    }
    return { steps, diff, band, run, base, onset };
  }
  window.FP8.compareAnalyse = analyse;

  /* no twin: what FP8 costs the run, measured on its own batches */
  async function harmOnly(verdict) {
    const base = "/v1/runs/" + encodeURIComponent(runId);
    document.getElementById("title").textContent = runId + ": measured FP8 harm (no BF16 twin)";
    document.getElementById("diff-h").textContent = "FP8 loss gap, measured on the run's own batches (harm probe)";
    document.getElementById("losses-h").textContent = "The probed batches' loss with FP8 and with every module in BF16";
    document.getElementById("cmp-note").textContent = "Each point: one batch's loss evaluated twice with the same weights, "
      + "FP8 as in training and every FP8 module in high precision; gap = (loss_fp8 - loss_bf16) / loss_bf16. "
      + "Band: the agent's (median + 4 x 1.4826 MAD of earlier in-band probes, at least 0.5 %), recomputed here. Pick a baseline run to compare two runs instead.";
    const width = F.widthOf(document.getElementById("diff")) - 80;
    const [series, harm, trials] = await Promise.all([F.harm.fetch(base, width), api(base + "/events", { kind: "harm_attributed", limit: 10000 }),
      api(base + "/events", { kind: "promotion_trial", limit: 10000 })]);
    const events = harm.concat(trials).filter((e) => e.rank === 0).sort((a, b) => (a.step || 0) - (b.step || 0));
    const fig = F.harm.figure(series, events), sum = F.harm.summary(fig.probes);
    const last = fig.bands.length ? fig.bands[fig.bands.length - 1] : null;
    verdict.className = "verdict " + (!sum ? "" : last.out ? "bad" : "ok");
    verdict.textContent = !sum ? "No harm probe data in run " + runId + ": turn the probe on with monitor.step(loss, loss_fn=...), or pick a baseline run."
      : F.harm.costText(sum.latest) + ", measured on the run's own batches (latest probe, step " + sum.step
        + "; median " + F.harm.pct(sum.median) + " over " + sum.n + " probes" + (sum.outOfBand ? ", " + sum.outOfBand + " out of band" : "") + ")";
    await Plotly.react("diff", fig.traces, F.baseLayout({ yaxis: F.harm.yaxis, uirevision: "keep", margin: { l: 60, r: 20, t: 50, b: 40 },
      yaxis2: { overlaying: "y", range: [0, 1], visible: false, fixedrange: true }, legend: { orientation: "h", y: 1.02, yanchor: "bottom", x: 0 },
      annotations: fig.empty ? F.harm.emptyAnnotation() : [] }), F.plotConfig);
    const xs = fig.probes.map((q) => q.step);
    await Plotly.react("losses", [
      { type: "scatter", mode: "lines+markers", x: xs, y: fig.probes.map((q) => q.bf16), name: "loss_bf16 (every module in high precision)",
        line: { color: colors.grey, dash: "dash" }, hovertemplate: "loss_bf16 %{y:.5g} at step %{x}<extra></extra>" },
      { type: "scatter", mode: "lines+markers", x: xs, y: fig.probes.map((q) => q.fp8), name: ptext("loss_fp8 (run " + runId + ", as trained)"),
        line: { color: colors.blue }, hovertemplate: "loss_fp8 %{y:.5g} at step %{x}<extra></extra>" },
    ], F.baseLayout({ yaxis: { title: { text: "loss" } }, uirevision: "keep" }), F.plotConfig);
    window.fp8guardReady = true;
  }

  async function refresh() {
    const verdict = document.getElementById("verdict");
    if (runId && !baseId) { await harmOnly(verdict); return; }
    if (!runId || !baseId) { verdict.textContent = "Pick a run and a baseline."; window.fp8guardReady = true; return; }
    document.getElementById("title").textContent = runId + " vs baseline " + baseId;
    const [da, db] = await Promise.all([api("/v1/runs/" + encodeURIComponent(runId)), api("/v1/runs/" + encodeURIComponent(baseId))]);
    const end = Math.min(da.last_step === null ? -1 : da.last_step, db.last_step === null ? -1 : db.last_step);
    if (end < 0) { verdict.textContent = "No common steps yet."; window.fp8guardReady = true; return; }
    const width = F.widthOf(document.getElementById("diff")) - 80;
    const params = { fields: "loss", start: 0, end, width };
    const [a, b] = await Promise.all([api("/v1/runs/" + encodeURIComponent(runId) + "/scalars", params),
      api("/v1/runs/" + encodeURIComponent(baseId) + "/scalars", params)]);
    const r = analyse(a, b);
    verdict.className = "verdict " + (r.onset === null ? "ok" : "bad");
    verdict.textContent = r.steps.length === 0 ? "No common steps yet."
      : (r.onset === null ? "within noise (through step " + r.steps[r.steps.length - 1] + ")" : "diverging from step " + r.onset);
    const hov = " at step %{x}" + (a.bucket > 1 ? " (bucket of " + a.bucket + ")" : "");
    const upper = r.band, lower = r.band.map((v) => -v);
    const diffTraces = [
      { type: "scatter", mode: "lines", x: r.steps, y: lower, line: { width: 0, color: colors.grey }, showlegend: false, hoverinfo: "skip" },
      { type: "scatter", mode: "lines", x: r.steps, y: upper, fill: "tonexty", fillcolor: "rgba(136,136,136,0.25)",
        line: { width: 0, color: colors.grey }, name: "noise band (+/- " + SIGMAS + " sd of baseline)", hovertemplate: "band +/- %{y:.4g}" + hov + "<extra></extra>" },
      { type: "scatter", mode: "lines", x: r.steps, y: r.diff, line: { color: colors.vermillion, width: 1.5 },
        name: "loss difference", hovertemplate: "run - baseline: %{y:.5g}" + hov + "<extra></extra>" },
    ];
    const shapes = r.onset === null ? [] : [{ type: "line", xref: "x", yref: "paper", x0: r.onset, x1: r.onset, y0: 0, y1: 1,
      line: { color: colors.vermillion, dash: "dot", width: 1.5 } }];
    await Plotly.react("diff", diffTraces, F.baseLayout({ shapes, yaxis: { title: { text: "loss difference" } }, uirevision: "keep" }), F.plotConfig);
    await Plotly.react("losses", [
      { type: "scatter", mode: "lines", x: r.steps, y: r.base, name: ptext("baseline " + baseId), line: { color: colors.grey, dash: "dash" },
        hovertemplate: "baseline loss %{y:.5g}" + hov + "<extra></extra>" },
      { type: "scatter", mode: "lines", x: r.steps, y: r.run, name: ptext("run " + runId), line: { color: colors.blue },
        hovertemplate: "run loss %{y:.5g}" + hov + "<extra></extra>" },
    ], F.baseLayout({ shapes, yaxis: { title: { text: "loss" } }, uirevision: "keep" }), F.plotConfig);
    window.fp8guardReady = true;
  }

  fillForm().catch(F.showError);
  refresh().then(() => F.setLive("live, updated " + new Date().toLocaleTimeString()))
    .catch((e) => { F.showError(e); window.fp8guardReady = true; });
  F.every(refresh);
})();
