/* Run page tables: findings, decisions, agent events and the harm probe's bisections and promotion
   trials in step order (evidence and payloads as
   key/value tables, not raw JSON), each module's current precision, the checkpoints. */
"use strict";
(function () {
  const F = window.FP8;
  const { el, clear, fmt } = F;
  const MAX_ROWS = 14, MAX_LIST = 6;
  const has = (v) => v !== null && v !== undefined;

  function scalar(v) {
    if (!has(v)) return "-";
    if (typeof v === "number" || v === "NaN" || v === "Infinity" || v === "-Infinity") return fmt(v, 4);
    if (typeof v === "boolean") return v ? "yes" : "no";
    return String(v);
  }

  function value(v) {
    if (Array.isArray(v)) {
      if (!v.length) return "none";
      const shown = v.slice(0, MAX_LIST).map((x) => (x !== null && typeof x === "object" ? JSON.stringify(x) : scalar(x)));
      return shown.join(", ") + (v.length > MAX_LIST ? " (+" + (v.length - MAX_LIST) + " more)" : "");
    }
    return scalar(v);
  }

  /* nested objects flattened to dotted keys: [[key, text], ...] */
  function pairs(obj, prefix, out) {
    for (const [k, v] of Object.entries(obj || {})) {
      const key = prefix ? prefix + "." + k : k;
      if (v !== null && typeof v === "object" && !Array.isArray(v)) pairs(v, key, out);
      else out.push([key, value(v)]);
    }
    return out;
  }

  /* a small key/value table (user data only through textContent) */
  F.kvTable = function (obj, skip) {
    const rows = pairs(obj, "", []).filter(([k, v]) => !(skip || []).includes(k) && v !== "-");
    if (!rows.length) return el("span", { class: "note", text: "-" });
    const body = el("tbody");
    for (const [k, v] of rows.slice(0, MAX_ROWS)) body.appendChild(el("tr", {}, el("th", { text: k }), el("td", { text: v })));
    if (rows.length > MAX_ROWS) body.appendChild(el("tr", {}, el("td", { colspan: 2, class: "note", text: "+" + (rows.length - MAX_ROWS) + " more" })));
    return el("table", { class: "kv" }, body);
  };

  function timelineRows(facts) {
    const rows = [];
    for (const f of facts.findings) rows.push({ step: f.step, order: 0, source: "finding",
      what: el("span", { class: "sev-" + f.severity, text: f.rule + " [" + f.severity + "]" }),
      text: f.explanation + (has(f.onset_step) ? " (onset step " + f.onset_step + ")" : ""),
      evidence: F.kvTable(Object.assign({ modules: f.modules }, f.evidence || {})) });
    for (const a of facts.actions) rows.push({ step: a.step, order: 1, source: "decision",
      what: el("span", { text: a.kind + " (" + a.status + ")" + (has(a.applied_step) ? ", applied at " + a.applied_step : "") }),
      text: a.reason + (a.error ? " error: " + a.error : ""), evidence: F.kvTable(a.payload) });
    for (const e of facts.events) {
      if (e.kind === "guard_changed") {  /* the service's audit trail: who changed the run's guard, old -> new */
        const before = e.data.old || {}, after = e.data.new || {};
        const keys = [...new Set([...Object.keys(before), ...Object.keys(after)])].filter((k) => JSON.stringify(before[k]) !== JSON.stringify(after[k]));
        const diff = {};
        for (const k of keys) diff[k] = (k in before ? JSON.stringify(before[k]) : "default") + " -> " + (k in after ? JSON.stringify(after[k]) : "default");
        rows.push({ step: e.step, order: 2, source: "audit", what: el("span", { text: "guard changed by " + e.data.by }),
          text: keys.map((k) => k + ": " + diff[k]).join("; "), evidence: F.kvTable(diff) });
        continue;
      }
      if (e.kind === "harm_attributed" || e.kind === "promotion_trial") {
        const d = e.data || {};
        const harm = e.kind === "harm_attributed";
        rows.push({ step: e.step, order: 2, source: "harm probe",
          what: el("span", { class: harm || d.harmful ? "sev-warning" : "sev-info",
            text: harm ? "harm attributed" : "promotion trial (" + (d.harmful ? "harmful" : "no harm") + ")" }),
          text: harm ? F.harm.harmText(e) : F.harm.trialText(e), evidence: F.kvTable(d) });
        continue;
      }
      if (!["rollback_applied", "fallback_applied", "promotion_applied"].includes(e.kind)) continue;
      rows.push({ step: e.step, order: 2, source: "agent", what: el("span", { text: e.kind }),
        text: "segment " + e.segment + ", rank " + e.rank, evidence: F.kvTable(e.data) });
    }
    rows.sort((a, b) => (a.step || 0) - (b.step || 0) || a.order - b.order);
    return rows;
  }

  function draw(facts) {
    const rows = timelineRows(facts);
    const tb = clear(document.querySelector("#timeline tbody"));
    for (const r of rows) tb.appendChild(el("tr", {}, el("td", { class: "num", text: r.step === null ? "-" : r.step }),
      el("td", { text: r.source }), el("td", {}, r.what), el("td", { text: r.text }), el("td", { class: "evidence" }, r.evidence)));
    if (!rows.length) tb.appendChild(el("tr", {}, el("td", { colspan: 5, class: "note", text: "No findings or actions." })));

    const pb = clear(document.querySelector("#precision tbody"));
    for (const p of facts.precision) pb.appendChild(el("tr", {}, el("td", { text: p.module }),
      el("td", {}, el("span", { class: "prec-" + String(p.precision).toLowerCase(), text: String(p.precision).toUpperCase() })),
      el("td", { class: "num", text: p.since_step === null ? "-" : p.since_step })));
    if (!facts.precision.length) pb.appendChild(el("tr", {}, el("td", { colspan: 3, class: "note", text: "Every module in FP8 (no switches)." })));

    const cb = clear(document.querySelector("#checkpoints tbody"));
    for (const c of facts.checkpoints) cb.appendChild(el("tr", {}, el("td", { class: "num", text: c.step }),
      el("td", { class: "num", text: c.segment }), el("td", { class: "num", text: c.rank }),
      el("td", { text: c.known_good ? "yes (known good)" : "no" }), el("td", { class: "path", text: c.path || "" })));
    if (!facts.checkpoints.length) cb.appendChild(el("tr", {}, el("td", { colspan: 5, class: "note", text: "No checkpoints reported." })));
  }

  F.tables = { draw, pairs };
})();
