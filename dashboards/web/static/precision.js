/* Precision history: which modules ran in BF16 (or pinned BF16) over which steps, from the
   agent's applied events (fallback_applied, promotion_applied, rollback_applied) checked against
   the /precision endpoint's current state. Used to mark heatmap cells as "absent" (a module in
   BF16 reports amax 0.0, which is no FP8 statistic at all) and to draw the precision strip. */
"use strict";
(function () {
  const F = window.FP8;
  /* A command applied at step s (at the step boundary, after step s computed) changes steps s+1 on. */
  const APPLY_OFFSET = 1;
  const WHOLE = "*";

  /* key: a module name, a parent ("blocks.3" covers "blocks.3.mlp"), or WHOLE for the whole model */
  function covers(key, module) {
    return key === WHOLE || module === key || module.startsWith(key + ".");
  }

  /* -> { stretches: Map key -> [{from, to, precision}] (to exclusive, null while open), keys in first-switch order }
     in the run's effective step axis: a rollback to checkpoint c keeps what happened up to c and
     re-runs c+1 on in the precision the modules had when it was applied. The lead rank's events
     (rank: the run's lowest reporting rank, 0 in most runs). */
  function history(events, actions, current, rank = 0) {
    const pinnedIds = new Set(actions.filter((a) => a.payload && a.payload.escalation).map((a) => a.id));
    const closed = new Map(), open = new Map();
    const list = (k) => { if (!closed.has(k)) closed.set(k, []); return closed.get(k); };
    const order = [];
    const seen = (k) => { if (!order.includes(k)) order.push(k); };
    for (const e of events) {
      if (e.rank !== rank || e.step === null || e.step === undefined) continue;
      const d = e.data || {};
      if (e.kind === "rollback_applied" && Number.isInteger(d.checkpoint_step)) {
        const c = d.checkpoint_step;
        for (const [k, spans] of closed) closed.set(k, spans.filter((s) => s.from <= c).map((s) => (s.to > c + 1 ? Object.assign({}, s, { to: c + 1 }) : s)));
        for (const s of open.values()) if (s.from > c + 1) s.from = c + 1;
        continue;
      }
      if (e.kind !== "fallback_applied" && e.kind !== "promotion_applied") continue;
      const keys = Array.isArray(d.modules) && d.modules.length ? d.modules.map(String) : [WHOLE];
      const at = e.step + APPLY_OFFSET;
      for (const k of keys) {
        seen(k);
        const was = open.get(k);
        if (was) { if (at > was.from) list(k).push({ from: was.from, to: at, precision: was.precision }); open.delete(k); }
        if (e.kind === "fallback_applied") open.set(k, { from: at, to: null, precision: pinnedIds.has(d.command_id) ? "pinned" : "bf16" });
        else if (k === WHOLE) for (const [o, s] of [...open]) { if (s.from < at) list(o).push({ from: s.from, to: at, precision: s.precision }); open.delete(o); }
      }
    }
    /* the endpoint's word wins for the present (events may have been cut by the query limit) */
    for (const p of current || []) {
      const prec = String(p.precision).toLowerCase();
      const k = p.module;
      if (prec === "fp8") {
        const was = open.get(k);
        if (was) { list(k).push({ from: was.from, to: Math.max(was.from, p.since_step + APPLY_OFFSET), precision: was.precision }); open.delete(k); }
      } else if (!open.has(k) && ![...open.keys()].some((o) => covers(o, k))) {
        seen(k); open.set(k, { from: p.since_step + APPLY_OFFSET, to: null, precision: prec });
      }
    }
    const stretches = new Map();
    for (const k of order) {
      const spans = (closed.get(k) || []).slice();
      if (open.has(k)) spans.push(open.get(k));
      spans.sort((a, b) => a.from - b.from);
      stretches.set(k, spans);
    }
    return { stretches, keys: order };
  }

  /* the non-FP8 stretches that cover one module, merged: [[from, to], ...] with to exclusive (Infinity: open) */
  function spansFor(hist, module) {
    const out = [];
    for (const [k, spans] of hist.stretches) {
      if (!covers(k, module)) continue;
      for (const s of spans) out.push([s.from, s.to === null ? Infinity : s.to]);
    }
    out.sort((a, b) => a[0] - b[0]);
    const merged = [];
    for (const s of out) {
      const last = merged[merged.length - 1];
      if (last && s[0] <= last[1]) last[1] = Math.max(last[1], s[1]); else merged.push(s.slice());
    }
    return merged;
  }

  function moduleOf(t) { return t.module || String(t.name).split(":")[0]; }

  /* Uint8Array (rows in display order x columns): 1 where the whole column lies in a BF16 stretch */
  function absentMask(hist, m, order) {
    const T = m.tensors.length, C = m.steps.length, b = Math.max(1, m.bucket);
    const mask = new Uint8Array(T * C);
    if (!hist.stretches.size) return mask;
    for (let r = 0; r < T; r++) {
      const spans = spansFor(hist, moduleOf(m.tensors[order[r]]));
      if (!spans.length) continue;
      let k = 0;
      for (let c = 0; c < C; c++) {
        const s0 = m.steps[c], s1 = s0 + b;
        while (k < spans.length && spans[k][1] <= s0) k++;
        if (k < spans.length && spans[k][0] <= s0 && spans[k][1] >= s1) mask[r * C + c] = 1;
      }
    }
    return mask;
  }

  /* the precision strip: one row per switched module (or parent, or the whole model) */
  const COLORS = { bf16: F.colors.vermillion, pinned: F.colors.purple, fp8: F.colors.green };
  function stripFigure(hist, xRange, lastStep) {
    const end = lastStep === null || lastStep === undefined ? xRange[1] : lastStep + 1;
    const rows = hist.keys.map((k) => (k === WHOLE ? "whole model" : F.ptext(k)));  /* plotly parses tick labels */
    const traces = [];
    for (const prec of ["fp8", "bf16", "pinned"]) {
      const base = [], len = [], y = [], text = [];
      hist.keys.forEach((k, i) => {
        const spans = hist.stretches.get(k) || [];
        const pieces = [];
        if (prec === "fp8") {  /* the gaps between non-FP8 stretches */
          let at = xRange[0];
          for (const s of spans) { if (s.from > at) pieces.push([at, s.from]); at = Math.max(at, s.to === null ? end : s.to); }
          if (at < end) pieces.push([at, end]);
        } else for (const s of spans) if (s.precision === prec) pieces.push([s.from, s.to === null ? end : s.to]);
        for (const [a, b] of pieces) {
          base.push(a); len.push(Math.max(b - a, 0.5)); y.push(rows[i]);
          text.push(rows[i] + ": " + prec.toUpperCase() + ", steps " + a + " to " + (b - 1) + (b === end && prec !== "fp8" ? " (still)" : ""));
        }
      });
      if (!y.length) continue;
      traces.push({ type: "bar", orientation: "h", base, x: len, y, name: prec === "pinned" ? "BF16 (pinned)" : prec.toUpperCase(),
        marker: { color: COLORS[prec], line: { width: 0 } }, opacity: prec === "fp8" ? 0.35 : 0.9, width: 0.6,
        text, textposition: "none", hovertemplate: "%{text}<extra></extra>" });
    }
    return { traces, rows };
  }

  F.precision = { history, absentMask, stripFigure, spansFor, moduleOf, WHOLE, APPLY_OFFSET };
})();
