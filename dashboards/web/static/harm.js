/* The harm probe on the dashboards: what FP8 costs the run's loss, measured on its own batches.
   Every harm_interval_steps the agent evaluates the batch's loss with FP8 as in training
   (loss_fp8) and with every module in high precision (loss_bf16) and reports
   fp8_loss_gap = (loss_fp8 - loss_bf16) / loss_bf16 as a step scalar (sparse: one point per
   probe). The band is recomputed here as the agent learns it (agent/harm.py, default settings):
   at each probe, median + max(4 x 1.4826 x MAD, 0.5 %) of the preceding in-band probes (the last
   64); during the first 5 probes a ceiling of 5 %. The agent's own band_high at an attribution
   comes with its harm_attributed event and is drawn as such. Used by the run and compare pages. */
"use strict";
(function () {
  const F = window.FP8;
  const { colors, ptext, fmt } = F;
  const Z = 4, SPREAD = 1.4826, MIN_GAP = 0.005, WARMUP = 5, CEILING = 10 * MIN_GAP, HISTORY = 64;
  const FIELDS = "fp8_loss_gap,loss_fp8,loss_bf16";
  const HOW = "No harm probe data in this run. Turn the probe on: pass the loss closure, monitor.step(loss, loss_fn=...);"
    + " every harm_interval_steps (default 200) it measures the batch's loss with FP8 and with BF16.";
  const pct = (v, d) => (v === null || v === undefined ? "-" : !Number.isFinite(v) ? String(v) : fmt(100 * v, d || 3) + " %");

  /* "FP8 costs 1.2 % of the loss"; a gap at or under 0 (the BF16 loss was as high or higher) costs nothing */
  function costText(g) {
    if (!Number.isFinite(g)) return "FP8 loss gap " + g;
    return g > 0 ? "FP8 costs " + pct(g) + " of the loss" : "FP8 costs nothing measurable (gap " + pct(g) + ")";
  }

  function median(v) {
    const s = v.slice().sort((a, b) => a - b), n = s.length;
    return n % 2 ? s[(n - 1) / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
  }

  /* /scalars (FIELDS) -> the probes [{step, gap, fp8, bf16}], steps without a probe left out;
     in a bucket of several steps, the bucket's first step and its largest gap */
  function probes(series) {
    const out = [];
    series.steps.forEach((step, i) => {
      const gap = F.num(series.max.fp8_loss_gap[i]);
      if (gap === null) return;
      out.push({ step, gap, fp8: F.num(series.max.loss_fp8[i]), bf16: F.num(series.max.loss_bf16[i]) });
    });
    return out;
  }

  /* the agent's judgement replayed: each probe gets the band it was judged against */
  function bands(list) {
    const history = [];
    return list.map((p) => {
      let center = null, high = CEILING;
      const warm = history.length < WARMUP;
      if (!warm) {
        center = median(history);
        high = center + Math.max(Z * SPREAD * median(history.map((v) => Math.abs(v - center))), MIN_GAP);
      }
      const out = !(Number.isFinite(p.gap) && p.gap <= high);
      if (!out) { history.push(p.gap); if (history.length > HISTORY) history.shift(); }
      return { center, high, warm, out };
    });
  }

  /* latest and median gap over the finite probes */
  function summary(list) {
    const finite = list.filter((p) => Number.isFinite(p.gap));
    if (!list.length) return null;
    const last = list[list.length - 1];
    return { latest: last.gap, step: last.step, median: finite.length ? median(finite.map((p) => p.gap)) : NaN,
      n: list.length, outOfBand: bands(list).filter((b) => b.out).length };
  }

  function fetch(base, width, params) {
    return F.api(base + "/scalars", Object.assign({ fields: FIELDS, width }, params || {}));
  }

  /* traces and y-axis for the gap chart (y in percent); events: the run's harm_attributed and
     promotion_trial events (may be empty) */
  function figure(series, events) {
    const list = probes(series), b = bands(list);
    const finite = list.map((p, i) => [p, b[i]]).filter(([p]) => Number.isFinite(p.gap));
    const hov = series.bucket > 1 ? " (bucket of " + series.bucket + " steps)" : "";
    const traces = [];
    const banded = finite.filter(([, bb]) => !bb.warm);
    if (banded.length) {
      traces.push({ type: "scatter", mode: "lines", x: banded.map(([p]) => p.step), y: banded.map(([, bb]) => 100 * bb.center),
        line: { color: colors.grey, width: 1, dash: "dot", shape: "hv" }, name: "band median", legendgroup: "band", showlegend: false,
        hovertemplate: "band median %{y:.3g} %<extra></extra>" });
      traces.push({ type: "scatter", mode: "lines", x: banded.map(([p]) => p.step), y: banded.map(([, bb]) => 100 * bb.high),
        fill: "tonexty", fillcolor: "rgba(136,136,136,0.18)", line: { color: colors.grey, width: 1.2, shape: "hv" }, legendgroup: "band",
        name: "band (recomputed here as the agent does)",
        hovertemplate: "band: median + max(4 x 1.4826 MAD, 0.5 %) of earlier in-band probes = %{y:.3g} % at step %{x}<extra></extra>" });
    }
    for (const [out, name, color] of [[false, "gap per probe", colors.blue], [true, "out of band", colors.vermillion]]) {
      const pts = finite.filter(([, bb]) => bb.out === out);
      if (!pts.length && out) continue;
      traces.push({ type: "scatter", mode: out ? "markers" : "lines+markers", x: pts.map(([p]) => p.step), y: pts.map(([p]) => 100 * p.gap),
        name, line: { color, width: 1 }, marker: { color, size: out ? 9 : 5 },
        customdata: pts.map(([p, bb]) => [fmt(p.fp8, 5), fmt(p.bf16, 5), pct(bb.high), bb.warm ? " (warm-up ceiling)" : ""]),
        hovertemplate: "step %{x}" + hov + ": FP8 costs %{y:.3g} % of the loss<br>loss_fp8 %{customdata[0]}, loss_bf16 %{customdata[1]}"
          + "<br>band %{customdata[2]}%{customdata[3]}<extra></extra>" });
    }
    const bad = list.filter((p) => !Number.isFinite(p.gap));
    if (bad.length) traces.push({ type: "scatter", mode: "markers", x: bad.map((p) => p.step), y: bad.map(() => 0.9), yaxis: "y2",
      name: "gap not finite", marker: { color: colors.vermillion, symbol: "x", size: 10 },
      text: bad.map((p) => "step " + p.step + ": gap " + p.gap), hovertemplate: "%{text}<extra></extra>" });
    const harm = (events || []).filter((e) => e.kind === "harm_attributed" && e.data);
    if (harm.length) {
      const xs = [], ys = [];
      for (const e of harm) xs.push(e.step, e.step, null), ys.push(100 * F.num(e.data.gap), 100 * F.num(e.data.gap_after), null);
      traces.push({ type: "scatter", mode: "lines+markers", x: xs, y: ys, name: "bisection: gap -> with named modules in BF16",
        line: { color: colors.purple, width: 2 }, marker: { color: colors.purple, size: 8, symbol: "diamond" },
        text: harm.flatMap((e) => { const t = ptext(harmText(e)); return [t, t, null]; }), hovertemplate: "%{text}<extra></extra>" });
      traces.push({ type: "scatter", mode: "markers", x: harm.map((e) => e.step), y: harm.map((e) => 100 * F.num(e.data.band_high)),
        name: "agent's band_high (harm_attributed)", marker: { color: colors.black, symbol: "line-ew-open", size: 18, line: { width: 2 } },
        hovertemplate: "agent's band at step %{x}: %{y:.3g} %<extra></extra>" });
    }
    const trials = (events || []).filter((e) => e.kind === "promotion_trial" && e.data);
    if (trials.length) traces.push({ type: "scatter", mode: "markers", x: trials.map((e) => e.step), y: trials.map((e) => 100 * F.num(e.data.gap)),
      name: "promotion trial (green: no harm)", marker: { size: 9, symbol: "circle-open", line: { width: 2 },
        color: trials.map((e) => (e.data.harmful ? colors.vermillion : colors.green)) },
      text: trials.map((e) => ptext(trialText(e))), hovertemplate: "%{text}<extra></extra>" });
    return { traces, probes: list, bands: b, empty: !list.length };
  }

  function mods(e) {
    const m = Array.isArray(e.data.modules) ? e.data.modules : [];
    return m.length ? (m.length > 3 ? m.slice(0, 3).join(", ") + " +" + (m.length - 3) : m.join(", ")) : "no modules";
  }
  function harmText(e) {
    const d = e.data;
    return "step " + e.step + ": FP8 harm attributed to " + mods(e) + "; gap " + pct(F.num(d.gap)) + " -> " + pct(F.num(d.gap_after))
      + " with them in BF16 (band " + pct(F.num(d.band_high)) + (F.num(d.forwards) !== null ? ", " + d.forwards + " forwards" : "")
      + (d.probe_step !== undefined ? ", probe at step " + d.probe_step : "") + ")";
  }
  function trialText(e) {
    const d = e.data;
    return "step " + e.step + ": promotion trial of " + mods(e) + ": " + (d.harmful ? "harmful" : "no harm") + " (gap "
      + pct(F.num(d.gap)) + (d.harmful ? " > " : " <= ") + "band " + pct(F.num(d.band_high)) + ")";
  }

  function emptyAnnotation() {
    return [{ xref: "paper", yref: "paper", x: 0.5, y: 0.5, showarrow: false, text: ptext(HOW).replace(/; /, ";<br>"),
      font: { color: colors.grey } }];
  }

  F.harm = { FIELDS, HOW, costText, probes, bands, summary, fetch, figure, harmText, trialText, pct, emptyAnnotation,
    yaxis: { title: { text: "FP8 loss gap (%)" }, ticksuffix: " %", zeroline: true, zerolinecolor: "#ccc" } };
})();
