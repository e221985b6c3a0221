/* The run's story: incidents in plain words (what happened, when, what fp8guard did, the outcome),
   built from findings, actions, the agent's applied events and the harm probe's events
   (harm_attributed: a bisection named the modules that carry FP8's cost; promotion_trial); and the
   incident markers that every chart on the run page carries (findings, actions, harm
   attributions, rollbacks). */
"use strict";
(function () {
  const F = window.FP8;
  const { colors, ptext, fmt } = F;
  const SEV = { critical: colors.vermillion, warning: colors.orange, info: colors.grey };
  const ACT = { fallback: colors.blue, promote: colors.green, rollback: colors.purple, page: colors.vermillion, alert: colors.grey };
  const SEV_RANK = { critical: 2, warning: 1, info: 0 };
  const has = (v) => v !== null && v !== undefined;
  const maxOf = (xs) => (Array.isArray(xs) && xs.length ? Math.max(...xs.map(Number).filter(Number.isFinite)) : null);

  /* "loss spike (z=9)", "amax growth (blocks.1.mlp_proj, 60x)" */
  function describe(f) {
    const e = f.evidence || {};
    const bits = [];
    if (f.modules && f.modules.length) bits.push(f.modules.length > 2 ? f.modules.slice(0, 2).join(", ") + " +" + (f.modules.length - 2) : f.modules.join(", "));
    if (has(e.z) && Number.isFinite(Number(e.z))) bits.push("z=" + fmt(e.z, 2));
    if (has(e.value) && has(e.median)) bits.push(fmt(e.value, 4) + " vs median " + fmt(e.median, 4));
    const growth = maxOf(e.growth_x), ratio = maxOf(e.ratios);
    if (growth !== null) bits.push(fmt(growth, 3) + "x growth");
    if (ratio !== null) bits.push(fmt(ratio, 3) + "x the FP8 maximum");
    if (has(e.count)) bits.push(e.count + " tensors");
    return f.rule.replace(/_/g, " ") + (bits.length ? " (" + bits.join(", ") + ")" : "");
  }

  function did(a) {
    const p = a.payload || {};
    const mods = Array.isArray(p.modules) && p.modules.length ? p.modules.join(", ") : "the whole model";
    if (a.kind === "rollback") {
      let s = "rollback to checkpoint " + p.checkpoint_step;
      if (p.skip_batches) s += ", skipping " + p.skip_batches + " batches";
      if (has(p.lr_scale) && Number(p.lr_scale) !== 1) s += ", LR x" + fmt(p.lr_scale, 3) + (p.lr_scale_steps ? " for " + p.lr_scale_steps + " steps" : "");
      return s;
    }
    if (a.kind === "fallback") return "BF16 fallback of " + mods + (p.escalation ? " (pinned)" : "");
    if (a.kind === "promote") return "re-promotion of " + mods + " to FP8";
    if (a.kind === "page") return "paged a person";
    return "alert only (no command)";
  }

  function status(a) {
    if (a.status === "applied") return "applied at " + (has(a.applied_step) ? a.applied_step : a.step);
    if (a.status === "recommended") return "recommended only (dry run)";
    if (a.status === "pending") return "waiting for the agent";
    if (a.status === "recorded") return "sent";
    return a.status + (a.error ? ": " + a.error : "");
  }

  /* first step >= from whose loss and the next 4 points lie at or under the pre-onset band */
  function backInBand(loss, onset, from) {
    if (!loss || !loss.steps.length) return null;
    const xs = loss.steps, ys = loss.values;
    const pre = [];
    for (let i = 0; i < xs.length; i++) if (xs[i] < onset && xs[i] >= onset - 50 && Number.isFinite(ys[i])) pre.push(ys[i]);
    if (pre.length < 5) return null;
    const med = median(pre), mad = median(pre.map((v) => Math.abs(v - med)));
    const hi = med + Math.max(4 * 1.4826 * mad, 0.02 * Math.abs(med));
    for (let i = 0; i < xs.length; i++) {
      if (xs[i] < from) continue;
      let ok = true;
      for (let j = i; j < Math.min(xs.length, i + 5); j++) if (!(ys[j] <= hi)) { ok = false; break; }
      if (ok && i + 5 <= xs.length) return { step: xs[i], hi };
      if (ok) return null;  /* too few points after it to tell */
    }
    return { step: null, hi };
  }
  function median(v) { const s = v.slice().sort((a, b) => a - b); const n = s.length; return n % 2 ? s[(n - 1) / 2] : (s[n / 2 - 1] + s[n / 2]) / 2; }

  /* -> [{ step, severity, what, did, outcome }] in step order; loss: {steps, values} (effective view);
     harm: the harm_attributed and promotion_trial events */
  function incidents(findings, actions, hist, loss, lastStep, harm) {
    const byId = new Map(findings.map((f) => [f.id, f]));
    const cited = new Set();
    const out = [];
    for (const a of actions) {
      const fs = a.finding_ids.map((i) => byId.get(i)).filter(Boolean);
      fs.forEach((f) => cited.add(f.id));
      if (a.kind === "alert" && !fs.length) continue;
      const first = fs.length ? Math.min(...fs.map((f) => f.onset_step)) : a.step;
      const sev = fs.reduce((s, f) => (SEV_RANK[f.severity] > SEV_RANK[s] ? f.severity : s), "info");
      const what = fs.length ? uniq(fs.map(describe)).join("; ") : a.reason;
      const applied = a.status === "applied" ? (has(a.applied_step) ? a.applied_step : a.step) : null;
      let outcome = "";
      if (a.kind === "rollback" && applied !== null) {
        const resume = ((a.payload || {}).checkpoint_step || 0) + 1;
        const band = backInBand(loss, first, resume);
        outcome = "resumed at step " + resume;
        if (band && band.step !== null) outcome += "; loss back in band (<= " + fmt(band.hi, 4) + ") by step " + band.step;
        else if (band) outcome += "; loss not back in band (<= " + fmt(band.hi, 4) + ") by step " + lastStep;
      } else if (a.kind === "fallback" && applied !== null) {
        const mods = (a.payload || {}).modules;
        const keys = Array.isArray(mods) && mods.length ? mods : [F.precision.WHOLE];
        const ends = keys.map((k) => (hist.stretches.get(k) || []).find((s) => s.from === applied + F.precision.APPLY_OFFSET))
          .filter(Boolean).map((s) => s.to);
        if (ends.length && ends.every((t) => t !== null)) outcome = "in BF16 until step " + (Math.max(...ends) - 1) + ", then FP8 again";
        else outcome = "still in BF16";
      } else if (a.kind === "promote" && applied !== null) outcome = "FP8 again from step " + (applied + F.precision.APPLY_OFFSET);
      out.push({ step: first, severity: a.kind === "promote" ? "info" : sev, what, did: did(a) + ", " + status(a), outcome, kind: a.kind });
    }
    /* findings no action cites: one line per rule and stretch (within 20 steps of each other) */
    const loose = findings.filter((f) => !cited.has(f.id)).sort((x, y) => x.rule.localeCompare(y.rule) || x.step - y.step);
    let group = null;
    const flush = () => { if (group) out.push(group.line()); group = null; };
    for (const f of loose) {
      if (group && group.rule === f.rule && f.step - group.last <= 20) { group.add(f); continue; }
      flush();
      group = { rule: f.rule, first: f.onset_step, last: f.step, items: [f], sev: f.severity,
        add(g) { this.items.push(g); this.last = g.step; if (SEV_RANK[g.severity] > SEV_RANK[this.sev]) this.sev = g.severity; },
        line() { return { step: this.first, severity: this.sev, kind: "none",
          what: describe(this.items[this.items.length - 1]) + (this.items.length > 1 ? " x" + this.items.length + " to step " + this.last : ""),
          did: "no action", outcome: "" }; } };
    }
    flush();
    out.push(...probeLines(harm || []));
    out.sort((x, y) => x.step - y.step);
    return out;
  }

  /* one line per bisection; promotion trials of one module set in a row as one line */
  function probeLines(events) {
    const out = [];
    let last = null;
    for (const e of events) {
      const d = e.data || {}, mods = Array.isArray(d.modules) ? d.modules : [];
      const names = mods.length > 3 ? mods.slice(0, 3).join(", ") + " +" + (mods.length - 3) : mods.join(", ") || "no modules";
      if (e.kind === "harm_attributed") {
        last = null;
        out.push({ step: has(d.probe_step) ? d.probe_step : e.step, severity: "warning", kind: "harm",
          what: "FP8 loss gap " + F.harm.pct(F.num(d.gap)) + " over its band (" + F.harm.pct(F.num(d.band_high)) + ")",
          did: "bisection" + (has(d.forwards) ? " (" + d.forwards + " forwards)" : "") + " at step " + e.step + " named " + names,
          outcome: "gap " + F.harm.pct(F.num(d.gap)) + " -> " + F.harm.pct(F.num(d.gap_after)) + " with them in BF16" });
      } else if (e.kind === "promotion_trial") {
        const key = names + "|" + Boolean(d.harmful);
        const verdict = (d.harmful ? "harmful, stays in BF16" : "no harm") + " (gap " + F.harm.pct(F.num(d.gap))
          + (d.harmful ? " > " : " <= ") + "band " + F.harm.pct(F.num(d.band_high)) + ")";
        if (last && last.key === key) { last.n++; last.line.what = "promotion trial of " + names + " x" + last.n + " to step " + e.step; last.line.outcome = "last: " + verdict; continue; }
        const line = { step: e.step, severity: d.harmful ? "warning" : "info", kind: "trial",
          what: "promotion trial of " + names, did: "tried back in FP8 inside the probe (training stays in BF16)", outcome: verdict };
        last = { key, n: 1, line };
        out.push(line);
      }
    }
    return out;
  }
  function uniq(xs) { return [...new Set(xs)]; }

  /* findings and actions as vertical lines on a hidden [0, 1] axis ("y2": one trace per kind, cheap
     even for hundreds), a marker at the top carries the hover text; rollbacks as shaded stretches */
  function markerTraces(findings, actions, opts) {
    const legend = !(opts && opts.legend === false);
    const harm = ((opts && opts.harm) || []).filter((e) => e.kind === "harm_attributed" && e.data);
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
      const x = has(a.applied_step) ? a.applied_step : a.step;
      add("a-" + a.kind, "action: " + a.kind, ACT[a.kind] || colors.grey, "dash", x,
        ptext(a.kind + " (" + a.status + "), decided at step " + a.step + ", applied at " + x) + "<br>" + ptext(a.reason).slice(0, 300));
    }
    for (const e of harm) add("harm", "FP8 harm attributed", colors.purple, "dashdot", e.step,
      ptext(F.harm.harmText(e)));
    const traces = [];
    for (const g of groups.values()) {
      traces.push({ type: "scatter", mode: "lines", x: g.lx, y: g.ly, yaxis: "y2", name: g.name, legendgroup: g.name,
        showlegend: legend, line: { color: g.color, dash: g.dash, width: 1.2 }, hoverinfo: "skip" });
      traces.push({ type: "scatter", mode: "markers", x: g.px, y: g.px.map(() => 1), yaxis: "y2", name: g.name,
        legendgroup: g.name, showlegend: false, marker: { color: g.color, size: 8, symbol: "triangle-down" },
        text: g.ph, hovertemplate: "%{text}<extra></extra>", cliponaxis: false });
    }
    return traces;
  }

  function rollbackShapes(rollbacks) {
    const shapes = [];
    for (const e of rollbacks) {
      const from = e.data && e.data.checkpoint_step;
      if (!has(from) || e.step === null) continue;
      shapes.push({ type: "rect", xref: "x", yref: "paper", x0: from, x1: e.step, y0: 0, y1: 1,
        fillcolor: colors.grey, opacity: 0.12, line: { width: 0 }, layer: "below" });
    }
    return shapes;
  }

  /* an outlined rectangle per rollback for charts whose background is drawn over (the heatmaps) */
  function rollbackOutlines(rollbacks) {
    return rollbackShapes(rollbacks).map((s) => Object.assign({}, s, { layer: "above", opacity: 1, fillcolor: "rgba(0,0,0,0)",
      line: { color: colors.purple, width: 1, dash: "dot" } }));
  }

  F.story = { incidents, describe, markerTraces, rollbackShapes, rollbackOutlines, SEV, ACT,
    y2: { overlaying: "y", range: [0, 1.04], visible: false, fixedrange: true } };
})();
