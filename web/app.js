// prefixgate admin UI: plain JavaScript, no build step. Talks to the admin
// API with the bearer token kept in sessionStorage (this browser session only).
"use strict";

const api = "/admin/v1";
const state = { pinOffset: 0, pinLimit: 20, ttfb: {}, lastTtfb: {}, replicas: [], instances: [], charts: [], timelineAt: 0 };
const $ = (sel) => document.querySelector(sel);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    // CSSOM, not a style attribute: the page's CSP forbids inline styles.
    else if (k === "style") node.style.cssText = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

class AuthError extends Error {}

async function call(method, path, body) {
  const headers = { accept: "application/json" };
  const token = sessionStorage.getItem("prefixgate-token");
  if (token) headers.authorization = "Bearer " + token;
  if (body !== undefined) headers["content-type"] = "application/json";
  const res = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  if (res.status === 401) throw new AuthError("unauthorized");
  const text = await res.text();
  const data = text ? JSON.parse(text) : null;
  if (!res.ok) throw new Error((data && data.error && data.error.message) || res.statusText);
  return data;
}

function showLogin(message) {
  $("#app").hidden = true;
  $("#login").hidden = false;
  $("#login-error").textContent = message || "";
  $("#token").focus();
}

function showApp() {
  $("#login").hidden = true;
  $("#app").hidden = false;
}

function status(text, isError) {
  const s = $("#status");
  s.textContent = text;
  s.classList.toggle("error", !!isError);
}

function fmtTokens(n) {
  if (n === null || n === undefined) return "?";
  return n >= 1000 ? (n / 1000).toFixed(1) + "k" : String(n);
}

function ttfbLabel(points) {
  return points && points.length ? ` ${(points[points.length - 1] * 1000).toFixed(0)} ms` : " —";
}

function sparkline(points) {
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("viewBox", "0 0 100 20");
  svg.setAttribute("role", "img");
  const last = points.length ? points[points.length - 1] : null;
  svg.setAttribute("aria-label", last === null ? "no data yet" : "last " + (last * 1000).toFixed(0) + " ms");
  if (points.length > 1) {
    const max = Math.max(...points, 0.001);
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("points", points.map((p, i) => `${(i / (points.length - 1)) * 100},${20 - (p / max) * 18}`).join(" "));
    svg.append(line);
  }
  return svg;
}

async function action(id, verb, confirmText, query = "") {
  if (confirmText && !window.confirm(confirmText)) return;
  try {
    if (verb === "remove") await call("DELETE", `${api}/replicas/${encodeURIComponent(id)}`);
    else await call("POST", `${api}/replicas/${encodeURIComponent(id)}/${verb}${query}`);
    status(`${verb} ${id}: done`);
  } catch (e) {
    status(`${verb} ${id}: ${e.message}`, true);
  }
  refresh();
}

// What the receipts taught of a replica's capacity (GET /admin/v1/capacity:
// kv_tokens declared, learned_tokens, evidence).
function learnedLabel(c) {
  const e = c.evidence || {};
  const held = e.wall_sessions !== undefined ? ` (${e.wall_sessions} session${e.wall_sessions === 1 ? "" : "s"} held)` : "";
  const wall = e.wall_tokens !== undefined ? `wall seen at ${fmtTokens(e.wall_tokens)}${held}` : "no wall seen";
  return `declared ${fmtTokens(c.kv_tokens)} · learned ${fmtTokens(c.learned_tokens)} · ${wall}`;
}

function learnedTitle(c) {
  const e = c.evidence || {};
  const rate = c.prefill_tokens_per_s !== undefined ? `; prefill measured at ${fmtTokens(c.prefill_tokens_per_s)} tokens/s` : "";
  return `receipts: ${e.receipts_kept || 0} kept (the most resident when kept: ${e.kept_at_tokens || 0} tokens; kept across ${e.kept_sessions || 0} sessions' turns), ${e.receipts_lost || 0} lost${rate}`;
}

function renderReplicas(replicas, capacity) {
  const body = $("#replicas tbody");
  body.replaceChildren();
  const cap = Object.fromEntries((capacity ? capacity.replicas : []).map((r) => [r.replica, r]));
  for (const r of replicas) {
    const c = cap[r.id] || {};
    const kv = c.kv_tokens || r.kv_tokens;
    const ws = c.working_set_tokens !== undefined ? c.working_set_tokens : r.working_set_tokens;
    const pct = kv ? Math.min(100, (ws / kv) * 100) : 0;
    const bar = el("div", { class: "bar" + (c.over_capacity ? " over" : ""), title: `${ws} of ${kv || "unknown"} tokens` },
      el("span", { style: `width:${pct}%` }));
    const actions = el("td", {});
    if (r.admin_state === "active") {
      actions.append(el("button", { type: "button", "data-action": "drain", onclick: () => action(r.id, "drain", `Drain ${r.id}? New requests stop going to it; in-flight ones finish.`) }, "Drain"));
      actions.append(el("button", { type: "button", "data-action": "handoff", title: "Drain, and move its streams that can go on to other replicas now", onclick: () => action(r.id, "drain", `Drain ${r.id} and hand its streams over? New requests stop going to it; streams that can go on elsewhere move now, the rest finish.`, "?handoff=true") }, "Drain, hand over"));
      actions.append(el("button", { type: "button", class: "danger", "data-action": "disable", onclick: () => action(r.id, "disable", `Disable ${r.id}? It takes no traffic until enabled.`) }, "Disable"));
    } else if (r.admin_state === "draining") {
      actions.append(el("button", { type: "button", "data-action": "resume", onclick: () => action(r.id, "resume") }, "Resume"));
    } else {
      actions.append(el("button", { type: "button", "data-action": "enable", onclick: () => action(r.id, "enable") }, "Enable"));
    }
    // A discovered replica belongs to its source: it is disabled here, removed there.
    if (r.source === "static" || r.source === "api") {
      actions.append(el("button", { type: "button", class: "danger", "data-action": "remove", onclick: () => action(r.id, "remove", `Remove ${r.id} and its pins?`) }, "Remove"));
    }
    const inflight = r.admin_state === "draining" ? `${r.inflight} (draining…)` : `${r.inflight}` + (r.large_inflight ? ` / ${r.large_inflight} large` : "");
    body.append(el("tr", { "data-replica": r.id },
      el("td", {}, el("strong", {}, r.id), el("br"), el("small", {}, r.url), el("br"),
        el("small", { class: "source" }, r.left_source_at ? `${r.source} (left it; draining)` : r.source)),
      el("td", {}, el("span", { class: "badge health " + r.health }, r.health)),
      el("td", {}, el("span", { class: "badge state " + r.admin_state }, r.admin_state)),
      el("td", { class: "inflight" }, inflight),
      el("td", {}, r.pins),
      el("td", {}, r.models.join(", ") || "—"),
      el("td", {}, bar, el("span", { class: "bar-label" }, `${fmtTokens(ws)} / ${fmtTokens(kv)}`), el("br"),
        el("small", { class: "sessions" }, `${c.resident_sessions || 0} session(s)` +
          (c.resident_tokens ? ` holding ${fmtTokens(c.resident_tokens)} (projected)` : "") +
          (c.room_tokens !== undefined ? ` · room ${fmtTokens(Math.max(0, c.room_tokens))}` : "")), el("br"),
        el("small", { class: "learned", title: learnedTitle(c) }, learnedLabel(c))),
      // The value first, on its own line under the header; the trend below it.
      el("td", { class: "ttfb" }, el("span", { class: "ttfb-value" }, ttfbLabel(state.ttfb[r.id])), sparkline(state.ttfb[r.id] || [])),
      actions));
  }
  for (const select of [$("#pin-replica"), $("#event-replica")]) {
    const current = select.value;
    select.replaceChildren(el("option", { value: "" }, "all"), ...replicas.map((r) => el("option", { value: r.id }, r.id)));
    select.value = current;
  }
}

function renderCapacity(capacity) {
  const banner = $("#capacity-banner");
  banner.hidden = !(capacity && capacity.warning);
  banner.textContent = capacity && capacity.warning ? capacity.warning : "";
  const q = capacity && capacity.sessions;
  const held = $("#held");
  held.hidden = !q || (!q.held && !q.waited && !q.projected_tokens);
  if (q) {
    const projection = q.projected_tokens
      ? ` New sessions are admitted at what sessions here grew to: ~${fmtTokens(q.projected_tokens)} ` +
        `(learned from ${q.projections_learned} session(s), ${q.projection_links} prompt(s) of their own).`
      : "";
    held.textContent = `${q.held} new session(s) waiting for room at the KV wall; ${q.waited} waited so far ` +
      `(mean ${q.mean_wait_ms} ms, longest ${q.max_wait_seen_ms} ms, ${q.over_capacity} admitted over capacity).` +
      projection;
    renderQueue(q.queue || []);
  }
}

// The held sessions in the order they go, each with its class and client.
function renderQueue(queue) {
  const list = $("#queue");
  list.hidden = queue.length === 0;
  list.replaceChildren(...queue.map((w) => {
    const item = document.createElement("li");
    item.dataset.class = w.class;
    item.textContent = `${w.class} · ${w.client} · ~${fmtTokens(w.tokens)} · waiting ${w.waited_ms} ms`;
    return item;
  }));
}

// Mean time to first byte per replica since the last poll, from the
// Prometheus histogram's _sum and _count.
function updateTtfb(metricsText) {
  const totals = {};
  for (const line of metricsText.split("\n")) {
    const m = line.match(/^prefixgate_upstream_ttfb_seconds_(sum|count)\{replica="([^"]+)",route="[^"]*"\} ([0-9.eE+-]+)$/);
    if (!m) continue;
    const t = (totals[m[2]] = totals[m[2]] || { sum: 0, count: 0 });
    t[m[1]] += Number(m[3]);
  }
  for (const [id, t] of Object.entries(totals)) {
    const prev = state.lastTtfb[id] || { sum: 0, count: 0 };
    state.lastTtfb[id] = t;
    if (t.count <= prev.count) continue;
    const series = (state.ttfb[id] = state.ttfb[id] || []);
    series.push((t.sum - prev.sum) / (t.count - prev.count));
    if (series.length > 60) series.shift();
  }
}

// Fleet over time: the gateway's own timeline (GET /admin/v1/timeline),
// drawn with uPlot (vendored in web/vendor/uplot). One chart per question an
// operator asks; a line per replica.
const PALETTE = ["#0969da", "#cf222e", "#1a7f37", "#9a6700", "#8250df", "#bf3989", "#1b7c83", "#953800"];
const CLASSES = ["interactive", "default", "background"];
const CLASS_COLORS = { interactive: "#cf222e", default: "#0969da", background: "#57606a" };

function chartSpecs(t) {
  const color = (i) => PALETTE[i % PALETTE.length];
  const per = (key, label = (r) => r.replica, dash, f = (v) => v) => t.replicas.map((r, i) =>
    ({ label: label(r), color: color(i), dash, values: r[key].map((v) => (v === null ? null : f(v))) }));
  const sum = (rows) => rows[0].map((_, i) => rows.reduce((n, row) => n + (row[i] || 0), 0));
  const paused = (c) => t.replicas.length ? sum(t.replicas.map((r) => r.paused.map((p) => (p ? p[c] : 0)))) : [];
  return [
    { name: "kv", title: "KV: resident session tokens (solid), capacity and learned wall (dashed)", series: [
      ...per("resident_tokens"),
      ...per("capacity_tokens", (r) => `${r.replica} capacity`, [6, 4]),
      ...per("wall_tokens", (r) => `${r.replica} wall`, [2, 3])] },
    { name: "warm", title: "Warm share of prompt tokens (%)", series: per("warm_share", undefined, undefined, (v) => v * 100) },
    { name: "ttft", title: "Time to first token, ms: p50 (solid), p90 (dashed)", series: [
      ...per("ttft_p50_ms", (r) => `${r.replica} p50`), ...per("ttft_p90_ms", (r) => `${r.replica} p90`, [6, 4])] },
    { name: "inflight", title: "Requests in flight", series: per("inflight") },
    { name: "waiting", title: "Held sessions (solid) and paused turns (dashed), by class", series: [
      ...CLASSES.map((c) => ({ label: `held ${c}`, color: CLASS_COLORS[c], values: t.held.map((h) => h[c]) })),
      ...CLASSES.map((c) => ({ label: `paused ${c}`, color: CLASS_COLORS[c], dash: [6, 4], values: paused(c) }))] },
    { name: "failovers", title: "Failovers away from each replica, per sample", series: per("failovers") },
  ];
}

// An axis value in few characters: 150000 -> 150k.
function compact(v) {
  if (v === null || v === undefined) return "";
  const a = Math.abs(v);
  if (a >= 1e6) return +(v / 1e6).toFixed(1) + "M";
  if (a >= 1e3) return +(v / 1e3).toFixed(1) + "k";
  return +v.toFixed(2) + "";
}

function drawChart(container, spec, xs) {
  // A series with no value at all is left out (a wall never seen, say).
  const series = spec.series.filter((s) => s.values.some((v) => v !== null));
  const points = series.reduce((n, s) => n + s.values.filter((v) => v !== null).length, 0);
  const box = el("div", { class: "chart", "data-chart": spec.name, "data-points": String(points) }, el("h3", {}, spec.title));
  container.append(box);
  if (!points || typeof uPlot === "undefined") {
    box.append(el("p", { class: "empty" }, "no samples yet"));
    return null;
  }
  const opts = {
    width: Math.max(200, box.clientWidth - 16),
    height: 180,
    series: [{}, ...series.map((s) => ({ label: s.label, stroke: s.color, width: 1.5, dash: s.dash }))],
    axes: [{}, { size: 56, values: (u, splits) => splits.map(compact) }],
    legend: { live: false },
  };
  return new uPlot(opts, [xs, ...series.map((s) => s.values)], box);
}

function renderTimeline(t) {
  for (const c of state.charts) c.destroy();
  const charts = $("#charts");
  charts.replaceChildren();
  const xs = t.at.map((ms) => ms / 1000);
  const drawn = chartSpecs(t).map((spec) => [spec.name, drawChart(charts, spec, xs)]).filter(([, u]) => u);
  state.charts = drawn.map(([, u]) => u);
  // For the browser test (and a curious operator's console): the charts by name.
  window.prefixgateCharts = Object.fromEntries(drawn);
  const alive = state.instances.filter((i) => i.alive).length;
  $("#timeline-scope").textContent = (alive > 1
    ? `This is instance ${t.instance}'s timeline: each gateway instance keeps its own, of the traffic it served (open another instance's admin UI for its own).`
    : "This gateway's timeline.") + ` A sample every ${t.interval_ms / 1000} s; ${t.at.length} in the window.`;
}

async function loadTimeline(force) {
  // The samples come every few seconds: redrawn as often, not at each poll.
  if (!force && Date.now() - state.timelineAt < 2000) return;
  state.timelineAt = Date.now();
  renderTimeline(await call("GET", `${api}/timeline?window_s=${$("#timeline-window").value}`));
}

// Sessions at the KV wall: resident ones by replica, then the held.
async function loadSessions() {
  const list = await call("GET", `${api}/sessions?limit=200`);
  const ms = (n) => (n >= 1000 ? `${(n / 1000).toFixed(1)} s` : `${n} ms`);
  $("#session-table tbody").replaceChildren(...list.map((s) => el("tr", { "data-session": s.session || "held", "data-state": s.state },
    el("td", {}, s.replica || "—"),
    el("td", { class: "key" }, s.session ? s.session.slice(0, 12) + "…" : "(new)"),
    el("td", { class: "state " + s.state }, s.state),
    el("td", { class: "class" }, s.class),
    el("td", { class: "client" }, s.client),
    el("td", {}, fmtTokens(s.context_tokens)),
    el("td", {}, s.projected_tokens ? fmtTokens(s.projected_tokens) : "—"),
    el("td", {}, s.turns),
    el("td", {}, s.waited_ms ? ms(s.waited_ms) : "—"))));
}

async function loadPins() {
  const params = new URLSearchParams({ offset: state.pinOffset, limit: state.pinLimit });
  const q = $("#pin-search").value.trim();
  if (q) params.set("key_prefix", q);
  if ($("#pin-replica").value) params.set("replica", $("#pin-replica").value);
  const page = await call("GET", `${api}/pins?${params}`);
  const body = $("#pin-table tbody");
  body.replaceChildren(...page.items.map((p) => el("tr", { "data-key": p.key },
    el("td", { class: "key" }, p.key), el("td", {}, p.replica), el("td", {}, p.dialect),
    el("td", {}, p.pinned_by.replaceAll("_", " ")), el("td", {}, p.turns), el("td", {}, fmtTokens(p.est_tokens)),
    el("td", {}, new Date(p.last_used).toLocaleTimeString()),
    el("td", {}, el("button", { type: "button", class: "danger", onclick: async () => {
      if (!window.confirm(`Delete pin ${p.key.slice(0, 8)}…?`)) return;
      await call("DELETE", `${api}/pins/${p.key}`);
      loadPins();
    } }, "Delete")))));
  const last = Math.min(page.total, state.pinOffset + page.items.length);
  $("#pins-page").textContent = page.total ? `${state.pinOffset + 1}–${last} of ${page.total}` : "no pins";
  $("#pins-prev").disabled = state.pinOffset === 0;
  $("#pins-next").disabled = last >= page.total;
}

const KINDS = ["failover", "replica_down", "replica_up", "pin_moved", "drain_started", "drain_completed", "resumed", "disabled",
  "enabled", "replica_added", "replica_removed", "replica_updated", "policy_changed", "pins_deleted", "capacity_warning",
  "capacity_cleared", "store_unreachable", "store_reachable", "replica_discovered", "replica_left_source", "replica_returned",
  "discovery_failed", "discovery_recovered", "discovery_held", "session_held", "session_over_capacity", "session_paused", "session_preempted", "kv_wall_seen", "kv_wall_forgotten",
  "stream_continued", "stream_not_continued"];

// An event caused by a traced request or action: its trace, linked when
// tracing.trace_url says where traces are shown.
function traceLink(id, template) {
  const label = ` (trace ${id.slice(0, 8)}…)`;
  if (!template) return el("small", { class: "trace", title: id }, label);
  return el("a", { class: "trace", href: template.replace("{trace_id}", id), target: "_blank", rel: "noopener", title: id }, label);
}

async function loadEvents() {
  const params = new URLSearchParams({ limit: 100 });
  if ($("#event-kind").value) params.set("kind", $("#event-kind").value);
  if ($("#event-replica").value) params.set("replica", $("#event-replica").value);
  const page = await call("GET", `${api}/events?${params}`);
  $("#events").replaceChildren(...page.items.map((e) => el("li", { class: "event " + e.kind, "data-kind": e.kind },
    el("time", { datetime: e.at }, new Date(e.at).toLocaleTimeString()),
    el("strong", {}, e.kind.replace(/_/g, " ")), " ",
    [e.replica, e.to_replica].filter(Boolean).join(" → "), e.detail ? ` — ${e.detail}` : "",
    e.trace_id ? traceLink(e.trace_id, page.trace_url) : "")));
}

// Gateway instances sharing this fleet (a shared store); alone, one line says so.
async function loadInstances() {
  const list = await call("GET", `${api}/instances`);
  state.instances = list;
  const alive = list.filter((i) => i.alive);
  const names = alive.map((i) => (i.this ? `${i.instance} (this one)` : i.instance));
  $("#instances").textContent = list.length === 1 && list[0].instance === "this"
    ? "One gateway instance (embedded store)."
    : `Gateway instances alive: ${alive.length} — ${names.join(", ")}` +
      (list.length > alive.length ? ` (${list.length - alive.length} gone quiet)` : "");
}

// Discovery sources: when each was last read, with what result.
async function loadDiscovery() {
  const sources = await call("GET", `${api}/discovery`);
  $("#discovery").hidden = sources.length === 0;
  $("#discovery-table tbody").replaceChildren(...sources.map((s) => el("tr", { "data-source": s.source },
    el("td", {}, el("strong", {}, s.source)),
    el("td", {}, el("span", { class: "badge result " + s.result }, s.stale ? "stale" : s.result)),
    el("td", {}, s.replicas),
    el("td", {}, s.last_resolution ? new Date(s.last_resolution).toLocaleTimeString() : "not yet"),
    el("td", {}, s.error || ""))));
}

async function refresh() {
  try {
    const [replicas, capacity, policy] = await Promise.all([
      call("GET", `${api}/replicas`), call("GET", `${api}/capacity`), call("GET", `${api}/policy`)]);
    showApp();
    try {
      updateTtfb(await (await fetch("/metrics")).text());
    } catch (_) { /* metrics are optional for the view */ }
    state.replicas = replicas;
    if (document.activeElement !== $("#policy-mode")) $("#policy-mode").value = policy.mode;
    renderReplicas(replicas, capacity);
    renderCapacity(capacity);
    await Promise.all([loadPins(), loadEvents(), loadInstances(), loadDiscovery(), loadSessions()]);
    await loadTimeline(false);
  } catch (e) {
    if (e instanceof AuthError) {
      const hadToken = !!sessionStorage.getItem("prefixgate-token");
      sessionStorage.removeItem("prefixgate-token");
      showLogin(hadToken ? "That token was refused. Check it and try again." : "");
    } else {
      status("Could not reach the admin API: " + e.message, true);
    }
  }
}

function init() {
  $("#event-kind").append(...KINDS.map((k) => el("option", { value: k }, k.replace(/_/g, " "))));
  $("#login-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem("prefixgate-token", $("#token").value);
    $("#token").value = "";
    refresh();
  });
  $("#add-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const f = new FormData(ev.target);
    const body = { id: f.get("id"), url: f.get("url") };
    for (const k of ["kv_tokens", "max_large_inflight"]) if (f.get(k)) body[k] = Number(f.get(k));
    if (f.get("api_key")) body.api_key = f.get("api_key");
    try {
      await call("POST", `${api}/replicas`, body);
      ev.target.reset();
      status(`added ${body.id}`);
    } catch (e) {
      status("add failed: " + e.message, true);
    }
    refresh();
  });
  $("#policy-mode").addEventListener("change", async (ev) => {
    try {
      const current = await call("GET", `${api}/policy`);
      await call("PUT", `${api}/policy`, { ...current, mode: ev.target.value });
      status(`routing mode is now ${ev.target.value}`);
    } catch (e) {
      status("policy change failed: " + e.message, true);
    }
  });
  let searchTimer;
  $("#pin-search").addEventListener("input", () => {
    clearTimeout(searchTimer);
    searchTimer = setTimeout(() => { state.pinOffset = 0; loadPins().catch((e) => status(e.message, true)); }, 200);
  });
  $("#pin-replica").addEventListener("change", () => { state.pinOffset = 0; loadPins(); });
  $("#pins-prev").addEventListener("click", () => { state.pinOffset = Math.max(0, state.pinOffset - state.pinLimit); loadPins(); });
  $("#pins-next").addEventListener("click", () => { state.pinOffset += state.pinLimit; loadPins(); });
  $("#event-kind").addEventListener("change", loadEvents);
  $("#timeline-window").addEventListener("change", () => loadTimeline(true));
  $("#event-replica").addEventListener("change", loadEvents);
  refresh();
  setInterval(() => { if (!$("#app").hidden) refresh(); }, 1000);
}

document.addEventListener("DOMContentLoaded", init);
