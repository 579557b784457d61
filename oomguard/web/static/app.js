// oomguard dashboard: plain JavaScript, no build step, no network beyond this server.
// Data: REST for the first load, then /api/stream (server-sent events) for live changes.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const MAX_POINTS = 600;
const COLORS = { host: "#7b61ff", cgroup: "#9aa3b5", gpu: ["#e4572e", "#17bebb", "#ffc914", "#76b041",
  "#2e86ab", "#a23b72", "#f18f01", "#3b1f2b"] };
const MARKER_COLORS = { oom: "#c62828", failure: "#b35900", restart: "#f0a030", batch: "#1f5fbf",
  checkpoint: "#2e7d32" };
const TERMINAL = new Set(["succeeded", "failed", "stopped"]);

// ended: the server said it is stopping (its stream's `end` event); nothing is asked of it after that.
const view = { status: null, attempts: [], points: [], markers: [], checkpoints: [], logAttempt: null, limitShown: null,
  ended: false };

// --- small helpers -----------------------------------------------------------------------------

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  for (const child of children) node.append(child === null || child === undefined ? "" : child);
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  return node;
}

async function api(path) {
  const response = await fetch(path, { headers: { Accept: "application/json" } });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
}

function clock(t) {
  return t ? new Date(t * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" }) : "–";
}

function batchText(micro, accum, world, global, asked) {
  if (!micro) return "–";
  const w = world && world > 1 ? ` × ${world}` : "";
  // a script without accumulation trains at micro × world: the global batch asked for is shown beside it
  const short = asked && global && asked !== global ? ` (asked ${asked})` : "";
  return `${micro} × ${accum ?? "?"}${w} = ${global ?? "?"}${short}`;
}

function askedGlobal() {
  return view.status ? view.status.asked_global_batch : null;
}

// At most one refresh per interval however fast events come (a progress record per step would
// starve a debounce for ever).
let pending = null;
function throttle(fn, ms) {
  if (pending) return;
  pending = setTimeout(() => { pending = null; fn(); }, ms);
}

// --- state -------------------------------------------------------------------------------------

function plainReason(doc) {
  const last = doc.failures.length ? doc.failures[doc.failures.length - 1] : null;
  if (!doc.supervisor_alive && !TERMINAL.has(doc.state)) {
    return `The supervisor is not running; the last state it recorded was "${doc.state}".`;
  }
  switch (doc.state) {
    case "running": {
      const base = `Training is running: attempt ${doc.attempt} at micro-batch ${doc.micro_batch} × accumulation ${doc.grad_accum}.`;
      return last ? `${base} It recovered from ${last.kind.replace("_", " ")} at micro-batch ${last.micro_batch}.` : base;
    }
    case "starting": return `Starting attempt ${doc.attempt + 1}.`;
    case "recovering": return `The worker stopped${last ? ` (${last.kind.replace("_", " ")})` : ""}; deciding what to do next.`;
    case "backoff": return "Waiting a moment before restarting after a failure.";
    case "succeeded": return "Training finished successfully.";
    case "failed": return "oomguard gave up on this run.";
    case "stopped": return "The run was stopped on request.";
    default: return doc.state;
  }
}

function renderStatus(doc) {
  view.status = doc;
  const state = $("state");
  state.textContent = doc.state;
  state.dataset.state = doc.state;
  $("attempt").textContent = `attempt ${doc.attempt}`;
  $("reason").textContent = plainReason(doc);
  const progress = progressText(doc.progress);
  const forecast = doc.forecast ? ` · ${doc.forecast.text}` : "";
  const liveness = doc.liveness ? ` · ${doc.liveness.text} (not a hang)` : "";
  const last = doc.failures.length ? doc.failures[doc.failures.length - 1] : null;
  const cause = last && last.cause ? ` · cause: ${last.cause.summary}` : "";
  $("detail").textContent = `${doc.reason}${progress}${liveness}${forecast}${cause} · updated ${clock(doc.updated)}`;
  $("batch").textContent = batchText(doc.micro_batch, doc.grad_accum, doc.world_size, doc.global_batch,
                                     doc.asked_global_batch);
  const warnings = doc.warnings || [];
  $("warnings").replaceChildren(...warnings.map((w) => el("li", {}, `attempt ${w.attempt}: ${w.message}`)));
  $("warnings").hidden = warnings.length === 0;
  renderBreakdown(doc.memory_breakdown);
  document.title = `oomguard · ${doc.state}`;
  if (memoryLimit() !== view.limitShown) { view.limitShown = memoryLimit(); scheduleChart(); }
}

// The step (the probe's optimizer steps where it reports them), its rate, the ETA where the total is
// known, and the allocator's peak against its limit: as `oomguard status` says it.
function progressText(p) {
  if (!p || p.step === undefined || p.step === null) return "";
  let text = ` · step ${p.step}${p.total_steps ? `/${p.total_steps}` : ""}`;
  if (p.source === "resume_point") text += " (resumed from its checkpoint)";  // a new attempt before its first step
  if (p.steps_per_s) text += ` · ${Number(p.steps_per_s).toPrecision(3)} steps/s`;
  if (p.eta_s !== null && p.eta_s !== undefined) text += ` · ETA ${Math.round(p.eta_s / 60)} min`;
  if (p.allocated_peak) text += ` · allocated peak ${bytes(p.allocated_peak)}${p.limit_bytes ? ` of ${bytes(p.limit_bytes)}` : ""}`;
  return text;
}

function renderBatchHistory() {
  const list = $("batch-history");
  const items = [];
  let previous = null;
  for (const a of view.attempts) {
    const text = batchText(a.micro_batch, a.grad_accum, a.world_size, a.global_batch, askedGlobal());
    if (text === previous) continue;
    previous = text;
    const why = a.kind ? ` (ended: ${a.kind})` : "";
    items.push(el("li", {}, `attempt ${a.attempt} at ${clock(a.started)}: ${text}${why}`));
  }
  list.replaceChildren(...items);
}

// --- what filled memory: one stacked bar per attempt (status's memory_breakdown) ----------------------

const PART_COLORS = { weights: "#2e86ab", gradients: "#76b041", optimizer_state: "#f18f01", activations: "#e4572e",
  cache: "#9aa3b5", trainer: "#7b61ff", "data-loader worker": "#17bebb", other: "#a23b72" };
const AT_WORDS = { oom: "at the OOM", peak: "at its peak (it fit)", last_reading: "last reading before the failure" };

// The segments of one bar: the parts that were seen; where the probe saw none (a host or kernel OOM),
// the last reading of each kind of process instead. A part not seen has no segment: it is named below.
function segmentsOf(b) {
  const seen = b.parts.filter((p) => p.bytes !== null);
  if (seen.length || !b.processes) return seen.map((p) => ({ key: p.key, label: p.label, bytes: p.bytes }));
  const roles = {};
  for (const p of b.processes) roles[p.role] = (roles[p.role] || 0) + p.rss;
  return Object.entries(roles).map(([role, rss]) => ({ key: role, label: role, bytes: rss }));
}

function renderBreakdown(bars) {
  bars = bars || [];
  $("breakdown-card").hidden = bars.length === 0;
  let scale = 1;
  for (const b of bars) scale = Math.max(scale, b.limit || 0, b.total || 0, segmentsOf(b).reduce((s, g) => s + g.bytes, 0));
  const keys = new Set();
  $("breakdown").replaceChildren(...bars.map((b) => {
    const segments = segmentsOf(b);
    const bar = el("div", { class: "mem-bar", role: "img", "aria-label": b.text });
    for (const g of segments) {
      keys.add(g.key);
      const seg = el("div", { class: `mem-seg mem-${g.key.replace(/[^a-z]/g, "-")}`, "data-part": g.key,
        "data-bytes": g.bytes, title: `${g.label} ${bytes(g.bytes)}` });
      seg.style.width = `${(100 * g.bytes) / scale}%`;
      seg.style.background = PART_COLORS[g.key] || "#888";
      bar.append(seg);
    }
    if (b.limit) {
      const mark = el("div", { class: "mem-limit", "data-bytes": b.limit, title: `limit ${bytes(b.limit)}` });
      mark.style.left = `${(100 * b.limit) / scale}%`;
      bar.append(mark);
    }
    const who = `attempt ${b.attempt}${b.micro_batch ? ` · micro-batch ${b.micro_batch}` : ""}` +
      `${b.rank !== null ? ` · rank ${b.rank}` : ""} · ${AT_WORDS[b.at] || b.at} · ${b.device}`;
    const caption = el("div", { class: "mem-caption small" }, ...captionOf(b));
    return el("div", { class: "mem-row", "data-attempt": b.attempt, "data-at": b.at },
      el("div", { class: "mem-row-label" }, who), bar, caption);
  }));
  $("breakdown").dataset.bars = String(bars.length);
  $("breakdown-legend").replaceChildren(...[...keys].map((k) => {
    const n = el("span", {}, k.replace("_", " "));
    n.style.setProperty("--swatch", PART_COLORS[k] || "#888");
    return n;
  }));
}

function captionOf(b) {
  const items = b.parts.map((p) => (p.bytes === null
    ? el("span", { class: "not-seen", "data-part": p.key }, `${p.label} not seen`)
    : el("span", { "data-part": p.key }, `${p.label} ${bytes(p.bytes)}`)));
  items.push(el("span", { class: b.limit ? "" : "not-seen" },
    b.limit ? `limit ${bytes(b.limit)}${b.limit_kind ? ` (${b.limit_kind})` : ""}` : "limit not seen"));
  if (b.processes && b.processes.length) {  // the last reading per process: who held the memory
    items.push(el("span", { class: "processes" }, `by process: ${b.processes.map((p) =>
      `${p.role} ${p.name} (pid ${p.pid}) ${bytes(p.rss)}`).join(", ")}`));
  }
  const out = [];
  items.forEach((item, i) => { if (i) out.push(" · "); out.push(item); });
  return out;
}

// --- attempts, log, checkpoints -------------------------------------------------------------------

function renderAttempts() {
  const rows = view.attempts.slice().reverse().map((a) => {
    const exit = a.exit ?? (a.ended ? "" : "running");  // the server words it as status and the report do
    return el("tr", { "data-attempt": a.attempt },
      el("td", {}, String(a.attempt)), el("td", {}, clock(a.started)),
      el("td", {}, batchText(a.micro_batch, a.grad_accum, a.world_size, a.global_batch, askedGlobal())),
      el("td", { class: `kind kind-${a.kind || "none"}` }, a.kind || (a.ended ? "ok" : "running")),
      el("td", {}, String(exit)),
      el("td", { class: "evidence", title: a.evidence || "" }, (a.evidence || "").slice(0, 240)),
      el("td", { class: "small" }, a.decision || ""),
      el("td", { class: "peak" }, bytes(peakAllocated(a))));
  });
  document.querySelector("#attempts tbody").replaceChildren(...rows);
  const select = $("log-attempt");
  const chosen = view.logAttempt;
  select.replaceChildren(...view.attempts.slice().reverse().map((a) => el("option", { value: a.attempt },
    `attempt ${a.attempt}`)));
  if (chosen !== null) select.value = String(chosen);
}

// The allocator's highest step peak (the probe's): the journal keeps it when the attempt ends; the
// running attempt's is in the status's progress so far.
function peakAllocated(a) {
  if (a.peak_allocated) return a.peak_allocated;
  const p = view.status && view.status.progress;
  return !a.ended && p && p.source === "probe" && a.attempt === view.status.attempt ? p.allocated_peak : null;
}

async function refreshLog() {
  const select = $("log-attempt");
  const attempt = select.value || (view.attempts.length ? view.attempts[view.attempts.length - 1].attempt : null);
  if (!attempt || view.ended) return;
  try {
    const tail = await api(`api/attempts/${attempt}/log?lines=200`);
    const box = $("log");
    const atBottom = box.scrollTop + box.clientHeight >= box.scrollHeight - 8;
    box.textContent = (tail.truncated ? "…\n" : "") + tail.lines.join("\n");
    if (atBottom) box.scrollTop = box.scrollHeight;
  } catch (err) {
    $("log").textContent = "(no log yet)";
  }
}

function renderCheckpoints() {
  const items = view.checkpoints.slice(0, 5).map((c) => el("li", { class: c.bad ? "bad" : "" },
    `${c.step !== null ? `step ${c.step}` : "checkpoint"} · ${clock(c.first_seen)} · ${c.path}` +
    (c.bad ? ` · bad: ${c.reason}` : "")));
  $("checkpoints").replaceChildren(...(items.length ? items : [el("li", { class: "muted" }, "none yet")]));
}

// --- the memory chart (plain SVG) ----------------------------------------------------------------

function seriesOf(points) {
  const series = [{ name: "host RSS", color: COLORS.host, value: (p) => p.host_rss }];
  const devices = new Set();
  for (const p of points) for (const d of Object.keys(p.gpu || {})) devices.add(d);
  [...devices].sort().forEach((d, i) => series.push({ name: `GPU ${d}`, color: COLORS.gpu[i % COLORS.gpu.length],
    value: (p) => (p.gpu ? p.gpu[d] : undefined) }));
  return series;
}

function renderLegend(series) {
  const items = series.map((s) => { const n = el("span", {}, s.name); n.style.setProperty("--swatch", s.color); return n; });
  for (const [kind, color] of Object.entries(MARKER_COLORS)) {
    const n = el("span", {}, kind === "oom" ? "OOM" : kind);
    n.style.setProperty("--swatch", color);
    items.push(n);
  }
  $("legend").replaceChildren(...items);
}

function renderChart() {
  const chart = $("chart");
  const points = view.points;
  const series = seriesOf(points);
  renderLegend(series);
  $("chart-empty").hidden = points.length > 0;
  const width = Math.max(chart.clientWidth, 300);
  const height = chart.clientHeight || 260;
  chart.setAttribute("viewBox", `0 0 ${width} ${height}`);
  chart.replaceChildren();
  if (!points.length) { chart.dataset.points = "0"; return; }
  const pad = { l: 64, r: 10, t: 12, b: 24 };
  const t0 = Math.min(points[0].t, ...view.markers.map((m) => m.t));
  const t1 = Math.max(points[points.length - 1].t, t0 + 1);
  let top = 1;
  for (const s of series) for (const p of points) top = Math.max(top, s.value(p) || 0);
  const limit = memoryLimit();
  if (limit) top = Math.max(top, limit);
  top *= 1.1;
  const x = (t) => pad.l + ((t - t0) / (t1 - t0)) * (width - pad.l - pad.r);
  const y = (v) => height - pad.b - (v / top) * (height - pad.t - pad.b);
  drawAxes(chart, { x, y, t0, t1, top, width, height, pad });
  for (const s of series) drawSeries(chart, s, points, x, y);
  if (limit) drawLimit(chart, limit, y, pad, width);
  drawMarkers(chart, view.markers.filter((m) => m.t >= t0 && m.t <= t1 + 5), x, pad, height);
  chart.dataset.points = String(points.length);
}

function drawAxes(chart, g) {
  chart.append(svg("line", { class: "axis", x1: g.pad.l, x2: g.width - g.pad.r, y1: g.height - g.pad.b, y2: g.height - g.pad.b }));
  for (let i = 0; i <= 4; i += 1) {
    const v = (g.top / 1.1) * (i / 4);
    const label = svg("text", { x: 4, y: g.y(v) + 4 });
    label.textContent = bytes(v);
    chart.append(label, svg("line", { class: "axis", x1: g.pad.l, x2: g.width - g.pad.r, y1: g.y(v), y2: g.y(v), "stroke-opacity": 0.5 }));
  }
  for (let i = 0; i <= 3; i += 1) {
    const t = g.t0 + ((g.t1 - g.t0) * i) / 3;
    const anchor = i === 0 ? "start" : (i === 3 ? "end" : "middle");
    const label = svg("text", { x: g.x(t), y: g.height - 6, "text-anchor": anchor });
    label.textContent = clock(t);
    chart.append(label);
  }
}

function drawSeries(chart, s, points, x, y) {
  // One polyline per attempt: a line across a restart would invent memory use that never happened.
  let run = [];
  let attempt = null;
  const flush = () => {
    if (run.length) chart.append(svg("polyline", { class: "series", stroke: s.color, points: run.join(" "), "data-series": s.name }));
    run = [];
  };
  for (const p of points) {
    const v = s.value(p);
    if (p.attempt !== attempt) { flush(); attempt = p.attempt; }
    if (v === null || v === undefined) continue;
    run.push(`${x(p.t).toFixed(1)},${y(v).toFixed(1)}`);
  }
  flush();
}

// The limit the allocator may reach (a per-process memory fraction's cap, else the device), as the
// in-process probe reports it: the line the GPU series must stay under.
function memoryLimit() {
  const p = view.status && view.status.progress;
  return p && p.limit_bytes ? p.limit_bytes : null;
}

function drawLimit(chart, limit, y, pad, width) {
  const line = svg("line", { class: "limit", x1: pad.l, x2: width - pad.r, y1: y(limit), y2: y(limit),
    stroke: MARKER_COLORS.oom, "stroke-dasharray": "6 4", "data-bytes": limit });
  const title = svg("title");
  title.textContent = `limit ${bytes(limit)}`;
  line.append(title);
  const label = svg("text", { x: width - pad.r - 4, y: y(limit) - 4, "text-anchor": "end", class: "limit-label" });
  label.textContent = `limit ${bytes(limit)}`;
  chart.append(line, label);
}

function drawMarkers(chart, markers, x, pad, height) {
  for (const m of markers) {
    const line = svg("line", { class: `marker marker-${m.kind}`, stroke: MARKER_COLORS[m.kind] || "#888",
      x1: x(m.t), x2: x(m.t), y1: pad.t, y2: height - pad.b, "data-kind": m.kind });
    const title = svg("title");
    title.textContent = `${clock(m.t)} ${m.label}`;
    line.append(title);
    chart.append(line);
    if (m.kind === "oom") {
      const dot = svg("circle", { class: "marker-dot", cx: x(m.t), cy: pad.t + 4, r: 4, fill: MARKER_COLORS.oom });
      dot.append(title.cloneNode(true));
      chart.append(dot);
    }
  }
  chart.dataset.markers = String(markers.length);
}

let chartFrame = 0;
function scheduleChart() {
  if (!chartFrame) chartFrame = requestAnimationFrame(() => { chartFrame = 0; renderChart(); });
}

// --- loading and live updates ----------------------------------------------------------------------

async function refreshTables() {
  if (view.ended) return;
  const [attempts, markers, checkpoints] = await Promise.all([api("api/attempts"), api("api/markers"),
    api("api/checkpoints?limit=5")]);
  if (view.ended) return;  // the end event's tables are newer
  renderTables({ attempts, markers, checkpoints });
  await refreshLog();
}

function renderTables(tables) {
  view.attempts = tables.attempts;
  view.markers = tables.markers;
  view.checkpoints = tables.checkpoints;
  renderAttempts();
  renderBatchHistory();
  renderCheckpoints();
  scheduleChart();
}

async function load() {
  const [status, samples] = await Promise.all([api("api/status"), api(`api/samples?max_points=${MAX_POINTS}`)]);
  renderStatus(status);
  view.points = samples.points;
  await refreshTables();
  connect();
}

function connect() {
  const live = $("live");
  const source = new EventSource("api/stream");
  source.addEventListener("open", () => { live.textContent = "live"; live.className = "live on"; });
  source.addEventListener("error", () => {
    if (view.status && TERMINAL.has(view.status.state)) {  // the run ended and its server went with it
      source.close();
      live.textContent = "ended";
      live.className = "live";
      return;
    }
    live.textContent = "reconnecting…";
    live.className = "live off";
  });
  source.addEventListener("status", (e) => renderStatus(JSON.parse(e.data)));
  source.addEventListener("journal", (e) => {
    const kind = JSON.parse(e.data).kind;
    if (kind !== "worker_progress" && kind !== "worker_heartbeat") throttle(() => refreshTables().catch(showError), 250);
  });
  // The server is stopping (the supervisor exited): the stream's last event carries the final tables,
  // because a request sent from now on would find no server.
  source.addEventListener("end", (e) => {
    const end = JSON.parse(e.data);
    view.ended = true;
    clearTimeout(pending);
    pending = null;
    source.close();
    if (end.attempts) renderTables(end);
    live.textContent = "ended";
    live.className = "live";
    live.title = end.why;
    $("ended").textContent = `${end.why} This page no longer updates.`;
    $("ended").hidden = false;
  });
  source.addEventListener("sample", (e) => {
    view.points.push(JSON.parse(e.data));
    if (view.points.length > MAX_POINTS * 2) view.points.splice(0, view.points.length - MAX_POINTS * 2);
    scheduleChart();
  });
}

function showError(err) {
  $("detail").textContent = `Could not load: ${err.message}`;
}

function startLogPolling() {
  // Output is not a journal event; while a worker runs, re-read the log tail now and then.
  setInterval(() => {
    if (view.status && view.status.state === "running" && !document.hidden) refreshLog();
  }, 3000);
}

document.addEventListener("DOMContentLoaded", () => {
  if (/^\/runs\/[0-9a-f]+\/$/.test(location.pathname)) {  // served by `oomguard dashboard`, beside other runs
    document.querySelector("header h1").after(el("a", { href: "../../", class: "back", id: "all-runs" }, "← all runs"));
  }
  $("log-attempt").addEventListener("change", (e) => { view.logAttempt = Number(e.target.value); refreshLog(); });
  window.addEventListener("resize", scheduleChart);
  load().catch(showError);
  startLogPolling();
});
