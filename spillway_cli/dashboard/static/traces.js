// Spillway's local trace view: /traces lists recent traces (GET /api/traces), /traces/{id}
// draws one as a waterfall (GET /api/traces/{id}): spans nested by parent, bars by time,
// links followed. Nothing is loaded from elsewhere; span data is only ever set as text.
"use strict";

const REFRESH_MS = 2000;
const PALETTE = ["#2563eb", "#d97706", "#059669", "#7c3aed", "#db2777", "#0891b2", "#65a30d",
  "#ea580c", "#4b5563"];
const colors = new Map();
const colorOf = (service) => {
  if (!colors.has(service)) colors.set(service, PALETTE[colors.size % PALETTE.length]);
  return colors.get(service);
};

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const traceLink = (id, text) => el("a", { href: `/traces/${id}` }, text || id);
const when = (ns) => new Date(ns / 1e6).toLocaleTimeString("en-GB", { hour12: false }) +
  "." + String(Math.floor((ns / 1e6) % 1000)).padStart(3, "0");
const ms = (v) => v.toFixed(v < 10 ? 2 : 1);

function setStatus(text, stale) {
  const status = document.getElementById("status");
  status.textContent = text;
  status.classList.toggle("stale", Boolean(stale));
}

async function getJson(url) {
  const answer = await fetch(url, { cache: "no-store" });
  const body = await answer.json();
  if (!answer.ok) throw new Error(`${answer.status} ${body.code}: ${body.error}`);
  return body;
}

// --- the list ---------------------------------------------------------------------------

function filtersQuery(form) {
  const params = new URLSearchParams();
  for (const name of ["service", "name", "tenant", "min_ms", "limit"]) {
    const value = form.elements[name].value.trim();
    if (value) params.set(name, value);
  }
  return params;
}

async function showList() {
  const form = document.getElementById("filters");
  const params = new URLSearchParams(location.search);
  for (const [name, value] of params) if (form.elements[name]) form.elements[name].value = value;
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    history.replaceState(null, "", `/traces?${filtersQuery(form)}`);
    refresh();
  });
  async function refresh() {
    try {
      const found = await getJson(`/api/traces?${filtersQuery(form)}`);
      drawList(found.traces);
      setStatus(`${found.traces.length} trace(s), ${new Date().toLocaleTimeString("en-GB")}`);
    } catch (error) {
      setStatus(`could not list traces: ${error.message}`, true);
    }
  }
  await refresh();
  setInterval(() => { if (form.elements.live.checked) refresh(); }, REFRESH_MS);
}

function drawList(traces) {
  const body = document.querySelector("#traces tbody");
  body.replaceChildren(...traces.map((t) => el("tr", {},
    el("td", {}, when(t.start_ns)),
    el("td", {}, traceLink(t.trace_id, t.root)),
    el("td", {}, ...t.services.map((s) => el("span", {}, swatch(s), s, " "))),
    el("td", { class: "num" }, ms(t.duration_ms)),
    el("td", { class: "num" }, t.span_count + (t.dropped_spans ? ` (+${t.dropped_spans} dropped)` : "")),
    el("td", { class: t.error ? "error" : "" }, t.error ? "error" : ""),
    el("td", { class: "mono" }, t.trace_id),
  )));
}

function swatch(service) {
  const mark = el("span", { class: "swatch" });
  mark.style.background = colorOf(service);
  return mark;
}

// --- one trace ----------------------------------------------------------------------------

// Depth-first from the roots (spans whose parent is not in the trace), children by start.
function nested(spans) {
  const ids = new Set(spans.map((s) => s.span_id));
  const children = new Map();
  const roots = [];
  for (const span of spans) {
    if (span.parent_span_id && ids.has(span.parent_span_id)) {
      if (!children.has(span.parent_span_id)) children.set(span.parent_span_id, []);
      children.get(span.parent_span_id).push(span);
    } else {
      roots.push(span);
    }
  }
  const out = [];
  const visit = (span, depth) => {
    out.push({ span, depth });
    for (const child of children.get(span.span_id) || []) visit(child, depth + 1);
  };
  roots.forEach((root) => visit(root, 0));
  return out;
}

async function showTrace(traceId) {
  document.getElementById("trace-title").textContent = `trace ${traceId}`;
  try {
    const trace = await getJson(`/api/traces/${traceId}`);
    drawTrace(trace);
    setStatus(`${trace.span_count} span(s)`);
  } catch (error) {
    setStatus(`could not show trace ${traceId}: ${error.message}`, true);
  }
}

function drawTrace(trace) {
  const facts = document.getElementById("trace-facts");
  facts.replaceChildren(
    `${trace.root} · ${ms(trace.duration_ms)} ms · ${trace.span_count} spans · ` +
    `${trace.services.join(", ")} · started ${when(trace.start_ns)}` +
    (trace.dropped_spans ? ` · ${trace.dropped_spans} span(s) dropped` : "") +
    (trace.error ? " · has errors" : ""));
  const start = trace.start_ns;
  const total = Math.max(1, trace.duration_ms * 1e6);
  const rows = nested(trace.spans).map(({ span, depth }) => {
    const label = el("div", { class: "label" }, span.name, el("span", { class: "svc" }, span.service));
    label.style.paddingLeft = `${depth * 14}px`;
    if (span.links.length) label.append(el("span", { class: "linked" }, `↗ ${span.links.length} link(s)`));
    const bar = el("div", { class: `bar ${span.status.code === "error" ? "error" : ""}` });
    const left = (100 * (span.start_ns - start)) / total;
    bar.style.left = `${left}%`;
    bar.style.width = `${(100 * Math.max(0, span.end_ns - span.start_ns)) / total}%`;
    bar.style.background = colorOf(span.service);
    const note = el("span", { class: "bar-ms" }, `${ms(span.duration_ms)} ms`);
    note.style.left = `calc(${Math.min(left, 90)}% + 4px)`;
    note.style.top = "0";
    const row = el("div", { class: "row" }, label, el("div", { class: "track" }, bar, note));
    row.addEventListener("click", () => {
      document.querySelectorAll(".row.selected").forEach((r) => r.classList.remove("selected"));
      row.classList.add("selected");
      drawDetail(span);
    });
    return row;
  });
  document.getElementById("waterfall").replaceChildren(...rows);
}

function drawDetail(span) {
  const kv = (key, value) => el("tr", {}, el("th", {}, key), el("td", {}, value));
  const json = (value) => (typeof value === "string" ? value : JSON.stringify(value));
  const detail = document.getElementById("detail");
  const table = el("table", { class: "kv" },
    kv("span", `${span.name} (${span.kind}, ${span.service})`),
    kv("span id", span.span_id),
    kv("parent", span.parent_span_id || "(root)"),
    kv("duration", `${ms(span.duration_ms)} ms from ${when(span.start_ns)}`),
    kv("status", span.status.code + (span.status.message ? `: ${span.status.message}` : "")),
    ...Object.entries(span.attributes).map(([key, value]) => kv(key, json(value))));
  const events = span.events.map((e) => el("li", {},
    `${when(e.time_ns)} ${e.name} `, el("span", { class: "mono" }, JSON.stringify(e.attributes))));
  const links = span.links.map((l) => el("li", {},
    traceLink(l.trace_id), ` span ${l.span_id} `, el("span", { class: "mono" }, JSON.stringify(l.attributes))));
  detail.replaceChildren(table,
    ...(events.length ? [el("h2", {}, "events"), el("ul", {}, ...events)] : []),
    ...(links.length ? [el("h2", {}, "links"), el("ul", {}, ...links)] : []));
  detail.hidden = false;
}

// --- which page ---------------------------------------------------------------------------

const match = location.pathname.match(/^\/traces\/([0-9a-fA-F]{32})\/?$/);
if (match) {
  document.getElementById("trace-view").hidden = false;
  showTrace(match[1].toLowerCase());
} else {
  document.getElementById("list-view").hidden = false;
  showList();
}
