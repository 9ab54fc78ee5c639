// Spillway's live dashboard: polls /api/snapshot every second and redraws.
// Charts use uPlot (vendored under /static/vendor); nothing is loaded from elsewhere.
"use strict";

const REFRESH_MS = 1000;
const BACKEND_COLORS = { gpu: "#2563eb", cpu: "#d97706", batch: "#059669", none: "#dc2626" };
const PALETTE = ["#2563eb", "#d97706", "#059669", "#7c3aed", "#db2777", "#0891b2", "#65a30d",
  "#ea580c", "#4b5563"];

const fmt = {
  int: (v) => (v === null || v === undefined ? "–" : Math.round(v).toLocaleString("en-US")),
  ms: (v) => (v === null || v === undefined ? "–" : v.toFixed(1)),
  usd: (v) => (v === null || v === undefined ? "–" : v.toFixed(6)),
  rate: (v) => (v === null || v === undefined ? "–" : (v * 100).toFixed(2) + " %"),
  rps: (v) => (v === null || v === undefined ? "–" : v.toFixed(1)),
  num: (v) => (v === null || v === undefined ? "–" : v.toFixed(2)),
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
      axes: [{}, { label: this.unit, size: 56 }],
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
  setMetric("totals.fallbacks", fmt.int(t.fallbacks));
  setMetric("totals.spills", fmt.int(t.spills));
  setMetric("totals.cost_usd", fmt.usd(t.cost_usd));
  setMetric("gpu.queue_depth", s.gpu.up ? fmt.int(s.gpu.queue_depth_now) : "down");
  setMetric("gpu.busy", s.gpu.up ? fmt.rate(s.gpu.busy_now) : "down");
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
    return row([
      first, cell(fmt.int(b.requests), m("requests")), cell(fmt.rps(b.rps), m("rps")),
      cell(fmt.ms(b.p50_ms), m("p50_ms")), cell(fmt.ms(b.p99_ms), m("p99_ms")),
      cell(fmt.int(b.errors), m("errors")), cell(fmt.rate(b.error_rate), m("error_rate")), circuit,
    ]);
  });
  fillRows("backends", rows);
}

function drawRoutes(s) {
  const rows = s.routes.map((r) => {
    const m = (k) => `route.${r.rule}.${r.backend}.${k}`;
    return row([
      cell(r.rule), cell(r.backend), cell(fmt.int(r.requests), m("requests")),
      cell(fmt.int(r.errors), m("errors")), cell(fmt.int(r.fallbacks), m("fallbacks")),
      cell(fmt.int(r.spills), m("spills")), cell(fmt.usd(r.cost_usd), m("cost_usd")),
      cell(fmt.usd(r.usd_per_1k), m("usd_per_1k")), cell(fmt.ms(r.p50_ms), m("p50_ms")),
      cell(fmt.ms(r.p99_ms), m("p99_ms")),
    ]);
  });
  const t = s.totals;
  rows.push(row([
    cell("total"), cell(""), cell(fmt.int(t.requests)), cell(fmt.int(t.errors)),
    cell(fmt.int(t.fallbacks)), cell(fmt.int(t.spills)), cell(fmt.usd(t.cost_usd)),
    cell(fmt.usd(t.usd_per_1k)), cell(""), cell(""),
  ], "total"));
  fillRows("routes", rows);
  const total = Object.values(s.rules).reduce((a, b) => a + b, 0);
  fillRows("rules", Object.entries(s.rules).map(([rule, n]) => row([
    cell(rule), cell(fmt.int(n), `rule.${rule}.requests`),
    cell(total ? fmt.rate(n / total) : "–"),
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
  charts.latency.update(s.t, names.flatMap((n, i) => [
    { label: `${n} p50`, color: colorOf(n, i), values: s.series.p50[n] },
    { label: `${n} p99`, color: colorOf(n, i), dash: [6, 4], values: s.series.p99[n] },
  ]));
  charts.rps.update(s.t, per("rps"));
  charts.errors.update(s.t, names.map((n, i) => ({
    label: n, color: colorOf(n, i),
    values: s.series.error_rate[n].map((v) => (v === null ? null : v * 100)),
  })));
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
