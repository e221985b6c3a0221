/* fp8guard dashboards: shared helpers. User data (run, model, tensor, module names) only ever
   reaches the DOM through textContent / attribute setters, and reaches plotly escaped. */
"use strict";
(function () {
  const FP8 = {};
  window.FP8 = FP8;

  FP8.poll = Number(document.body.dataset.poll || "5") * 1000;

  /* Okabe-Ito palette (colour-blind safe) */
  FP8.colors = { blue: "#0072B2", orange: "#E69F00", vermillion: "#D55E00", green: "#009E73",
                 purple: "#CC79A7", sky: "#56B4E9", yellow: "#F0E442", grey: "#888888", black: "#000000" };

  FP8.api = async function (path, params) {
    const url = new URL(path, window.location.origin);
    if (params) for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null) url.searchParams.set(k, String(v));
    const r = await fetch(url.toString(), { headers: { accept: "application/json" } });
    if (r.status === 401) {  /* the session ended (expired, logged out, token revoked): sign in again */
      window.location.assign("/login?next=" + encodeURIComponent(window.location.pathname + window.location.search));
    }
    if (!r.ok) {
      let detail = r.status + " " + r.statusText;
      try { const body = await r.json(); if (body && body.detail) detail += ": " + JSON.stringify(body.detail); } catch (e) { /* not JSON */ }
      const err = new Error(path + ": " + detail); err.status = r.status; throw err;
    }
    return r.json();
  };

  /* Build an element: attrs set as properties/attributes (never innerHTML), children as text. */
  FP8.el = function (tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = String(v);
      else if (k === "href") node.setAttribute("href", v);
      else node.setAttribute(k, String(v));
    }
    for (const c of children) {
      if (c === undefined || c === null) continue;
      node.appendChild(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  };

  FP8.clear = function (node) { while (node.firstChild) node.removeChild(node.firstChild); return node; };

  /* Plotly parses a small HTML subset in labels and hover text: escape so names show as text. */
  FP8.ptext = function (s) {
    return String(s === null || s === undefined ? "" : s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  };

  /* JSON scalars: "NaN" / "Infinity" / "-Infinity" travel as strings. */
  FP8.num = function (v) {
    if (v === null || v === undefined) return null;
    if (typeof v === "number") return v;
    if (v === "NaN") return NaN;
    if (v === "Infinity") return Infinity;
    if (v === "-Infinity") return -Infinity;
    const n = Number(v); return Number.isNaN(n) ? null : n;
  };

  FP8.fmt = function (v, digits) {
    const n = FP8.num(v);
    if (n === null) return "-";
    if (!Number.isFinite(n)) return String(n);
    if (n !== 0 && (Math.abs(n) >= 1e5 || Math.abs(n) < 1e-3)) return n.toExponential(digits || 3);
    return Number(n.toPrecision(digits || 5)).toString();
  };

  FP8.showError = function (err) {
    const box = document.getElementById("error");
    if (!box) return;
    if (err) { box.textContent = String(err.message || err); box.hidden = false; }
    else { box.textContent = ""; box.hidden = true; }
  };

  FP8.setLive = function (text) {
    const n = document.getElementById("live");
    if (n) n.textContent = text;
  };

  /* base64 little-endian float32 -> Float32Array (no copies beyond the byte buffer). */
  FP8.decodeF32 = function (b64) {
    const bin = atob(b64);
    const n = bin.length;
    const bytes = new Uint8Array(n);
    for (let i = 0; i < n; i++) bytes[i] = bin.charCodeAt(i);
    return new Float32Array(bytes.buffer, 0, n >> 2);
  };

  /* Plot width in pixels for server-side downsampling (<= 2000 columns). */
  FP8.widthOf = function (div) {
    const w = Math.round((div && div.clientWidth) || 1000);
    return Math.max(100, Math.min(2000, w));
  };

  /* Run fn every FP8.poll ms, skipping while the tab is hidden and never overlapping itself. */
  FP8.every = function (fn) {
    let busy = false;
    const tick = async function () {
      if (document.hidden || busy) return;
      busy = true;
      try { await fn(); FP8.showError(null); FP8.setLive("live, updated " + new Date().toLocaleTimeString()); }
      catch (e) { FP8.showError(e); FP8.setLive("update failed, retrying"); }
      finally { busy = false; }
    };
    return window.setInterval(tick, FP8.poll);
  };

  FP8.baseLayout = function (extra) {
    return Object.assign({
      margin: { l: 60, r: 20, t: 10, b: 40 }, hovermode: "closest", showlegend: true,
      legend: { orientation: "h", y: 1.12, x: 0 }, font: { size: 12 },
      xaxis: { title: { text: "step" }, zeroline: false }, paper_bgcolor: "#fff", plot_bgcolor: "#fff",
    }, extra || {});
  };

  FP8.plotConfig = { responsive: true, displaylogo: false, scrollZoom: false };

  /* Fill a <select> with [value, label] pairs, keeping the current choice when present. */
  FP8.fillSelect = function (select, options, wanted) {
    const keep = wanted !== undefined ? wanted : select.value;
    FP8.clear(select);
    for (const [value, label] of options) {
      const o = document.createElement("option"); o.value = String(value); o.textContent = String(label);
      select.appendChild(o);
    }
    if (keep !== undefined && options.some(([v]) => String(v) === String(keep))) select.value = String(keep);
  };
})();
