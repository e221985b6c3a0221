/* Runs page: every run with status, step, last loss, precision state, open findings, last action. */
"use strict";
(function () {
  const { api, el, clear, fmt } = window.FP8;
  const tbody = document.querySelector("#runs tbody");
  const filter = document.getElementById("filter");
  let rows = [];

  function openFindings(findings, actions) {
    /* a finding is open until an applied action cites it */
    const handled = new Set();
    for (const a of actions) if (a.status === "applied") for (const id of a.finding_ids || []) handled.add(id);
    return findings.filter((f) => !handled.has(f.id));
  }

  async function describe(run) {
    const id = encodeURIComponent(run.run_id);
    const [precision, findings, actions] = await Promise.all([
      api("/v1/runs/" + id + "/precision").catch(() => []),
      api("/v1/runs/" + id + "/findings").catch(() => []),
      api("/v1/runs/" + id + "/actions").catch(() => []),
    ]);
    return { run, precision, findings, actions, open: openFindings(findings, actions) };
  }

  function precisionCell(precision) {
    const bf16 = precision.filter((p) => String(p.precision).toLowerCase() !== "fp8");
    const fp8 = precision.length - bf16.length;
    const td = el("td");
    if (!bf16.length) { td.appendChild(el("span", { class: "prec-fp8", text: "all FP8" })); }
    else {
      td.appendChild(el("span", { class: "prec-bf16", text: bf16.length + " in BF16" }));
      td.appendChild(el("div", { class: "note", text: bf16.map((p) => p.module).join(", ") }));
    }
    if (fp8) td.appendChild(el("div", { class: "note", text: fp8 + " re-promoted to FP8" }));
    td.dataset.search = precision.map((p) => p.module + " " + p.precision).join(" ");
    return td;
  }

  function render(list) {
    clear(tbody);
    for (const d of list) {
      const r = d.run;
      const tr = el("tr", { "data-run-id": r.run_id });
      const link = el("a", { href: "/runs/" + encodeURIComponent(r.run_id), text: r.run_id });
      tr.appendChild(el("td", {}, link));
      tr.appendChild(el("td", { text: r.model || "-" }));
      tr.appendChild(el("td", {}, el("span", { class: "badge st-" + r.status, text: r.status })));
      tr.appendChild(el("td", { class: "num", text: r.last_step === null ? "-" : r.last_step }));
      tr.appendChild(el("td", { class: "num", text: fmt(r.last_loss) }));
      const prec = precisionCell(d.precision);
      tr.appendChild(prec);
      const open = el("td", { class: "num" });
      if (d.open.length) {
        const worst = d.open.some((f) => f.severity === "critical") ? "critical" : (d.open.some((f) => f.severity === "warning") ? "warning" : "info");
        open.appendChild(el("span", { class: "sev-" + worst, text: String(d.open.length) }));
        open.title = d.open.map((f) => "step " + f.step + ": " + f.rule).join("\n");
      } else open.textContent = "0";
      tr.appendChild(open);
      const last = d.actions.length ? d.actions[d.actions.length - 1] : null;
      tr.appendChild(el("td", { text: last ? last.kind + " (" + last.status + ") at step " + last.step : "-", title: last ? last.reason : null }));
      tr.appendChild(el("td", { text: new Date(r.updated_at).toLocaleString() }));
      tr.dataset.search = [r.run_id, r.model || "", r.status, prec.dataset.search, last ? last.kind : "",
        d.findings.map((f) => f.rule).join(" ")].join(" ").toLowerCase();
      tbody.appendChild(tr);
    }
    applyFilter();
    document.getElementById("empty").hidden = list.length > 0;
  }

  function applyFilter() {
    const words = filter.value.toLowerCase().split(/\s+/).filter(Boolean);
    for (const tr of tbody.rows) tr.hidden = !words.every((w) => tr.dataset.search.includes(w));
  }

  function fillCompare(list) {
    const opts = list.map((d) => [d.run.run_id, d.run.run_id + (d.run.model ? " (" + d.run.model + ")" : "")]);
    const a = document.getElementById("cmp-run"), b = document.getElementById("cmp-baseline");
    window.FP8.fillSelect(a, opts);
    window.FP8.fillSelect(b, opts, b.value || (opts.length > 1 ? opts[1][0] : undefined));
  }

  async function refresh() {
    const runs = await api("/v1/runs", { limit: 1000 });
    rows = await Promise.all(runs.map(describe));
    render(rows);
    fillCompare(rows);
    window.fp8guardReady = true;
  }

  filter.addEventListener("input", applyFilter);
  refresh().then(() => window.FP8.setLive("live, updated " + new Date().toLocaleTimeString()))
    .catch((e) => { window.FP8.showError(e); window.fp8guardReady = true; });
  window.FP8.every(refresh);
})();
