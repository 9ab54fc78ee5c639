// Spillway's live dashboard: polls /api/snapshot every second and redraws.
// Charts use uPlot (vendored under /static/vendor); nothing is loaded from elsewhere.
"use strict";

const REFRESH_MS = 1000;
const BACKEND_COLORS = { gpu: "#2563eb", cpu: "#d97706", batch: "#059669", none: "#dc2626" };
const PALETTE = ["#2563eb", "#d97706", "#059669", "#7c3aed", "#db2777", "#0891b2", "#65a30d",
  "#ea580c", "#4b5563"];

const pad2 = (n) => String(n).padStart(2, "0");
// One line per tick label (no second date row), at least AXIS_SPACE px apart: labels never overlap.
const AXIS_SPACE = 90;
function timeLabels(u, splits) {
  const span = u.scales.x.max - u.scales.x.min;
  return splits.map((v) => {
    const d = new Date(v * 1000);
    const hm = `${pad2(d.getHours())}:${pad2(d.getMinutes())}`;
    return span > 1800 ? hm : `${hm}:${pad2(d.getSeconds())}`;
  });
}

const fmt = {
  int: (v) => (v === null || v === undefined ? "–" : Math.round(v).toLocaleString("en-US")),
  ms: (v) => (v === null || v === undefined ? "–" : v.toFixed(1)),
  usd: (v) => (v === null || v === undefined ? "–" : v.toFixed(6)),
  rate: (v) => (v === null || v === undefined ? "–" : (v * 100).toFixed(2) + " %"),
  rps: (v) => (v === null || v === undefined ? "–" : v.toFixed(1)),
  num: (v) => (v === null || v === undefined ? "–" : v.toFixed(2)),
  age: (v) => (v === null || v === undefined ? "–" : `${v.toFixed(0)} s`),
};

function colorOf(name, index) {
  return BACKEND_COLORS[name] || PALETTE[index % PALETTE.length];
}

class Chart {
  constructor(id, unit) {
    this.el = document.getElementById(id);
    this.unit = unit;
    this.plot = null;
    this.key = "";
  }

  update(xs, lines) {
    const key = lines.map((l) => l.label).join("|");
    const data = [xs, ...lines.map((l) => l.values)];
    if (this.plot && key === this.key) {
      this.plot.setData(data);
      return;
    }
    if (this.plot) this.plot.destroy();
    this.key = key;
    this.plot = new uPlot({
      width: Math.max(200, this.el.clientWidth),
      height: this.el.clientHeight || 200,
      scales: { x: { time: true } },
      legend: { live: false },
      cursor: { drag: { x: false, y: false } },
      series: [{}, ...lines.map((l) => ({
        label: l.label, stroke: l.color, width: 1.5, dash: l.dash, spanGaps: false,
        points: { show: false },
      }))],
      axes: [{ space: AXIS_SPACE, values: timeLabels }, { label: this.unit, size: 56 }],
    }, data, this.el);
  }

  resize() {
    if (this.plot) this.plot.setSize({ width: this.el.clientWidth, height: this.el.clientHeight || 200 });
  }
}

const charts = {
  latency: new Chart("chart-latency", "ms"),
  rps: new Chart("chart-rps", "req/s"),
  rules: new Chart("chart-rules", "req/s"),
  errors: new Chart("chart-errors", "%"),
  concurrency: new Chart("chart-concurrency", "in flight"),
  gpu: new Chart("chart-gpu", "requests / rows"),
  fallbacks: new Chart("chart-fallbacks", "per s"),
};
window.addEventListener("resize", () => Object.values(charts).forEach((c) => c.resize()));

function setMetric(name, text) {
  for (const el of document.querySelectorAll(`[data-metric="${name}"]`)) el.textContent = text;
}

function cell(text, metric) {
  const td = document.createElement("td");
  td.textContent = text;
  if (metric) td.dataset.metric = metric;
  return td;
}

function fillRows(tableId, rows) {
  const body = document.querySelector(`#${tableId} tbody`);
  body.replaceChildren(...rows);
}

function row(cells, className) {
  const tr = document.createElement("tr");
  if (className) tr.className = className;
  tr.append(...cells);
  return tr;
}

function badge(state) {
  const span = document.createElement("span");
  span.className = `badge ${state}`;
  span.textContent = state;
  return span;
}

function drawTiles(s) {
  const t = s.totals;
  setMetric("totals.rps", fmt.rps(t.rps));
  setMetric("totals.requests", fmt.int(t.requests));
  setMetric("totals.errors", fmt.int(t.errors));
  setMetric("totals.client_errors", fmt.int(t.client_errors));
  setMetric("totals.fallbacks", fmt.int(t.fallbacks));
  setMetric("totals.spills", fmt.int(t.spills));
  setMetric("totals.cost_usd", fmt.usd(t.cost_usd));
  setMetric("gpu.queue_depth", s.gpu.up ? fmt.int(s.gpu.queue_depth_now) : "down");
  setMetric("gpu.busy", s.gpu.up ? fmt.rate(s.gpu.busy_now) : "down");
  const cpu = s.backends.cpu;
  setMetric("cpu.concurrency", cpu ? fmt.num(cpu.concurrency) : "–");
  const backlog = (s.operator || {}).async;
  const known = backlog && !backlog.error;
  setMetric("async.pending", known ? fmt.int(backlog.pending) + (backlog.capped ? "+" : "") : "–");
  setMetric("async.oldest_age", known ? fmt.age(backlog.oldest_age_s) : "–");
}

function drawBackends(s) {
  const rows = Object.entries(s.backends).map(([name, b], i) => {
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = colorOf(name, i);
    const first = cell("");
    first.append(swatch, name);
    const circuit = document.createElement("td");
    const seen = s.breakers[name];
    circuit.dataset.metric = `breaker.${name}`;
    circuit.append(badge(seen ? seen.state : "unknown"));
    if (seen) circuit.title = `${seen.outcome}, ${seen.age_s.toFixed(0)} s ago`;
    const m = (k) => `backend.${name}.${k}`;
    const starts = ((s.operator || {}).process_starts || {})[name];
    return row([
      first, cell(fmt.int(b.requests), m("requests")), cell(fmt.rps(b.rps), m("rps")),
      cell(fmt.num(b.concurrency), m("concurrency")),
      cell(fmt.ms(b.p50_ms), m("p50_ms")), cell(fmt.ms(b.p99_ms), m("p99_ms")),
      cell(fmt.int(b.errors), m("errors")), cell(fmt.rate(b.error_rate), m("error_rate")),
      cell(fmt.int(b.client_errors), m("client_errors")),
      cell(fmt.rate(b.client_error_rate), m("client_error_rate")), circuit,
      cell(starts === undefined ? "–" : fmt.int(starts), m("starts")),
    ]);
  });
  fillRows("backends", rows);
}

function drawRoutes(s) {
  const rows = s.routes.map((r) => {
    const m = (k) => `route.${r.rule}.${r.backend}.${k}`;
    return row([
      cell(r.rule), cell(r.backend), cell(fmt.int(r.requests), m("requests")),
      cell(fmt.int(r.errors), m("errors")), cell(fmt.int(r.client_errors), m("client_errors")),
      cell(fmt.int(r.fallbacks), m("fallbacks")),
      cell(fmt.int(r.spills), m("spills")), cell(fmt.usd(r.cost_usd), m("cost_usd")),
      cell(fmt.usd(r.usd_per_1k), m("usd_per_1k")), cell(fmt.ms(r.p50_ms), m("p50_ms")),
      cell(fmt.ms(r.p99_ms), m("p99_ms")), slo(r.p99_ms, r.slo_p99_ms, m("slo")),
    ]);
  });
  const t = s.totals;
  rows.push(row([
    cell("total"), cell(""), cell(fmt.int(t.requests)), cell(fmt.int(t.errors)),
    cell(fmt.int(t.client_errors)), cell(fmt.int(t.fallbacks)), cell(fmt.int(t.spills)),
    cell(fmt.usd(t.cost_usd)), cell(fmt.usd(t.usd_per_1k)), cell(""), cell(""), cell(""),
  ], "total"));
  fillRows("routes", rows);
  const total = Object.values(s.rules).reduce((a, b) => a + b, 0);
  fillRows("rules", Object.entries(s.rules).map(([rule, n]) => row([
    cell(rule), cell(fmt.int(n), `rule.${rule}.requests`),
    cell(total ? fmt.rate(n / total) : "–"),
  ])));
}

// The SLO cell: the objective, marked when the route's p99 is over it.
function slo(p99, objective, metric) {
  const td = cell(objective === null || objective === undefined ? "–" : fmt.ms(objective), metric);
  if (objective !== null && objective !== undefined && p99 > objective) td.className = "over";
  return td;
}

function versionsText(v) {
  if (v === undefined) return "–";
  return Array.isArray(v) ? (v.length ? v.join(", ") : "none") : v;
}

function canaryText(c) {
  if (!c) return "none";
  if (c.running) return `v${c.canary} ${c.percent}% (stable v${c.stable})`;
  if (c.status === "rolled_back") return `rolled back v${c.rolled_back.join(", v")} (stable v${c.stable})`;
  return `${c.status} (stable v${c.stable})`;
}

function drawModels(s) {
  const op = s.operator || {};
  const canaries = (op.canaries && op.canaries.models) || {};
  const versions = op.versions || {};
  const names = [...new Set([...Object.keys(s.models), ...(op.models || [])])].sort();
  fillRows("models", names.map((name) => {
    const r = s.models[name] || {};
    const m = (k) => `model.${name}.${k}`;
    const statuses = Object.entries(r.statuses || {}).map(([k, n]) => `${k}: ${n}`).join(", ");
    const served = versions[name] || {};
    return row([
      cell(name), cell(fmt.int(r.requests || 0), m("requests")), cell(fmt.ms(r.p50_ms), m("p50_ms")),
      cell(fmt.ms(r.p99_ms), m("p99_ms")), cell(fmt.int(r.errors || 0), m("errors")),
      cell(fmt.int(r.client_errors || 0), m("client_errors")), cell(statuses || "–", m("statuses")),
      cell(op.canaries && op.canaries.error ? "unreadable" : canaryText(canaries[name]), m("canary")),
      cell(versionsText(served.gpu), m("versions.gpu")), cell(versionsText(served.cpu), m("versions.cpu")),
    ]);
  }));
}

function drawPolicy(s) {
  const policy = (s.operator || {}).policy;
  const source = document.getElementById("policy-source");
  if (!policy || policy.error) {
    source.textContent = policy ? `unreadable: ${policy.error}` : "no policy source given";
    setMetric("policy.digest", "–");
    fillRows("policy", []);
    return;
  }
  source.replaceChildren("version ", Object.assign(document.createElement("code"), {
    textContent: policy.digest,
  }), ` from ${policy.source}`);
  source.querySelector("code").dataset.metric = "policy.digest";
  fillRows("policy", policy.rules.map((r, i) => row([
    cell(String(i + 1)), cell(r.name, `policy.rule.${i + 1}`), cell(r.match), cell(r.route),
    cell(r.spill || "–"), cell(r.fallback || "–"),
    cell(s.slo && s.slo.lines[r.name] !== undefined ? fmt.ms(s.slo.lines[r.name]) : "–"),
  ])));
}

function drawBacklog(s) {
  const backlog = (s.operator || {}).async;
  if (!backlog || backlog.error) {
    setMetric("async.pending_detail", backlog ? `unreadable: ${backlog.error}` : "not configured");
    setMetric("async.oldest_age_s", "–");
    fillRows("async-tenants", []);
    return;
  }
  setMetric("async.pending_detail",
    `${fmt.int(backlog.pending)}${backlog.capped ? "+" : ""} (${backlog.queued} queued, ${backlog.running} running)`);
  setMetric("async.oldest_age_s", fmt.age(backlog.oldest_age_s));
  fillRows("async-tenants", Object.entries(backlog.tenants).map(([tenant, n]) => row([
    cell(tenant), cell(fmt.int(n), `async.tenant.${tenant}`),
  ])));
}

function drawJobs(s) {
  const jobs = (s.operator || {}).jobs;
  if (!jobs || jobs.error) {
    fillRows("jobs", [row([cell(jobs ? `unreadable: ${jobs.error}` : "not configured")])]);
    return;
  }
  fillRows("jobs", jobs.rows.map((j) => row([
    cell(j.job_id.slice(0, 8), `job.${j.job_id}.id`), cell(j.tenant_scope.slice(0, 12), `job.${j.job_id}.tenant`),
    cell(j.model), cell(j.state, `job.${j.job_id}.state`), cell(j.created_at.replace("T", " ").slice(0, 19)),
  ])));
}

function drawColdStarts(s) {
  const rows = Object.entries(s.cold_starts).map(([name, n]) => [name, n]);
  for (const [name, n] of Object.entries((s.operator || {}).process_starts || {})) {
    rows.push([`${name} process`, n]);
  }
  fillRows("cold-starts", rows.map(([name, n]) => row([
    cell(name), cell(fmt.int(n), `starts.${name}`),
  ])));
}

function drawGpu(s) {
  const g = s.gpu;
  setMetric("gpu.up", g.up ? "up" : "not answering");
  setMetric("gpu.success", fmt.int(g.success));
  setMetric("gpu.failure", fmt.int(g.failure));
  setMetric("gpu.rejected", fmt.int(g.rejected));
  setMetric("gpu.batches", fmt.int(g.batches));
  setMetric("gpu.mean_batch", fmt.num(g.mean_batch_total));
}

function drawCharts(s) {
  const names = Object.keys(s.backends);
  const per = (key) => names.map((n, i) => ({
    label: n, color: colorOf(n, i), values: s.series[key][n],
  }));
  const sloLines = Object.entries((s.slo && s.slo.lines) || {}).map(([rule, ms], i) => ({
    label: `SLO ${rule} p99`, color: PALETTE[(i + 3) % PALETTE.length], dash: [2, 3],
    values: s.t.map(() => ms),
  }));
  charts.latency.update(s.t, [...names.flatMap((n, i) => [
    { label: `${n} p50`, color: colorOf(n, i), values: s.series.p50[n] },
    { label: `${n} p99`, color: colorOf(n, i), dash: [6, 4], values: s.series.p99[n] },
  ]), ...sloLines]);
  charts.rps.update(s.t, per("rps"));
  const percent = (values) => values.map((v) => (v === null ? null : v * 100));
  charts.errors.update(s.t, names.flatMap((n, i) => [
    { label: `${n} 5xx`, color: colorOf(n, i), values: percent(s.series.error_rate[n]) },
    { label: `${n} 4xx`, color: colorOf(n, i), dash: [6, 4],
      values: percent(s.series.client_error_rate[n]) },
  ]));
  charts.concurrency.update(s.t, per("concurrency"));
  charts.rules.update(s.t, Object.entries(s.series.rules).map(([rule, values], i) => ({
    label: rule, color: PALETTE[i % PALETTE.length], values,
  })));
  charts.gpu.update(s.gpu.t, [
    { label: "queue depth", color: "#7c3aed", values: s.gpu.queue_depth },
    { label: "mean batch size", color: "#0891b2", values: s.gpu.mean_batch },
  ]);
  charts.fallbacks.update(s.t, [
    { label: "fallbacks", color: "#dc2626", values: s.series.fallbacks },
    { label: "spills", color: "#d97706", values: s.series.spills },
  ]);
}

function draw(s) {
  drawTiles(s);
  drawBackends(s);
  drawRoutes(s);
  drawModels(s);
  drawPolicy(s);
  drawBacklog(s);
  drawJobs(s);
  drawColdStarts(s);
  drawGpu(s);
  drawCharts(s);
  const when = new Date(s.now * 1000).toLocaleTimeString("en-GB");
  const status = document.getElementById("status");
  status.textContent = `updated ${when} · ${fmt.int(s.events_read)} requests read · `
    + `GPU service ${s.gpu.up ? "up" : "not answering"}`;
  status.classList.remove("stale");
  document.getElementById("sources").textContent = `Sources: ${s.sources.logs.join(", ")}`
    + ` · ${s.sources.gpu_metrics || "no GPU service"} · every ${s.sources.interval_s} s`;
  document.body.dataset.round = String(s.round);
  document.body.dataset.now = String(s.now);
}

async function refresh() {
  try {
    const response = await fetch("/api/snapshot", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    draw(await response.json());
  } catch (error) {
    const status = document.getElementById("status");
    status.textContent = `no data: ${error.message}`;
    status.classList.add("stale");
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
