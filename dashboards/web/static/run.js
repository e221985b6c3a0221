/* Run page: scalars with findings/actions/rollbacks, per-tensor heatmaps, scale timeline, tables.
   Sets window.fp8guardReady once the heatmaps have rendered (bench/page_load.py waits on it). */
"use strict";
(function () {
  const F = window.FP8;
  const { api, el, clear, fmt, ptext, colors } = F;
  const runId = document.body.dataset.runId;
  const base = "/v1/runs/" + encodeURIComponent(runId);
  const HEATMAPS = [
    { stat: "amax", div: "hm-amax", log: true, scale: "Viridis", unit: "amax (absolute max)" },
    { stat: "saturation", div: "hm-saturation", log: false, scale: "Cividis", unit: "saturation ratio" },
    { stat: "overflows", div: null, log: false, scale: "Viridis", unit: "overflow count", title: "Overflows per tensor" },
    { stat: "underflows", div: null, log: false, scale: "Cividis", unit: "underflow count", title: "Underflows per tensor" },
  ];
  const SEV = { critical: colors.vermillion, warning: colors.orange, info: colors.grey };
  const ACT = { fallback: colors.blue, promote: colors.green, rollback: colors.purple, alert: colors.grey };
  /* run.js loads before plotly.min.js (both deferred), so the heavy queries start while the
     browser is still parsing plotly; drawing waits for it. */
  const plotlyReady = window.Plotly ? Promise.resolve() : new Promise((resolve) => {
    /* deferred scripts run before DOMContentLoaded, in document order */
    document.addEventListener("DOMContentLoaded", () => resolve(), { once: true });
  });
  const state = { detail: null, key: null, smallKey: null, tensors: null, order: null };

  /* ---------- ordering: tensors grouped by module, modules in order of first appearance ---------- */
  function groupOrder(tensors) {
    const first = new Map();
    for (const t of tensors) { const m = t.module || t.name; if (!first.has(m)) first.set(m, t.index); }
    const idx = tensors.map((t, i) => i);
    idx.sort((a, b) => {
      const ta = tensors[a], tb = tensors[b];
      const ma = first.get(ta.module || ta.name), mb = first.get(tb.module || tb.name);
      return ma - mb || ta.index - tb.index;
    });
    return idx;
  }

  /* ---------- markers: findings and actions as vertical-line traces on a hidden [0, 1] axis (one trace
     per kind, cheap even for hundreds of markers) with hover text; rollbacks as shaded rectangles ---------- */
  function markerTraces(findings, actions) {
    const groups = new Map();
    const add = (key, name, color, dash, x, hover) => {
      if (!groups.has(key)) groups.set(key, { name, color, dash, lx: [], ly: [], px: [], ph: [] });
      const g = groups.get(key);
      g.lx.push(x, x, null); g.ly.push(0, 1, null); g.px.push(x); g.ph.push(hover);
    };
    for (const f of findings) add("f-" + f.severity, "finding: " + f.severity, SEV[f.severity] || colors.grey, "dot", f.step,
      ptext("step " + f.step + ": " + f.rule + " [" + f.severity + "]") + "<br>" + ptext(f.explanation).slice(0, 300));
    for (const a of actions) {
      if (a.kind === "alert") continue;
      const x = a.applied_step !== null && a.applied_step !== undefined ? a.applied_step : a.step;
      add("a-" + a.kind, "action: " + a.kind, ACT[a.kind] || colors.grey, "dash", x,
        ptext(a.kind + " (" + a.status + "), decided at step " + a.step + ", applied at " + x) + "<br>" + ptext(a.reason).slice(0, 300));
    }
    const traces = [];
    for (const g of groups.values()) {
      traces.push({ type: "scatter", mode: "lines", x: g.lx, y: g.ly, yaxis: "y2", name: g.name, legendgroup: g.name,
        line: { color: g.color, dash: g.dash, width: 1.2 }, hoverinfo: "skip" });
      traces.push({ type: "scatter", mode: "markers", x: g.px, y: g.px.map(() => 1), yaxis: "y2", name: g.name,
        legendgroup: g.name, showlegend: false, marker: { color: g.color, size: 8, symbol: "triangle-down" },
        text: g.ph, hovertemplate: "%{text}<extra></extra>" });
    }
    return traces;
  }

  function rollbackShapes(rollbacks) {
    const shapes = [];
    for (const e of rollbacks) {
      const from = e.data && e.data.checkpoint_step;
      if (from === null || from === undefined || e.step === null) continue;
      shapes.push({ type: "rect", xref: "x", yref: "paper", x0: from, x1: e.step, y0: 0, y1: 1,
        fillcolor: colors.grey, opacity: 0.12, line: { width: 0 }, layer: "below" });
    }
    return shapes;
  }

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

  async function drawScalars(detail, findings, actions, rollbacks) {
    const lossDiv = document.getElementById("loss"), gradDiv = document.getElementById("grad");
    const width = F.widthOf(lossDiv) - 80;
    const lastSegment = Math.max(0, ...detail.ranks.filter((r) => r.rank === 0).map((r) => r.last_segment));
    const segs = [];
    for (let s = 0; s < lastSegment; s++) segs.push(s);
    const [eff, ...abandoned] = await Promise.all([
      api(base + "/scalars", { fields: "loss,grad_norm", width }),
      ...segs.map((s) => api(base + "/scalars", { fields: "loss,grad_norm", width, segment: s })),
    ]);
    const marks = markerTraces(findings, actions), shapes = rollbackShapes(rollbacks);
    for (const [field, div, label, color] of [["loss", lossDiv, "loss", colors.blue], ["grad_norm", gradDiv, "grad norm", colors.green]]) {
      const traces = [];
      abandoned.forEach((seg, i) => {
        const s = segs[i];
        const rb = rollbacks.find((e) => e.segment === s && e.data && e.data.checkpoint_step !== null && e.data.checkpoint_step !== undefined);
        const cut = rb ? rb.data.checkpoint_step : -1;
        const keep = seg.steps.map((x, j) => j).filter((j) => seg.steps[j] >= cut);
        const sub = { bucket: seg.bucket, steps: keep.map((j) => seg.steps[j]),
          min: { [field]: keep.map((j) => seg.min[field][j]) }, max: { [field]: keep.map((j) => seg.max[field][j]) } };
        traces.push(...bandTraces(sub, field, "abandoned, segment " + s, colors.grey,
          { line: { color: colors.grey, width: 1.2, dash: "dash" }, fill: "none" }));
      });
      traces.push(...bandTraces(eff, field, label, color), ...marks);
      const layout = F.baseLayout({ shapes, margin: { l: 60, r: 20, t: 30, b: 40 },
        yaxis: { title: { text: label }, zeroline: false },
        yaxis2: { overlaying: "y", range: [0, 1.04], visible: false, fixedrange: true }, uirevision: "keep" });
      await Plotly.react(div, traces, layout, F.plotConfig);
    }
  }

  /* ---------- heatmaps ----------
     Plotly's heatmap trace costs ~300 ms for 1M cells (cleaning z, colouring, PNG). Instead the cells
     are coloured here straight from the base64 max plane into a canvas, shown as a layout image in
     data coordinates (so zoom/pan keep working), with a cheap hover handler of our own. data[0]
     keeps the (hidden) heatmap trace: z holds the plotted values, one Float32Array view per row.
     The min plane is never decoded as a whole: single cells are read from base64 when needed. */
  const SCALES = {
    Viridis: [[0, "#440154"], [0.06274509803921569, "#48186a"], [0.12549019607843137, "#472d7b"], [0.18823529411764706, "#424086"],
      [0.25098039215686274, "#3b528b"], [0.3137254901960784, "#33638d"], [0.3764705882352941, "#2c728e"], [0.4392156862745098, "#26828e"],
      [0.5019607843137255, "#21918c"], [0.5647058823529412, "#1fa088"], [0.6274509803921569, "#28ae80"], [0.6901960784313725, "#3fbc73"],
      [0.7529411764705882, "#5ec962"], [0.8156862745098039, "#84d44b"], [0.8784313725490196, "#addc30"], [0.9411764705882353, "#d8e219"],
      [1, "#fde725"]],
    Cividis: [[0, "rgb(0,32,76)"], [0.058824, "rgb(0,42,102)"], [0.117647, "rgb(0,52,110)"], [0.176471, "rgb(39,63,108)"],
      [0.235294, "rgb(60,74,107)"], [0.294118, "rgb(76,85,107)"], [0.352941, "rgb(91,95,109)"], [0.411765, "rgb(104,106,112)"],
      [0.470588, "rgb(117,117,117)"], [0.529412, "rgb(131,129,120)"], [0.588235, "rgb(146,140,120)"], [0.647059, "rgb(161,152,118)"],
      [0.705882, "rgb(176,165,114)"], [0.764706, "rgb(192,177,109)"], [0.823529, "rgb(209,191,102)"], [0.882353, "rgb(225,204,92)"],
      [0.941176, "rgb(243,219,79)"], [1, "rgb(255,233,69)"]],
  };
  const NO_DATA = [230, 230, 230], LUT_N = 1024;

  function parseColor(c) {
    if (c[0] === "#") return [parseInt(c.slice(1, 3), 16), parseInt(c.slice(3, 5), 16), parseInt(c.slice(5, 7), 16)];
    return c.slice(c.indexOf("(") + 1, c.indexOf(")")).split(",").map(Number);
  }

  /* colour lookup table, packed RGBA (little-endian ABGR words for a Uint32Array over ImageData) */
  const lutCache = new Map();
  function lut(name) {
    if (lutCache.has(name)) return lutCache.get(name);
    const stops = SCALES[name].map(([f, c]) => [f, parseColor(c)]);
    const out = new Uint32Array(LUT_N);
    let k = 0;
    for (let i = 0; i < LUT_N; i++) {
      const f = i / (LUT_N - 1);
      while (k < stops.length - 2 && f > stops[k + 1][0]) k++;
      const [f0, c0] = stops[k], [f1, c1] = stops[k + 1];
      const t = f1 > f0 ? Math.min(1, Math.max(0, (f - f0) / (f1 - f0))) : 0;
      const ch = (j) => Math.round(c0[j] + (c1[j] - c0[j]) * t);
      out[i] = (255 << 24 | ch(2) << 16 | ch(1) << 8 | ch(0)) >>> 0;
    }
    lutCache.set(name, out);
    return out;
  }
  const pack = (rgb) => (255 << 24 | rgb[2] << 16 | rgb[1] << 8 | rgb[0]) >>> 0;

  /* one float32 cell out of a base64 plane, decoding only the 8 characters that hold it */
  function cellF32(b64, i) {
    const byte = i * 4, g = Math.floor(byte / 3);
    const bin = atob(b64.slice(g * 4, g * 4 + 12));
    const off = byte - g * 3, buf = new Uint8Array(4);
    for (let j = 0; j < 4; j++) buf[j] = bin.charCodeAt(off + j);
    return new Float32Array(buf.buffer)[0];
  }

  function canvasBlobUrl(canvas) {
    return new Promise((resolve) => {
      if (canvas.toBlob) canvas.toBlob((b) => resolve(b ? URL.createObjectURL(b) : canvas.toDataURL()), "image/png");
      else resolve(canvas.toDataURL());
    });
  }

  async function heatmapFigure(m, spec, order) {
    const T = m.tensors.length, C = m.steps.length;
    const mx = F.decodeF32(m.max);
    /* pass 1: colour range over finite cells (no data: max = -inf, which is not finite either) */
    let lo = Infinity, hi = -Infinity;
    for (let i = 0, n = mx.length; i < n; i++) {
      const v = mx[i];
      if (!(v - v === 0)) continue;                          /* NaN / +-Inf */
      const zv = spec.log ? (v > 0 ? Math.log10(v) : -Infinity) : v;
      if (zv > hi) hi = zv;
      if (zv < lo && zv !== -Infinity) lo = zv;
    }
    if (!Number.isFinite(lo)) { lo = 0; hi = 1; }
    if (hi <= lo) hi = lo + 1;
    /* pass 2: pixels, one per cell, rows in display (module) order */
    const table = lut(spec.scale), grey = pack(NO_DATA), verm = pack(parseColor(colors.vermillion));
    const canvas = document.createElement("canvas");
    canvas.width = Math.max(1, C); canvas.height = Math.max(1, T);
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(canvas.width, canvas.height);
    const px = new Uint32Array(img.data.buffer);
    const scale = (LUT_N - 1) / (hi - lo);
    const z = new Array(T), y = new Array(T);
    for (let r = 0; r < T; r++) {
      const t = order[r], off = t * C, base = r * C;
      const raw = mx.subarray(off, off + C);
      for (let c = 0; c < C; c++) {
        const v = raw[c];
        let p;
        if (v - v === 0) {
          const zv = spec.log ? (v > 0 ? Math.log10(v) : lo) : v;
          p = table[Math.min(LUT_N - 1, Math.max(0, Math.round((zv - lo) * scale)))];
        } else if (v === -Infinity && cellF32(m.min, off + c) > v) p = grey;   /* min > max: no data */
        else p = verm;                                                             /* NaN / Inf seen */
        px[base + c] = p;
      }
      z[r] = raw;
      y[r] = m.tensors[t].name;
    }
    ctx.putImageData(img, 0, 0);
    const source = await canvasBlobUrl(canvas);
    const x = m.steps, b = Math.max(1, m.bucket);
    const x0 = C ? x[0] : 0, x1 = C ? x[C - 1] + b : 1;
    const showNames = T <= 60;
    const traces = [
      /* the data (hidden: drawn by the image below, hovered by attachHover) */
      { type: "heatmap", x, y: y.map((s, i) => i), z, visible: false, name: spec.stat, hoverinfo: "skip" },
      /* colour bar only */
      { type: "scatter", mode: "markers", x: [null], hoverinfo: "skip", showlegend: false,
        marker: { color: [lo], colorscale: SCALES[spec.scale], cmin: lo, cmax: hi, showscale: true,
          colorbar: { title: { text: spec.log ? "log10 " + spec.stat : spec.stat, side: "right" }, thickness: 12 } } },
    ];
    const layout = F.baseLayout({
      showlegend: false, margin: { l: showNames ? 260 : 60, r: 20, t: 10, b: 40 },
      xaxis: { title: { text: "step" }, zeroline: false, showgrid: false, range: [x0, x1] },
      yaxis: { range: [T - 0.5, -0.5], showgrid: false, zeroline: false, showticklabels: showNames,
        tickvals: showNames ? y.map((s, i) => i) : undefined, ticktext: showNames ? y.map(ptext) : undefined,
        title: { text: showNames ? "" : T + " tensors (hover for names)" }, automargin: false, tickfont: { size: 10 } },
      images: [{ source, xref: "x", yref: "y", x: x0, y: -0.5, sizex: x1 - x0, sizey: T, sizing: "stretch",
        xanchor: "left", yanchor: "top", layer: "below" }],
      plot_bgcolor: "#e6e6e6", uirevision: "keep",
    });
    return { traces, layout, source, hover: { m, spec, order, names: y, raw: mx } };
  }

  /* tooltip: cell under the pointer from the axes' current ranges; text via textContent only */
  function attachHover(div) {
    if (div.fp8Hover) return;
    const tip = el("div", { class: "hm-tip", role: "tooltip" });
    tip.hidden = true;
    div.style.position = "relative";
    div.appendChild(tip);
    div.fp8Hover = { tip, info: null };
    const hide = () => { tip.hidden = true; };
    div.addEventListener("mouseleave", hide);
    div.addEventListener("mousemove", (ev) => {
      const h = div.fp8Hover.info, fl = div._fullLayout;
      if (!h || !fl || !fl.xaxis || !fl._size) return hide();
      const rect = div.getBoundingClientRect();
      const px = ev.clientX - rect.left - fl._size.l, py = ev.clientY - rect.top - fl._size.t;
      if (px < 0 || py < 0 || px > fl._size.w || py > fl._size.h) return hide();
      const xv = fl.xaxis.p2l(px), yv = fl.yaxis.p2l(py);
      const { m, spec, order, names, raw } = h;
      const T = m.tensors.length, C = m.steps.length, steps = m.steps;
      const r = Math.round(yv);
      if (r < 0 || r >= T || !C || xv < steps[0] || xv >= steps[C - 1] + Math.max(1, m.bucket)) return hide();
      let a = 0, b = C - 1;                                  /* last column starting at or before xv */
      while (a < b) { const mid = (a + b + 1) >> 1; if (steps[mid] <= xv) a = mid; else b = mid - 1; }
      const i = order[r] * C + a, vmax = raw[i], vmin = cellF32(m.min, i);
      const stepText = "step " + steps[a] + (m.bucket > 1 ? " to " + (steps[a] + m.bucket - 1) : "");
      const lines = [names[r], stepText];
      if (vmin > vmax) lines.push(spec.unit + ": no data");
      else {
        lines.push(spec.unit + " (bucket max): " + exact(vmax), "bucket min: " + exact(vmin));
        if (!Number.isFinite(vmax) || !Number.isFinite(vmin)) lines.push("NaN or Inf seen");
      }
      tip.textContent = lines.join("\n");
      tip.hidden = false;
      const x = ev.clientX - rect.left, y = ev.clientY - rect.top;
      tip.style.left = (x + 14 + 260 > rect.width ? Math.max(0, x - 274) : x + 14) + "px";
      tip.style.top = Math.max(0, y - 10) + "px";
    });
  }

  /* float32 shown exactly enough to round-trip (9 significant digits at most, trailing zeros cut) */
  function exact(v) {
    if (!Number.isFinite(v)) return String(v);
    if (v === 0) return "0";
    for (let d = 6; d <= 9; d++) { const s = Number(v.toPrecision(d)); if (Math.fround(s) === v) return String(s); }
    return String(v);
  }

  function drawHeatmaps(detail) {
    const extra = document.getElementById("extra-heatmaps");
    const jobs = [];
    for (const spec of HEATMAPS) {
      if (!detail.stats.includes(spec.stat)) continue;
      let div = spec.div ? document.getElementById(spec.div) : document.getElementById("hm-" + spec.stat);
      if (!div) {
        extra.appendChild(el("h2", { text: spec.title + " (max over each step bucket)" }));
        div = el("div", { id: "hm-" + spec.stat, class: "plot tall" });
        extra.appendChild(div);
      }
      const width = F.widthOf(div) - 100;
      jobs.push(api(base + "/matrix", { stat: spec.stat, encoding: "base64", width }).then((m) => ({ m, spec, div })));
    }
    for (const spec of HEATMAPS) {
      if (spec.div && !detail.stats.includes(spec.stat)) {
        const div = document.getElementById(spec.div);
        clear(div); div.appendChild(el("p", { class: "note", text: "This run reports no " + spec.stat + " statistic." }));
      }
    }
    const fetched = Promise.all(jobs);
    /* each heatmap draws as soon as its own matrix is in (first on the page first) */
    const drawn = Promise.all(jobs.map((job) => job.then(async ({ m, spec, div }) => {
      if (!state.order || state.order.length !== m.tensors.length) state.order = groupOrder(m.tensors);
      const fig = await heatmapFigure(m, spec, state.order);
      await plotlyReady;
      const old = div.fp8Source;
      await Plotly.react(div, fig.traces, fig.layout, F.plotConfig);
      div.fp8Source = fig.source;
      if (old && old !== fig.source && old.startsWith("blob:")) URL.revokeObjectURL(old);
      attachHover(div);
      div.fp8Hover.info = fig.hover;
    })));
    return { fetched, drawn };
  }

  /* ---------- scale timeline ---------- */
  async function drawSeries() {
    const tSel = document.getElementById("tensor-pick"), sSel = document.getElementById("stat-pick");
    if (!tSel.value || !sSel.value) return;
    const div = document.getElementById("scale");
    const s = await api(base + "/tensors/" + encodeURIComponent(tSel.value) + "/series",
      { stat: sSel.value, width: F.widthOf(div) - 80 });
    const series = { bucket: s.bucket, steps: s.steps, min: { v: s.min }, max: { v: s.max } };
    const traces = bandTraces(series, "v", s.stat, colors.blue);
    const layout = F.baseLayout({ yaxis: { title: { text: s.stat }, zeroline: false },
      annotations: [{ xref: "paper", yref: "paper", x: 0, y: 1, yanchor: "bottom", showarrow: false,
        text: ptext(s.tensor.name), font: { size: 11 } }], margin: { l: 60, r: 20, t: 24, b: 40 } });
    await Plotly.react(div, traces, layout, F.plotConfig);
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

  /* ---------- tables ---------- */
  function compact(obj) {
    if (obj === null || obj === undefined) return "";
    const s = JSON.stringify(obj);
    return s.length > 600 ? s.slice(0, 600) + "..." : s;
  }

  function drawTables(findings, actions, agentEvents, precision, checkpoints) {
    const rows = [];
    for (const f of findings) rows.push({ step: f.step, order: 0, source: "finding",
      what: el("span", { class: "sev-" + f.severity, text: f.rule + " [" + f.severity + "]" }),
      text: f.explanation + (f.onset_step !== null && f.onset_step !== undefined ? " (onset step " + f.onset_step + ")" : ""),
      evidence: compact(Object.assign({ modules: f.modules }, f.evidence || {})) });
    for (const a of actions) rows.push({ step: a.step, order: 1, source: "decision",
      what: el("span", { text: a.kind + " (" + a.status + ")" + (a.applied_step !== null && a.applied_step !== undefined ? ", applied at " + a.applied_step : "") }),
      text: a.reason + (a.error ? " error: " + a.error : ""), evidence: compact(a.payload) });
    for (const e of agentEvents) {
      if (e.kind === "guard_changed") {  /* the service's audit trail: who changed the run's guard, old -> new */
        const before = e.data.old || {}, after = e.data.new || {};
        const keys = [...new Set([...Object.keys(before), ...Object.keys(after)])].filter((k) => JSON.stringify(before[k]) !== JSON.stringify(after[k]));
        rows.push({ step: e.step, order: 2, source: "audit", what: el("span", { text: "guard changed by " + e.data.by }),
          text: keys.map((k) => k + ": " + (k in before ? JSON.stringify(before[k]) : "default") + " -> " + (k in after ? JSON.stringify(after[k]) : "default")).join("; "),
          evidence: compact(e.data) });
        continue;
      }
      rows.push({ step: e.step, order: 2, source: "agent",
        what: el("span", { text: e.kind }), text: "segment " + e.segment + ", rank " + e.rank, evidence: compact(e.data) });
    }
    rows.sort((a, b) => (a.step || 0) - (b.step || 0) || a.order - b.order);
    const tb = clear(document.querySelector("#timeline tbody"));
    for (const r of rows) tb.appendChild(el("tr", {}, el("td", { class: "num", text: r.step === null ? "-" : r.step }),
      el("td", { text: r.source }), el("td", {}, r.what), el("td", { text: r.text }), el("td", { class: "evidence", text: r.evidence })));
    if (!rows.length) tb.appendChild(el("tr", {}, el("td", { colspan: 5, class: "note", text: "No findings or actions." })));

    const pb = clear(document.querySelector("#precision tbody"));
    for (const p of precision) pb.appendChild(el("tr", {}, el("td", { text: p.module }),
      el("td", {}, el("span", { class: "prec-" + String(p.precision).toLowerCase(), text: String(p.precision).toUpperCase() })),
      el("td", { class: "num", text: p.since_step === null ? "-" : p.since_step })));
    if (!precision.length) pb.appendChild(el("tr", {}, el("td", { colspan: 3, class: "note", text: "Every module in FP8 (no switches)." })));

    const cb = clear(document.querySelector("#checkpoints tbody"));
    for (const c of checkpoints) cb.appendChild(el("tr", {}, el("td", { class: "num", text: c.step }),
      el("td", { class: "num", text: c.segment }), el("td", { class: "num", text: c.rank }),
      el("td", { text: c.known_good ? "yes (known good)" : "no" }), el("td", { class: "evidence", text: c.path || "" })));
    if (!checkpoints.length) cb.appendChild(el("tr", {}, el("td", { colspan: 5, class: "note", text: "No checkpoints reported." })));
  }

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

  /* ---------- refresh loop ---------- */
  async function refresh(first) {
    const detail = await api(base);
    drawSummary(detail);
    const key = [detail.last_step, detail.samples, detail.status, detail.num_tensors, detail.stats.join(",")].join("|");
    const dataChanged = key !== state.key;
    state.key = key;
    /* the heatmaps' matrices are the heaviest queries: ask for them first, the rest once they are in */
    const heat = dataChanged ? drawHeatmaps(detail) : { fetched: Promise.resolve(), drawn: Promise.resolve() };
    const ready = heat.drawn.then(() => {
      if (dataChanged && !window.fp8guardReady) window.fp8guardReadyAt = performance.now();
      window.fp8guardReady = true;
    });
    await heat.fetched;
    await plotlyReady;
    const [findings, actions, precision, checkpoints, events] = await Promise.all([
      api(base + "/findings"), api(base + "/actions"), api(base + "/precision"), api(base + "/checkpoints"),
      api(base + "/events", { limit: 10000 }),
    ]);
    const rollbacks = events.filter((e) => e.kind === "rollback_applied");
    const agentEvents = events.filter((e) => ["rollback_applied", "fallback_applied", "promotion_applied", "guard_changed"].includes(e.kind));
    const smallKey = [findings.length, actions.map((a) => a.status).join(","), events.length].join("|");
    const marksChanged = smallKey !== state.smallKey;
    state.smallKey = smallKey;
    if (marksChanged || dataChanged) drawTables(findings, actions, agentEvents, precision, checkpoints);
    const jobs = [ready];
    if (dataChanged || marksChanged) jobs.push(drawScalars(detail, findings, actions, rollbacks));
    if (dataChanged && (first || !state.tensors || state.tensors.length !== detail.num_tensors)) {
      state.tensors = await api(base + "/tensors");
      fillPickers(detail, state.tensors, findings);
    }
    if (dataChanged) jobs.push(drawSeries());
    await Promise.all(jobs);
    if (first) window.fp8guardAllDrawnAt = performance.now();
  }

  document.getElementById("tensor-pick").addEventListener("change", () => drawSeries().catch(F.showError));
  document.getElementById("stat-pick").addEventListener("change", () => drawSeries().catch(F.showError));
  refresh(true).then(() => F.setLive("live, updated " + new Date().toLocaleTimeString()))
    .catch((e) => { F.showError(e); window.fp8guardError = String(e); });
  F.every(() => refresh(false));
})();
