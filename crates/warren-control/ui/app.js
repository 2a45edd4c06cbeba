// Warren's dashboard. Reads the public API only; no libraries, no build step.
"use strict";

const STATS_EVERY_MS = 1000;
const LIST_EVERY_MS = 2000;
const DETAIL_EVERY_MS = 3000;
/// Samples kept per chart: two minutes at one a second.
const HISTORY = 120;

const $ = (sel) => document.querySelector(sel);

// ---- formatting --------------------------------------------------------------

function fmtBytes(n) {
  if (n == null) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
}

function fmtDuration(ms) {
  if (ms == null || ms < 0) return "-";
  const s = Math.floor(ms / 1000);
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m " + (s % 60) + "s";
  return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
}

function fmtTime(ms) {
  if (!ms) return "-";
  return new Date(ms).toLocaleTimeString();
}

function fmtNum(v, digits) {
  if (v == null || !isFinite(v)) return "-";
  return Number(v).toFixed(digits);
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("data-") || k.startsWith("aria-")) e.setAttribute(k, v);
    else e[k] = v;
  }
  for (const c of children) {
    if (c == null) continue;
    e.append(c instanceof Node ? c : String(c));
  }
  return e;
}

function stateChip(state) {
  return el("span", { class: "state state-" + state }, state);
}

async function getJSON(path) {
  const answer = await fetch(path, { cache: "no-store" });
  let body = null;
  try { body = await answer.json(); } catch (_) { /* not JSON */ }
  if (!answer.ok) {
    const err = new Error((body && body.message) || answer.statusText);
    err.status = answer.status;
    err.code = body && body.code;
    throw err;
  }
  return body;
}

// ---- charts: drawn by hand on <canvas> ----------------------------------------

class Chart {
  /// series: [{name, color}]; samples are {t, values: [number|null per series]}.
  constructor(canvas, series, opts) {
    this.canvas = canvas;
    this.series = series;
    this.digits = (opts && opts.digits) || 0;
    this.samples = [];
  }

  push(t, values) {
    this.samples.push({ t, values });
    if (this.samples.length > HISTORY) this.samples.shift();
    this.canvas.dataset.points = String(this.samples.length);
    this.canvas.dataset.last = JSON.stringify(values);
    this.draw();
  }

  draw() {
    const c = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth, h = c.clientHeight;
    if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
      c.width = Math.round(w * dpr);
      c.height = Math.round(h * dpr);
    }
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    const left = 44, right = 8, top = 18, bottom = 18;
    const pw = w - left - right, ph = h - top - bottom;

    let max = 0;
    for (const s of this.samples) for (const v of s.values) if (v != null && v > max) max = v;
    const yMax = niceCeiling(max);

    // Grid and y labels.
    g.font = "11px system-ui, sans-serif";
    g.textBaseline = "middle";
    g.textAlign = "right";
    for (let i = 0; i <= 4; i++) {
      const y = top + ph - (ph * i) / 4;
      g.strokeStyle = i === 0 ? "#c9ced8" : "#eceef2";
      g.beginPath(); g.moveTo(left, y); g.lineTo(left + pw, y); g.stroke();
      g.fillStyle = "#6b7385";
      const tick = (yMax * i) / 4;
      g.fillText(fmtNum(tick, Number.isInteger(tick) ? 0 : tick < 1 ? 2 : 1), left - 6, y);
    }
    g.textAlign = "left";
    g.fillText(`last ${HISTORY} s`, left, h - 7);

    // One line per series; null values break the line.
    const n = HISTORY;
    const x = (i) => left + pw * ((i + (n - this.samples.length)) / (n - 1));
    const y = (v) => top + ph - (ph * v) / yMax;
    this.series.forEach((series, k) => {
      g.strokeStyle = series.color;
      g.lineWidth = 2;
      g.beginPath();
      let pen = false;
      this.samples.forEach((s, i) => {
        const v = s.values[k];
        if (v == null) { pen = false; return; }
        if (pen) g.lineTo(x(i), y(v)); else g.moveTo(x(i), y(v));
        pen = true;
      });
      g.stroke();
      // Points, so a lone sample between gaps still shows.
      g.fillStyle = series.color;
      this.samples.forEach((s, i) => {
        const v = s.values[k];
        if (v != null) { g.beginPath(); g.arc(x(i), y(v), 2.5, 0, 2 * Math.PI); g.fill(); }
      });
    });

    // Legend with each series' latest value, top right.
    g.textAlign = "right";
    g.textBaseline = "top";
    let lx = left + pw;
    const latest = (k) => {
      for (let i = this.samples.length - 1; i >= 0; i--) if (this.samples[i].values[k] != null) return this.samples[i].values[k];
      return null;
    };
    for (let k = this.series.length - 1; k >= 0; k--) {
      const text = `${this.series[k].name} ${fmtNum(latest(k), this.digits)}`;
      g.fillStyle = this.series[k].color;
      g.fillText(text, lx, 2);
      lx -= g.measureText(text).width + 14;
    }
    g.lineWidth = 1;
  }
}

function niceCeiling(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  // Multiples of four, so the four grid steps are round numbers.
  for (const m of [1, 2, 4, 8, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

const charts = {
  creations: new Chart($("#chart-creations"), [{ name: "per s", color: "#2f6fde" }], { digits: 2 }),
  latency: new Chart($("#chart-latency"), [
    { name: "fresh", color: "#2f6fde" },
    { name: "pool", color: "#e07a1f" },
  ], { digits: 1 }),
  running: new Chart($("#chart-running"), [{ name: "running", color: "#1f9d55" }], { digits: 0 }),
};

// ---- overview ------------------------------------------------------------------

let previousStats = null;

function latencyTotals(stats, source) {
  let count = 0, sum = 0;
  for (const l of stats.create_latency) if (l.source === source) { count += l.count; sum += l.sum_secs; }
  return { count, sum };
}

function countInState(stats, state) {
  return stats.sandboxes.filter((s) => s.state === state).reduce((a, s) => a + s.count, 0);
}

function fillTally(table, entries) {
  const body = table.tBodies[0];
  body.replaceChildren();
  if (!entries.length) body.append(el("tr", {}, el("td", { class: "muted" }, "none yet")));
  for (const [k, v] of entries) body.append(el("tr", {}, el("td", {}, k), el("td", {}, v)));
}

function renderStats(stats) {
  const running = countInState(stats, "running");
  const cap = stats.capacity;
  const execs = Object.values(stats.execs).reduce((a, b) => a + b, 0);
  $("#version").textContent = "v" + stats.version;
  $("#ov-running").textContent = running;
  $("#ov-capacity").textContent = `${cap.sandboxes_used} / ${cap.max_sandboxes}`;
  $("#ov-cpus").textContent = `${fmtNum(cap.cpus_used, 1)} / ${fmtNum(cap.cpus_total, 0)}`;
  $("#ov-memory").textContent = `${fmtBytes(cap.memory_used_bytes)} / ${fmtBytes(cap.memory_total_bytes)}`;
  $("#ov-creations").textContent = `${stats.creations_total} (${stats.creations_failed_total})`;
  $("#ov-execs").textContent = execs;
  $("#ov-queue").textContent = stats.queue_depth;
  const pools = Object.entries(stats.pool_idle || {});
  $("#ov-pool").textContent = pools.length ? pools.reduce((a, [, n]) => a + n, 0) : "no pools";
  $("#ov-pool").title = pools.map(([image, n]) => `${image}: ${n}`).join("\n");
  $("#ov-images").textContent = fmtBytes(stats.images.fetched_bytes);

  fillTally($("#ends"), Object.entries(stats.ends));
  fillTally($("#security"), Object.entries(stats.security_events));
  fillTally($("#states"), stats.sandboxes.map((s) => [`${s.backend} ${s.state}`, s.count]));

  const t = stats.time_ms;
  if (previousStats && t > previousStats.time_ms) {
    const dt = (t - previousStats.time_ms) / 1000;
    const rate = Math.max(0, stats.creations_total - previousStats.creations_total) / dt;
    // Mean create time of the creates that finished since the last sample;
    // no creates, no point (a gap, not a zero).
    const mean = (source) => {
      const now = latencyTotals(stats, source), before = latencyTotals(previousStats, source);
      const n = now.count - before.count;
      return n > 0 ? ((now.sum - before.sum) / n) * 1000 : null;
    };
    charts.creations.push(t, [rate]);
    charts.latency.push(t, [mean("fresh"), mean("pool")]);
  }
  charts.running.push(t, [running]);
  previousStats = stats;
}

async function pollStats() {
  try {
    renderStats(await getJSON("/v1/stats"));
    $("#status").textContent = "live";
    $("#status").className = "status live";
  } catch (e) {
    $("#status").textContent = "unreachable";
    $("#status").className = "status down";
  }
}

// ---- nodes (a cluster's API server only) ------------------------------------------

/// `GET /v1/cluster` answers on a cluster's API servers; a single server
/// answers 404 (and a key outside the root project 403): then the section
/// stays hidden and is not asked again.
let clusterServed = true;

function nodesSection() {
  let section = $("#nodes");
  if (section) return section;
  section = el("section", { id: "nodes", "aria-label": "Cluster nodes" },
    el("h2", {}, "Nodes ", el("span", { id: "nodes-summary", class: "muted" })),
    el("table", { id: "node-list" },
      el("thead", {}, el("tr", {}, ...["Node", "Address", "Backends", "Running", "Live / max", "CPUs",
        "Memory committed / host", "Disk free", "Queue", "Heartbeat"].map((h) => el("th", {}, h)))),
      el("tbody")));
  $("#overview").after(section);
  return section;
}

function renderCluster(cluster) {
  nodesSection();
  const now = Date.now();
  const lost = cluster.lost ? `, ${cluster.lost} sandbox${cluster.lost === 1 ? "" : "es"} lost with their nodes` : "";
  $("#nodes-summary").textContent = `${cluster.nodes.length} up, ${cluster.running} running${lost}`;
  const body = $("#node-list").tBodies[0];
  body.replaceChildren();
  for (const n of cluster.nodes) {
    const b = n.books;
    const running = Object.values(n.running_by_backend).reduce((a, v) => a + v, 0);
    body.append(el("tr", { "data-node": n.name },
      el("td", { class: "id" }, n.name),
      el("td", { class: "id" }, n.url),
      el("td", {}, n.backends.join(", ")),
      el("td", {}, running),
      el("td", {}, `${b.sandboxes_live} / ${b.sandboxes_max}`),
      el("td", {}, fmtNum(n.cpus, 0)),
      el("td", {}, `${fmtBytes(b.memory_mib_committed * 1048576)} / ${fmtBytes(n.memory_total_mib * 1048576)}`),
      el("td", {}, fmtBytes(n.disk_free_mib * 1048576)),
      el("td", {}, `${b.queue_waiting} / ${b.queue_limit}`),
      el("td", {}, fmtDuration(now - n.heartbeat_at_ms) + " ago")));
  }
}

async function pollCluster() {
  if (!clusterServed) return;
  try {
    renderCluster(await getJSON("/v1/cluster"));
  } catch (e) {
    // Not a cluster (or not ours to see): no section. Anything else (an
    // unreachable server) is shown by the status badge; try again later.
    if (e.status === 404 || e.status === 403 || e.status === 401 || e.status === 501) {
      clusterServed = false;
      const section = $("#nodes");
      if (section) section.remove();
    }
  }
}

// ---- the sandbox list -------------------------------------------------------------

let selectedId = null;

function listQuery() {
  const params = new URLSearchParams();
  const state = $("#filter-state").value;
  const label = $("#filter-label").value.trim();
  if (state) params.set("state", state);
  if (label) {
    if (!/^[^=]+=.*$/.test(label)) throw new Error("label filter must be key=value");
    params.set("label", label);
  }
  const q = params.toString();
  return "/v1/sandboxes" + (q ? "?" + q : "");
}

function renderList(sandboxes) {
  const backend = $("#filter-backend").value;
  const shown = sandboxes.filter((s) => !backend || s.backend === backend).reverse();
  const body = $("#list").tBodies[0];
  body.replaceChildren();
  const now = Date.now();
  for (const s of shown) {
    const labels = Object.entries(s.labels || {}).map(([k, v]) => el("span", { class: "label-chip" }, `${k}=${v}`));
    const end = s.ended_at_ms || now;
    const row = el("tr", { "data-id": s.id, class: s.id === selectedId ? "selected" : "" },
      el("td", { class: "id" }, s.id),
      el("td", {}, stateChip(s.state)),
      el("td", {}, s.backend),
      el("td", {}, s.image),
      el("td", {}, ...labels),
      el("td", {}, `${s.resources.cpus} / ${s.resources.memory_mib} MiB`),
      el("td", {}, fmtDuration(end - s.created_at_ms)),
      el("td", {}, s.end_reason || ""));
    row.addEventListener("click", () => showDetail(s.id));
    body.append(row);
  }
  $("#list-count").textContent = `${shown.length} shown`;
}

async function pollList() {
  let path;
  try {
    path = listQuery();
  } catch (e) {
    $("#list-error").textContent = e.message;
    return;
  }
  try {
    const answer = await getJSON(path);
    $("#list-error").textContent = "";
    renderList(answer.sandboxes);
  } catch (e) {
    $("#list-error").textContent = e.message;
  }
}

// ---- the detail view ----------------------------------------------------------------

function fillDl(dl, pairs) {
  dl.replaceChildren();
  for (const [k, v] of pairs) {
    if (v == null || v === "") continue;
    dl.append(el("dt", {}, k), el("dd", {}, v instanceof Node ? v : String(v)));
  }
}

function describeRequest(kind, request) {
  if (!request) return "";
  if (request.argv) return request.argv.join(" ");
  if (request.command) return request.command;
  if (request.path) return request.path;
  if (request.phase) return "phase " + request.phase;
  return JSON.stringify(request);
}

function exitCell(status, exitCode, signal) {
  const text = [status, exitCode != null ? "exit " + exitCode : null, signal != null ? "signal " + signal : null]
    .filter(Boolean).join(", ");
  const bad = (status && status !== "ok" && status !== "running" && status !== "done") || (exitCode != null && exitCode !== 0);
  return el("td", { class: bad ? "exit-bad" : "" }, text);
}

/// The trajectory log when the server keeps one; otherwise the exec records.
async function renderExecs(id) {
  const table = $("#detail-execs");
  const head = table.tHead, body = table.tBodies[0];
  let steps = null;
  try {
    steps = (await getJSON(`/v1/sandboxes/${id}/trajectory`)).steps;
  } catch (_) {
    steps = null;
  }
  body.replaceChildren();
  if (steps) {
    $("#detail-exec-source").textContent = "(trajectory log)";
    head.replaceChildren(el("tr", {}, ...["Step", "Kind", "Request", "Result", "Wall", "Started"].map((h) => el("th", {}, h))));
    for (const s of steps) {
      const r = s.result || {};
      body.append(el("tr", { "data-step": s.step },
        el("td", {}, s.step), el("td", {}, s.kind),
        el("td", {}, el("code", {}, describeRequest(s.kind, s.request))),
        exitCell(r.status || s.state, r.exit_code, r.signal),
        el("td", {}, r.wall_time_secs != null ? fmtNum(r.wall_time_secs, 3) + " s" : ""),
        el("td", {}, fmtTime(s.started_at_ms))));
    }
    if (!steps.length) body.append(el("tr", {}, el("td", { class: "muted" }, "no steps yet")));
    return;
  }
  $("#detail-exec-source").textContent = "(exec records)";
  head.replaceChildren(el("tr", {}, ...["Exec", "Result", "Wall", "CPU", "Peak memory", "Started"].map((h) => el("th", {}, h))));
  let execs = [];
  try {
    execs = (await getJSON(`/v1/sandboxes/${id}/exec`)).execs;
  } catch (e) {
    body.append(el("tr", {}, el("td", { class: "error" }, e.message)));
    return;
  }
  for (const x of execs) {
    body.append(el("tr", { "data-exec": x.exec_id },
      el("td", { class: "id" }, x.exec_id),
      exitCell(x.status, x.exit_code, x.signal),
      el("td", {}, fmtNum(x.wall_time_secs, 3) + " s"),
      el("td", {}, fmtNum(x.cpu_time_secs, 3) + " s"),
      el("td", {}, fmtBytes(x.peak_memory_bytes)),
      el("td", {}, fmtTime(x.started_at_ms))));
  }
  if (!execs.length) body.append(el("tr", {}, el("td", { class: "muted" }, "no execs yet")));
}

async function renderEvents(id, info) {
  const body = $("#detail-events").tBodies[0];
  body.replaceChildren();
  if (info.state === "ended") {
    body.append(el("tr", {}, el("td", { class: "muted", colSpan: 5 }, "kept only while the sandbox lives")));
    return;
  }
  try {
    const list = await getJSON(`/v1/sandboxes/${id}/events`);
    for (const e of list.events.slice().reverse()) {
      body.append(el("tr", {},
        el("td", {}, e.seq), el("td", {}, fmtTime(e.time_ms)), el("td", {}, e.kind),
        el("td", {}, e.pid ? `${e.comm} (${e.pid})` : ""),
        el("td", {}, [e.syscall, e.detail].filter(Boolean).join(": "))));
    }
    if (!list.events.length) body.append(el("tr", {}, el("td", { class: "muted", colSpan: 5 }, "none")));
  } catch (e) {
    body.append(el("tr", {}, el("td", { class: "error", colSpan: 5 }, e.message)));
  }
}

async function refreshDetail() {
  const id = selectedId;
  if (!id) return;
  let info;
  try {
    info = await getJSON(`/v1/sandboxes/${id}`);
  } catch (e) {
    fillDl($("#detail-state"), [["error", e.message]]);
    return;
  }
  if (id !== selectedId) return;
  const r = info.resources, u = info.usage;
  fillDl($("#detail-state"), [
    ["state", stateChip(info.state)],
    ["end reason", info.end_reason],
    ["end message", info.end_message],
    ["backend", info.backend],
    ["image", info.image],
    ["network", info.network],
    ["phase", info.phase],
    ["from pool", info.from_pool ? "yes" : "no"],
    ["labels", Object.entries(info.labels || {}).map(([k, v]) => `${k}=${v}`).join(", ")],
    ["created", new Date(info.created_at_ms).toLocaleString()],
    ["ended", info.ended_at_ms ? new Date(info.ended_at_ms).toLocaleString() : null],
    ["idle timeout", info.idle_timeout_secs + " s"],
    ["lifetime", info.lifetime_secs + " s"],
  ]);
  fillDl($("#detail-resources"), [
    ["cpus", r.cpus],
    ["memory", r.memory_mib + " MiB" + (u ? ` (using ${fmtBytes(u.memory_bytes)}, peak ${fmtBytes(u.memory_peak_bytes)})` : "")],
    ["disk", r.disk_mib + " MiB" + (u ? ` (using ${fmtBytes(u.disk_bytes)})` : "")],
    ["pids", r.pids + (u ? ` (using ${u.pids})` : "")],
    ["inodes", r.inodes || null],
    ["open files", r.open_files || null],
    ["cpu time", u ? fmtNum(u.cpu_time_secs, 2) + " s" : null],
  ]);
  await Promise.all([renderExecs(id), renderEvents(id, info)]);
  $("#detail").dataset.loaded = id;
}

function showDetail(id) {
  selectedId = id;
  $("#detail").hidden = false;
  $("#detail").dataset.loaded = "";
  $("#detail-id").textContent = id;
  for (const row of $("#list").tBodies[0].rows) row.classList.toggle("selected", row.dataset.id === id);
  refreshDetail();
}

$("#detail-close").addEventListener("click", () => {
  selectedId = null;
  $("#detail").hidden = true;
});

for (const sel of ["#filter-state", "#filter-backend"]) $(sel).addEventListener("change", pollList);
$("#filter-label").addEventListener("input", pollList);
$("#filters").addEventListener("submit", (e) => e.preventDefault());
window.addEventListener("resize", () => Object.values(charts).forEach((c) => c.draw()));

pollStats();
pollList();
pollCluster();
setInterval(pollStats, STATS_EVERY_MS);
setInterval(pollList, LIST_EVERY_MS);
setInterval(pollCluster, LIST_EVERY_MS);
setInterval(refreshDetail, DETAIL_EVERY_MS);
