/* Per-tensor heatmaps, drawn as a canvas (one pixel per cell) shown as a plotly layout image in
   data coordinates, so zoom and pan keep working; plotly's heatmap trace costs ~300 ms per 1M cells.

   What a cell shows:
   - a value, coloured through a percentile-clipped scale (one-step outliers such as the
     underflows of step 0 do not swamp it): amax as log10; saturation as log10 with 1 = the FP8
     maximum anchored at a fixed colour break (under 1 blue to pale, over 1 orange to red);
   - "absent" (light grey, hatched): the module ran in BF16 over the whole cell, so it has no FP8
     statistic (the agent reports amax 0.0 there, which is not a zero);
   - "no data" (pale grey), or NaN/Inf seen (vermillion);
   - count stats (overflows, underflows) are counted every Nth step only: each counted column
     stands for the steps up to the next count, so there are no zebra stripes of "no data".
   data[0] is a hidden heatmap trace that keeps the plotted values (z: one Float32Array per row). */
"use strict";
(function () {
  const F = window.FP8;
  const { el, ptext, colors } = F;
  const VIRIDIS = [[0, "#440154"], [0.0627, "#48186a"], [0.1255, "#472d7b"], [0.1882, "#424086"], [0.251, "#3b528b"],
    [0.3137, "#33638d"], [0.3765, "#2c728e"], [0.4392, "#26828e"], [0.502, "#21918c"], [0.5647, "#1fa088"], [0.6275, "#28ae80"],
    [0.6902, "#3fbc73"], [0.7529, "#5ec962"], [0.8157, "#84d44b"], [0.8784, "#addc30"], [0.9412, "#d8e219"], [1, "#fde725"]];
  const CIVIDIS = [[0, "#00204c"], [0.1176, "#00346e"], [0.2353, "#3c4a6b"], [0.3529, "#5b5f6d"], [0.4706, "#757575"],
    [0.5882, "#928c78"], [0.7059, "#b0a572"], [0.8235, "#d1bf66"], [0.9412, "#f3db4f"], [1, "#ffe945"]];
  const NO_DATA = [236, 236, 236], ABSENT = [196, 196, 196], LUT_N = 1024;
  const HATCH = "rgba(90,90,90,0.55)";

  function parseColor(c) {
    if (c[0] === "#") return [parseInt(c.slice(1, 3), 16), parseInt(c.slice(3, 5), 16), parseInt(c.slice(5, 7), 16)];
    return c.slice(c.indexOf("(") + 1, c.indexOf(")")).split(",").map(Number);
  }
  const pack = (rgb) => (255 << 24 | rgb[2] << 16 | rgb[1] << 8 | rgb[0]) >>> 0;

  /* colour lookup table, packed RGBA (little-endian ABGR words for a Uint32Array over ImageData) */
  function lut(stopsIn) {
    const stops = stopsIn.map(([f, c]) => [f, parseColor(c)]);
    const out = new Uint32Array(LUT_N);
    let k = 0;
    for (let i = 0; i < LUT_N; i++) {
      const f = i / (LUT_N - 1);
      while (k < stops.length - 2 && f > stops[k + 1][0]) k++;
      const [f0, c0] = stops[k], [f1, c1] = stops[k + 1];
      const t = f1 > f0 ? Math.min(1, Math.max(0, (f - f0) / (f1 - f0))) : 1;
      out[i] = pack([0, 1, 2].map((j) => Math.round(c0[j] + (c1[j] - c0[j]) * t)));
    }
    return out;
  }

  /* saturation: log10 colour, the break at log10(1) = 0 */
  function saturationStops(lo, hi) {
    const b = Math.min(0.98, Math.max(0.02, (0 - lo) / (hi - lo)));
    return [[0, "#00204c"], [b * 0.5, "#4f5b7a"], [b, "#dcdcd6"], [b, "#f6cf9a"], [b + (1 - b) * 0.4, "#E69F00"], [1, "#b32800"]];
  }

  /* one float32 cell out of a base64 plane, decoding only the characters that hold it */
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

  /* p-quantiles of up to 200k evenly spread samples */
  function quantiles(values, ps) {
    if (!values.length) return ps.map(() => null);
    const step = Math.max(1, Math.floor(values.length / 200000));
    const s = [];
    for (let i = 0; i < values.length; i += step) s.push(values[i]);
    s.sort((a, b) => a - b);
    return ps.map((p) => s[Math.min(s.length - 1, Math.max(0, Math.round(p * (s.length - 1))))]);
  }

  /* count stats: column -> the counted column it stands for (itself, the last one before it, or -1) */
  function heldColumns(m, held) {
    const C = m.steps.length, src = new Int32Array(C);
    let last = -1;
    for (let c = 0; c < C; c++) { if (!held || m.present[c]) last = c; src[c] = held ? last : c; }
    return src;
  }

  /* hatched rectangles over the absent cells: runs per row, rows with the same runs merged */
  function absentTrace(mask, m, T) {
    const C = m.steps.length, b = Math.max(1, m.bucket), xs = [], ys = [];
    const runsOf = (r) => {
      const runs = [];
      for (let c = 0; c < C; c++) if (mask[r * C + c] && (c === 0 || !mask[r * C + c - 1])) {
        let e = c; while (e + 1 < C && mask[r * C + e + 1]) e++;
        runs.push([m.steps[c], m.steps[e] + b]);
      }
      return runs;
    };
    let r = 0;
    while (r < T) {
      const runs = runsOf(r), key = JSON.stringify(runs);
      let e = r; while (e + 1 < T && JSON.stringify(runsOf(e + 1)) === key) e++;
      for (const [x0, x1] of runs) { xs.push(x0, x1, x1, x0, x0, null); ys.push(r - 0.5, r - 0.5, e + 0.5, e + 0.5, r - 0.5, null); }
      r = e + 1;
    }
    if (!xs.length) return null;
    return { type: "scatter", mode: "lines", x: xs, y: ys, fill: "toself", fillcolor: "rgba(0,0,0,0)", line: { width: 0.6, color: HATCH },
      fillpattern: { shape: "/", fgcolor: HATCH, bgcolor: "rgba(0,0,0,0)", size: 7, solidity: 0.15 },
      hoverinfo: "skip", showlegend: false, name: "absent (BF16)" };
  }

  /* spec: { stat, kind: "log" | "saturation" | "count", unit }; ctx: { absent (mask), xRange, marks, shapes, margin } */
  async function figure(m, spec, order, ctx) {
    const T = m.tensors.length, C = m.steps.length;
    const mx = F.decodeF32(m.max);
    const src = heldColumns(m, spec.kind === "count");
    const absent = ctx.absent;
    const zOf = spec.kind === "count" ? (v) => v : (v) => (v > 0 ? Math.log10(v) : -Infinity);
    /* colour range: quantiles over the finite, present, non-absent cells; for counts, not over the
       run's first column either (step 0's underflows of a fresh model would swamp the scale) */
    const skipFirst = spec.kind === "count" && C > 1 && ctx.xRange && m.steps[0] <= ctx.xRange[0] ? 1 : 0;
    const vals = [];
    for (let r = 0; r < T; r++) {
      const off = order[r] * C;
      for (let c = skipFirst; c < C; c++) {
        if (absent[r * C + c] || src[c] !== c) continue;
        const zv = zOf(mx[off + c]);
        if (zv - zv === 0) vals.push(zv);
      }
    }
    let [lo, hi] = spec.kind === "count" ? [0, quantiles(vals, [0.99])[0]] : quantiles(vals, [0.01, 0.995]);
    if (spec.kind === "count" && !(hi > 0)) { hi = 1; for (const v of vals) if (v > hi) hi = v; }
    if (lo === null || !Number.isFinite(lo)) { lo = spec.kind === "saturation" ? -2 : 0; hi = lo + 1; }
    if (spec.kind === "saturation") { lo = Math.min(lo, -1); hi = Math.max(hi, Math.log10(2)); }
    if (!(hi > lo)) hi = lo + 1;
    let top = -Infinity;
    for (const v of vals) if (v > top) top = v;
    const stops = spec.kind === "saturation" ? saturationStops(lo, hi) : spec.kind === "count" ? CIVIDIS : VIRIDIS;
    const table = lut(stops), grey = pack(NO_DATA), gone = pack(ABSENT), verm = pack(parseColor(colors.vermillion));
    const canvas = document.createElement("canvas");
    canvas.width = Math.max(1, C); canvas.height = Math.max(1, T);
    const g2 = canvas.getContext("2d");
    const img = g2.createImageData(canvas.width, canvas.height);
    const px = new Uint32Array(img.data.buffer);
    const scale = (LUT_N - 1) / (hi - lo);
    const z = new Array(T), y = new Array(T);
    for (let r = 0; r < T; r++) {
      const off = order[r] * C, row = r * C;
      for (let c = 0; c < C; c++) {
        const s = src[c];
        let p;
        if (absent[row + c]) p = gone;
        else if (s < 0) p = grey;
        else {
          const v = mx[off + s];
          if (v - v === 0) {
            const zv = zOf(v);
            p = table[zv === -Infinity ? 0 : Math.min(LUT_N - 1, Math.max(0, Math.round((zv - lo) * scale)))];
          } else if (v === -Infinity && cellF32(m.min, off + s) > v) p = grey;   /* min > max: no data */
          else p = verm;                                                           /* NaN / Inf seen */
        }
        px[row + c] = p;
      }
      z[r] = mx.subarray(off, off + C);
      y[r] = m.tensors[order[r]].name;
    }
    g2.putImageData(img, 0, 0);
    const source = await canvasBlobUrl(canvas);
    const b = Math.max(1, m.bucket);
    const x0 = C ? m.steps[0] : 0, x1 = C ? m.steps[C - 1] + b : 1;
    const showNames = T <= 60;
    const bar = { title: { text: spec.legend, side: "right" }, thickness: 12, x: 1.01, xpad: 4 };
    if (spec.kind !== "count") {
      const ticks = [];
      for (let e = Math.ceil(lo); e <= Math.floor(hi); e++) ticks.push(e);
      if (ticks.length < 3) {
        ticks.length = 0;
        for (let i = 0; i <= 4; i++) ticks.push(lo + (hi - lo) * i / 4);
        if (spec.kind === "saturation") ticks.splice(0, ticks.length, ...ticks.filter((t) => Math.abs(t) > (hi - lo) / 8), 0);
      }
      const label = (e) => (Number.isInteger(e) ? (e >= -3 && e <= 4 ? String(10 ** e) : "1e" + e) : F.fmt(10 ** e, 3));
      bar.tickvals = ticks;
      bar.ticktext = ticks.map((e) => (spec.kind === "saturation" && e === 0 ? "1 = FP8 max" : label(e)));
    }
    if (top > hi) {  /* clipped: the top colour means "this much or more" */
      if (!bar.tickvals) { bar.tickmode = "array"; bar.tickvals = [0, hi / 2]; bar.ticktext = ["0", F.fmt(hi / 2, 3)]; }
      const keep = bar.tickvals.map((t, i) => [t, bar.ticktext[i]]).filter(([t]) => t < hi - (hi - lo) / 10);
      bar.tickvals = keep.map(([t]) => t).concat([hi]);
      bar.ticktext = keep.map(([, l]) => l).concat([">= " + (spec.kind === "count" ? F.fmt(hi, 3) : F.fmt(10 ** hi, 3))]);
    }
    const traces = [
      { type: "heatmap", x: m.steps, y: y.map((s, i) => i), z, visible: false, name: spec.stat, hoverinfo: "skip" },
      { type: "scatter", mode: "markers", x: [null], hoverinfo: "skip", showlegend: false,
        marker: { color: [lo], colorscale: stops, cmin: lo, cmax: hi, showscale: true, colorbar: bar } },
    ];
    const hatch = absentTrace(absent, m, T);
    if (hatch) traces.push(hatch);
    traces.push(...ctx.marks);
    const layout = F.baseLayout({
      showlegend: false, margin: Object.assign({}, ctx.margin, { t: 10 }),
      xaxis: { title: { text: "step" }, zeroline: false, showgrid: false, range: ctx.xRange || [x0, x1] },
      yaxis: { range: [T - 0.5, -0.5], showgrid: false, zeroline: false, showticklabels: showNames,
        tickvals: showNames ? y.map((s, i) => i) : undefined, ticktext: showNames ? y.map(ptext) : undefined,
        title: { text: showNames ? "" : T + " tensors (hover for names)" }, automargin: false, tickfont: { size: 10 } },
      yaxis2: F.story.y2,
      images: [{ source, xref: "x", yref: "y", x: x0, y: -0.5, sizex: x1 - x0, sizey: T, sizing: "stretch",
        xanchor: "left", yanchor: "top", layer: "below" }],
      shapes: ctx.shapes, plot_bgcolor: "rgb(" + NO_DATA.join(",") + ")", uirevision: "keep",
    });
    return { traces, layout, source, canvas, hover: { m, spec, order, names: y, raw: mx, absent, src, range: [lo, hi] } };
  }

  /* float32 shown exactly enough to round-trip (9 significant digits at most, trailing zeros cut) */
  function exact(v) {
    if (!Number.isFinite(v)) return String(v);
    if (v === 0) return "0";
    for (let d = 6; d <= 9; d++) { const s = Number(v.toPrecision(d)); if (Math.fround(s) === v) return String(s); }
    return String(v);
  }

  /* what one cell (display row r, column c) says, as lines of text */
  function cellText(h, r, c) {
    const { m, spec, names, raw, absent, src } = h;
    const C = m.steps.length, b = Math.max(1, m.bucket);
    const lines = [names[r], "step " + m.steps[c] + (b > 1 ? " to " + (m.steps[c] + b - 1) : "")];
    if (absent[r * C + c]) { lines.push("module in BF16: no FP8 " + spec.stat + " (absent, not 0)"); return lines; }
    const s = src[c];
    if (s < 0) { lines.push(spec.unit + ": no data"); return lines; }
    if (s !== c) lines.push("counted at step " + m.steps[s] + " (counts are taken every few steps)");
    const i = h.order[r] * C + s, vmax = raw[i], vmin = cellF32(m.min, i);
    if (vmin > vmax) lines.push(spec.unit + ": no data");
    else {
      lines.push(spec.unit + " (bucket max): " + exact(vmax), "bucket min: " + exact(vmin));
      if (!Number.isFinite(vmax) || !Number.isFinite(vmin)) lines.push("NaN or Inf seen");
    }
    return lines;
  }

  /* column under a step value (last column starting at or before it), or -1 */
  function columnAt(m, xv) {
    const steps = m.steps, C = steps.length;
    if (!C || xv < steps[0] || xv >= steps[C - 1] + Math.max(1, m.bucket)) return -1;
    let a = 0, b = C - 1;
    while (a < b) { const mid = (a + b + 1) >> 1; if (steps[mid] <= xv) a = mid; else b = mid - 1; }
    return a;
  }

  /* tooltip: the cell under the pointer from the axes' current ranges; text via textContent only */
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
      const r = Math.round(fl.yaxis.p2l(py)), c = columnAt(h.m, fl.xaxis.p2l(px));
      if (r < 0 || r >= h.m.tensors.length || c < 0) return hide();
      tip.textContent = cellText(h, r, c).join("\n");
      tip.hidden = false;
      const x = ev.clientX - rect.left, y = ev.clientY - rect.top;
      tip.style.left = (x + 14 + 260 > rect.width ? Math.max(0, x - 274) : x + 14) + "px";
      tip.style.top = Math.max(0, y - 10) + "px";
    });
  }

  F.heatmap = { figure, attachHover, cellText, columnAt, NO_DATA, ABSENT };
})();
