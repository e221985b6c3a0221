/* Run page: what happened (incident summary), scalars, the precision strip, per-tensor heatmaps,
   the scale timeline and the tables; every chart shares one step axis (zooming one zooms all) and
   carries the incident markers. Sets window.fp8guardReady once the heatmaps have rendered
   (bench/page_load.py waits on it). Drawing helpers: heatmap.js, precision.js, story.js, harm.js
   (the harm probe's FP8 loss gap), tables.js. */
"use strict";
(function () {
  const F = window.FP8;
  const { api, el, clear, fmt, colors } = F;
  const runId = document.body.dataset.runId;
  const base = "/v1/runs/" + encodeURIComponent(runId);
  const HEATMAPS = [
    { stat: "amax", div: "hm-amax", kind: "log", unit: "amax (absolute max)", legend: "amax (log colour)" },
    { stat: "saturation", div: "hm-saturation", kind: "saturation", unit: "saturation ratio", legend: "saturation (log colour)" },
    { stat: "overflows", kind: "count", unit: "overflow count", legend: "overflows", title: "Overflows per tensor" },
    { stat: "underflows", kind: "count", unit: "underflow count", legend: "underflows", title: "Underflows per tensor" },
  ];
  const PLOTS = ["loss", "grad", "gap", "precision-strip", "hm-amax", "hm-saturation", "hm-overflows", "hm-underflows", "scale"];
  /* run.js loads before plotly.min.js (both deferred), so the heavy queries start while the
     browser is still parsing plotly; drawing waits for it. */
  const plotlyReady = window.Plotly ? Promise.resolve() : new Promise((resolve) => {
    document.addEventListener("DOMContentLoaded", () => resolve(), { once: true });
  });
  const state = { key: null, smallKey: null, tensors: null, order: null, xRange: null, margin: null, loss: null, facts: null };

  /* ---------- ordering: tensors grouped by module, modules in order of first appearance ---------- */
  function groupOrder(tensors) {
    const first = new Map();
    for (const t of tensors) { const m = t.module || t.name; if (!first.has(m)) first.set(m, t.index); }
    const idx = tensors.map((t, i) => i);
    idx.sort((a, b) => {
      const ta = tensors[a], tb = tensors[b];
      return first.get(ta.module || ta.name) - first.get(tb.module || tb.name) || ta.index - tb.index;
    });
    return idx;
  }

  /* ---------- the shared step axis: same range and plot-area margins everywhere, zoom linked ---------- */
  function axisFor(detail, tensors) {
    const x0 = tensors.length ? Math.min(...tensors.map((t) => t.first_step)) : 0;
    const x1 = detail.last_step === null ? x0 + 1 : detail.last_step + 1;
    state.xRange = [x0, Math.max(x1, x0 + 1)];
    state.margin = { l: tensors.length <= 60 ? 260 : 70, r: 150, b: 40 };
  }

  let syncing = false;
  function linkZoom(div) {
    if (div.fp8Linked) return;
    div.fp8Linked = true;
    div.on("plotly_relayout", (ev) => {
      if (syncing || !ev) return;
      let range = null;
      if ("xaxis.range[0]" in ev) range = [ev["xaxis.range[0]"], ev["xaxis.range[1]"]];
      else if (Array.isArray(ev["xaxis.range"])) range = ev["xaxis.range"];
      else if (ev["xaxis.autorange"]) range = state.xRange;
      if (!range) return;
      syncing = true;
      const jobs = PLOTS.map((id) => document.getElementById(id))
        .filter((d) => d && d !== div && d._fullLayout).map((d) => Plotly.relayout(d, { "xaxis.range": range.slice() }));
      Promise.all(jobs).finally(() => { syncing = false; });
    });
  }

  async function plot(div, traces, layout) {
    await Plotly.react(div, traces, layout, F.plotConfig);
    linkZoom(div);
  }

  function xaxis() { return { title: { text: "step" }, zeroline: false, range: state.xRange.slice() }; }

  /* ---------- scalars ---------- */
  function bandTraces(series, field, name, color, extra) {
    const xs = series.steps;
    const lo = series.min[field].map(F.num), hi = series.max[field].map(F.num);
    const unitHover = "step %{x}" + (series.bucket > 1 ? " (+" + (series.bucket - 1) + ")" : "");
    if (series.bucket <= 1) {
      return [Object.assign({ type: "scatter", mode: "lines", x: xs, y: hi, name, line: { color, width: 1.5 },
        hovertemplate: name + " %{y:.5g}<br>" + unitHover + "<extra></extra>" }, extra || {})];
    }
    return [
      Object.assign({ type: "scatter", mode: "lines", x: xs, y: lo, name: name + " (bucket min)", line: { color, width: 0.8 },
        legendgroup: name, showlegend: false, hovertemplate: name + " min %{y:.5g}<br>" + unitHover + "<extra></extra>" }, extra || {}),
      Object.assign({ type: "scatter", mode: "lines", x: xs, y: hi, name, line: { color, width: 0.8 }, fill: "tonexty",
        legendgroup: name, hovertemplate: name + " max %{y:.5g}<br>" + unitHover + "<extra></extra>" }, extra || {}),
    ];
  }

  /* the run's lead rank: its lowest reporting rank (0 unless report_ranks leave rank 0 out); the
     series routes answer for it when no rank is asked */
  function leadRank(detail) {
    return detail.ranks.length ? Math.min(...detail.ranks.map((r) => r.rank)) : 0;
  }

  async function fetchScalars(detail) {
    const width = F.widthOf(document.getElementById("loss")) - 80;
    const lead = leadRank(detail);
    const lastSegment = Math.max(0, ...detail.ranks.filter((r) => r.rank === lead).map((r) => r.last_segment));
    const segs = [];
    for (let s = 0; s < lastSegment; s++) segs.push(s);
    const [gap, eff, ...abandoned] = await Promise.all([
      F.harm.fetch(base, width),
      api(base + "/scalars", { fields: "loss,grad_norm", width }),
      ...segs.map((s) => api(base + "/scalars", { fields: "loss,grad_norm", width, segment: s })),
    ]);
    state.loss = { steps: eff.steps, values: eff.max.loss.map(F.num) };
    return { eff, abandoned, segs, gap };
  }

  /* the harm probe's gap (sparse: one point per probe) with its band and the bisections */
  async function drawGap(sc, facts) {
    const fig = F.harm.figure(sc.gap, facts.harm);
    const layout = F.baseLayout({ shapes: F.story.rollbackShapes(facts.rollbacks), margin: Object.assign({ t: 56 }, state.margin),
      legend: { orientation: "h", y: 1.02, yanchor: "bottom", x: 0 }, xaxis: xaxis(), yaxis: F.harm.yaxis, yaxis2: F.story.y2,
      annotations: fig.empty ? F.harm.emptyAnnotation() : [], uirevision: "keep" });
    await plot(document.getElementById("gap"), fig.traces.concat(marks(facts, false)), layout);
  }

  async function drawScalars(sc, facts) {
    const { eff, abandoned, segs } = sc;
    const mk = marks(facts, true), shapes = F.story.rollbackShapes(facts.rollbacks);
    for (const [field, id, label, color] of [["loss", "loss", "loss", colors.blue], ["grad_norm", "grad", "grad norm", colors.green]]) {
      const traces = [];
      abandoned.forEach((seg, i) => {
        const s = segs[i];
        const rb = facts.rollbacks.find((e) => e.segment === s && e.data && Number.isInteger(e.data.checkpoint_step));
        const cut = rb ? rb.data.checkpoint_step : -1;
        const keep = seg.steps.map((x, j) => j).filter((j) => seg.steps[j] >= cut);
        const sub = { bucket: seg.bucket, steps: keep.map((j) => seg.steps[j]),
          min: { [field]: keep.map((j) => seg.min[field][j]) }, max: { [field]: keep.map((j) => seg.max[field][j]) } };
        traces.push(...bandTraces(sub, field, "abandoned, segment " + s, colors.grey,
          { line: { color: colors.grey, width: 1.2, dash: "dash" }, fill: "none" }));
      });
      traces.push(...bandTraces(eff, field, label, color), ...mk);
      await plot(document.getElementById(id), traces, F.baseLayout({ shapes, margin: Object.assign({ t: 56 }, state.margin),
        legend: { orientation: "h", y: 1.02, yanchor: "bottom", x: 0 },
        xaxis: xaxis(), yaxis: { title: { text: label }, zeroline: false }, yaxis2: F.story.y2, uirevision: "keep" }));
    }
  }

  function marks(facts, legend) { return F.story.markerTraces(facts.findings, facts.actions, { legend, harm: facts.harm }); }

  /* ---------- precision strip ---------- */
  async function drawStrip(detail, facts) {
    const div = document.getElementById("precision-strip");
    const { traces, rows } = F.precision.stripFigure(facts.hist, state.xRange, detail.last_step);
    div.style.height = (rows.length ? 64 + 26 * rows.length : 70) + "px";
    const mk = marks(facts, false);
    const layout = F.baseLayout({ barmode: "overlay", showlegend: false, margin: Object.assign({ t: 14 }, state.margin), xaxis: xaxis(),
      yaxis: { type: "category", categoryorder: "array", categoryarray: rows.slice().reverse(), automargin: false, tickfont: { size: 10 },
        range: rows.length ? [-0.5, rows.length - 0.5] : [0, 1], showticklabels: rows.length > 0 }, yaxis2: F.story.y2,
      shapes: F.story.rollbackShapes(facts.rollbacks), uirevision: "keep",
      annotations: rows.length ? [] : [{ xref: "paper", yref: "paper", x: 0.5, y: 0.5, showarrow: false,
        text: "every module in FP8 throughout (no fallback applied)", font: { color: colors.grey } }] });
    await plot(div, traces.concat(mk), layout);
  }

  /* ---------- heatmaps ---------- */
  function heatmapDivs(detail) {
    const extra = document.getElementById("extra-heatmaps");
    const out = [];
    for (const spec of HEATMAPS) {
      let div = document.getElementById(spec.div || "hm-" + spec.stat);
      if (!detail.stats.includes(spec.stat)) {
        if (spec.div) { clear(div); div.appendChild(el("p", { class: "note", text: "This run reports no " + spec.stat + " statistic." })); }
        continue;
      }
      if (!div) {
        extra.appendChild(el("h2", {}, spec.title + " ", el("small", { text: "(max over each step bucket; counted every few steps, each count "
          + "drawn until the next; colour clipped at the 99th percentile, hover for exact values; hatched: module in BF16, absent)" })));
        div = el("div", { id: "hm-" + spec.stat, class: "plot tall" });
        extra.appendChild(div);
      }
      out.push({ spec, div });
    }
    return out;
  }

  function drawHeatmaps(detail, factsReady) {
    const jobs = heatmapDivs(detail).map(({ spec, div }) =>
      api(base + "/matrix", { stat: spec.stat, encoding: "base64", width: F.widthOf(div) - 100 }).then((m) => ({ m, spec, div })));
    const fetched = Promise.all(jobs);
    /* each heatmap draws as soon as its own matrix (and the run's facts) are in */
    const drawn = Promise.all(jobs.map((job) => job.then(async ({ m, spec, div }) => {
      const facts = await factsReady;
      if (!state.order || state.order.length !== m.tensors.length) state.order = groupOrder(m.tensors);
      const absent = F.precision.absentMask(facts.hist, m, state.order);
      const fig = await F.heatmap.figure(m, spec, state.order, { absent, xRange: state.xRange, margin: state.margin,
        marks: marks(facts, false), shapes: F.story.rollbackOutlines(facts.rollbacks) });
      await plotlyReady;
      const old = div.fp8Source;
      await plot(div, fig.traces, fig.layout);
      div.fp8Source = fig.source;
      div.fp8Canvas = fig.canvas;
      if (old && old !== fig.source && old.startsWith("blob:")) URL.revokeObjectURL(old);
      F.heatmap.attachHover(div);
      div.fp8Hover.info = fig.hover;
    })));
    return { fetched, drawn };
  }

  /* ---------- scale timeline ---------- */
  async function drawSeries() {
    const tSel = document.getElementById("tensor-pick"), sSel = document.getElementById("stat-pick");
    if (!tSel.value || !sSel.value || !state.facts) return;
    const div = document.getElementById("scale");
    const s = await api(base + "/tensors/" + encodeURIComponent(tSel.value) + "/series", { stat: sSel.value, width: F.widthOf(div) - 80 });
    const facts = state.facts;
    const series = { bucket: s.bucket, steps: s.steps, min: { v: s.min }, max: { v: s.max } };
    const shapes = F.story.rollbackShapes(facts.rollbacks);
    for (const [a, b] of F.precision.spansFor(facts.hist, F.precision.moduleOf(s.tensor))) {  /* BF16: hatched */
      shapes.push({ type: "rect", xref: "x", yref: "paper", x0: a, x1: Math.min(b, state.xRange[1]), y0: 0, y1: 1, layer: "below",
        fillcolor: "rgba(196,196,196,0.5)", line: { width: 0 } });
    }
    const layout = F.baseLayout({ showlegend: false, xaxis: xaxis(), yaxis: { title: { text: s.stat }, zeroline: false }, yaxis2: F.story.y2, shapes,
      annotations: [{ xref: "paper", yref: "paper", x: 0, y: 1, yanchor: "bottom", showarrow: false,
        text: F.ptext(s.tensor.name) + " (grey: module in BF16, values there are not FP8 statistics)", font: { size: 11 } }],
      margin: Object.assign({ t: 24 }, state.margin), uirevision: "keep" });
    await plot(div, bandTraces(series, "v", s.stat, colors.blue).concat(marks(facts, false)), layout);
  }

  function fillPickers(detail, tensors, findings) {
    const tSel = document.getElementById("tensor-pick"), sSel = document.getElementById("stat-pick");
    const order = groupOrder(tensors);
    let wanted = tSel.value;
    if (!wanted) {
      const named = new Set(findings.flatMap((f) => (f.evidence && f.evidence.tensors) || []));
      const hit = tensors.find((t) => named.has(t.name));
      wanted = String(hit ? hit.index : (tensors.length ? tensors[order[0]].index : ""));
    }
    F.fillSelect(tSel, order.map((i) => [tensors[i].index, tensors[i].name + (tensors[i].format ? " [" + tensors[i].format + "]" : "")]), wanted);
    F.fillSelect(sSel, detail.stats.map((s) => [s, s]), sSel.value || (detail.stats.includes("scale") ? "scale" : detail.stats[0]));
  }

  /* ---------- summary boxes and the incident list ---------- */
  function drawSummary(d) {
    document.getElementById("title").textContent = d.run_id + (d.model ? "  (" + d.model + ")" : "");
    const box = clear(document.getElementById("summary"));
    const item = (label, value, cls) => box.appendChild(el("div", {}, el("b", { text: label }), el("span", { class: cls || "", text: value })));
    item("status", d.status, "badge st-" + d.status);
    item("model", d.model || "-");
    item("last step", d.last_step === null ? "-" : String(d.last_step));
    item("last loss", fmt(d.last_loss));
    item("tensors", String(d.num_tensors));
    item("stats", d.stats.join(", ") || "-");
    item("segments", String(1 + Math.max(0, ...d.ranks.map((r) => r.last_segment))));
    item("ranks", String(d.ranks.length) + " / world " + d.world_size);
  }

  function drawStory(detail, facts) {
    const list = clear(document.getElementById("incidents"));
    const items = F.story.incidents(facts.findings, facts.actions, facts.hist, state.loss, detail.last_step, facts.harm);
    const lead = document.getElementById("story-lead");
    const bf16 = facts.precision.filter((p) => String(p.precision).toLowerCase() !== "fp8").map((p) => p.module);
    lead.textContent = (items.length ? items.length + (items.length === 1 ? " incident" : " incidents") : "No incidents")
      + " in " + (detail.last_step === null ? 0 : detail.last_step + 1) + " steps. Now: "
      + (bf16.length ? bf16.length + " module(s) in BF16 (" + bf16.slice(0, 3).join(", ") + (bf16.length > 3 ? ", ..." : "") + ")" : "every module in FP8") + "."
      + (state.gap ? " Harm probe, step " + state.gap.step + ": " + F.harm.costText(state.gap.latest) + " (median "
        + F.harm.pct(state.gap.median) + " over " + state.gap.n + " probes)." : "");
    const MAX = 12;
    for (const it of items.slice(0, MAX)) {
      list.appendChild(el("li", { class: "incident", "data-kind": it.kind },
        el("b", { class: "step", text: "step " + it.step }), ": ",
        el("span", { class: "sev-" + it.severity, text: it.what }), " ",
        el("span", { class: "arrow", text: "\u2192" }), " ",
        el("span", { class: "did", text: it.did }),
        it.outcome ? el("span", { class: "outcome", text: "; " + it.outcome }) : null));
    }
    if (items.length > MAX) list.appendChild(el("li", { class: "note", text: "and " + (items.length - MAX) + " more in the table below" }));
  }

  /* ---------- the run's facts: findings, actions, events, precision (small queries) ---------- */
  async function fetchFacts(detail) {
    const lead = leadRank(detail);
    const [findings, actions, precision, checkpoints, events] = await Promise.all([
      api(base + "/findings"), api(base + "/actions"), api(base + "/precision"), api(base + "/checkpoints"),
      api(base + "/events", { limit: 10000 }),
    ]);
    const rollbacks = events.filter((e) => e.kind === "rollback_applied");
    const harm = events.filter((e) => (e.kind === "harm_attributed" || e.kind === "promotion_trial") && e.rank === lead);
    const hist = F.precision.history(events, actions, precision, lead);
    return { findings, actions, precision, checkpoints, events, rollbacks, hist, harm };
  }

  /* ---------- refresh loop ---------- */
  async function refresh(first) {
    const detail = await api(base);
    drawSummary(detail);
    const key = [detail.last_step, detail.samples, detail.status, detail.num_tensors, detail.stats.join(",")].join("|");
    const dataChanged = key !== state.key;
    state.key = key;
    if (dataChanged && (!state.tensors || state.tensors.length !== detail.num_tensors)) state.tensors = await api(base + "/tensors");
    if (dataChanged) axisFor(detail, state.tensors);
    const factsReady = fetchFacts(detail);
    /* the heatmaps' matrices are the heaviest queries: ask for them first */
    const heat = dataChanged ? drawHeatmaps(detail, factsReady) : { fetched: Promise.resolve(), drawn: Promise.resolve() };
    const ready = heat.drawn.then(() => {
      if (dataChanged && !window.fp8guardReady) window.fp8guardReadyAt = performance.now();
      window.fp8guardReady = true;
    });
    const [facts, scalars] = await Promise.all([factsReady, fetchScalars(detail)]);
    state.facts = facts;
    state.gap = F.harm.summary(F.harm.probes(scalars.gap));
    await plotlyReady;
    const smallKey = [facts.findings.length, facts.actions.map((a) => a.status).join(","), facts.events.length].join("|");
    const marksChanged = smallKey !== state.smallKey;
    state.smallKey = smallKey;
    drawStory(detail, facts);
    if (marksChanged || dataChanged) F.tables.draw(facts);
    const jobs = [ready];
    if (dataChanged || marksChanged) jobs.push(drawScalars(scalars, facts), drawGap(scalars, facts), drawStrip(detail, facts));
    if (dataChanged && (first || !document.getElementById("tensor-pick").value)) fillPickers(detail, state.tensors, facts.findings);
    if (dataChanged || marksChanged) jobs.push(drawSeries());
    await Promise.all(jobs);
    if (first) window.fp8guardAllDrawnAt = performance.now();
  }

  document.getElementById("tensor-pick").addEventListener("change", () => drawSeries().catch(F.showError));
  document.getElementById("stat-pick").addEventListener("change", () => drawSeries().catch(F.showError));
  refresh(true).then(() => F.setLive("live, updated " + new Date().toLocaleTimeString()))
    .catch((e) => { F.showError(e); window.fp8guardError = String(e); });
  F.every(() => refresh(false));
})();
