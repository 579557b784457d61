// oomguard's many-runs page: plain JavaScript, no build step, no network beyond this server.
// Data: /api/runs (every run under the directories, read from the journals), polled while visible.
"use strict";

const POLL_MS = 2000;
const ATTENTION = new Set(["failed", "damaged"]);

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  for (const child of children) node.append(child === null || child === undefined ? "" : child);
  return node;
}

function ago(seconds) {
  seconds = Math.max(0, seconds);
  for (const [unit, size] of [["d", 86400], ["h", 3600], ["min", 60]]) {
    if (seconds >= size) return `${Math.floor(seconds / size)} ${unit} ago`;
  }
  return `${Math.round(seconds)} s ago`;
}

function batchText(r) {
  return r.grad_accum ? `${r.micro_batch} × ${r.grad_accum} × ${r.world_size} = ${r.global_batch}` : "–";
}

function failuresText(r) {
  const kinds = Object.entries(r.failure_kinds || {}).sort();
  if (!kinds.length) return r.failures === null ? "–" : "0";
  return `${r.failures} (${kinds.map(([k, n]) => (n === 1 ? k : `${k} ×${n}`)).join(", ")})`;
}

function checkpointText(r) {
  if (!r.checkpoint) return "–";
  const name = r.checkpoint.split("/").pop();
  return r.checkpoint_step === null ? name : `${name} (step ${r.checkpoint_step})`;
}

function progressText(r, now) {
  if (r.step === null || r.step === undefined) return "–";
  const total = r.total_steps ? `/${r.total_steps}` : "";
  const when = r.progress_time ? ` · ${ago(now - r.progress_time)}` : "";
  return `step ${r.step}${total}${when}`;
}

function supervisorText(r) {
  if (r.supervisor === "alive") return `alive (pid ${r.supervisor_pid})`;
  if (r.supervisor === "gone") return `gone (pid ${r.supervisor_pid})`;
  return r.supervisor || "–";
}

function whyText(r) {
  const why = r.supervisor === "gone" ? `The supervisor is gone; it last recorded: ${r.reason}` : r.reason;
  return [why, ...(r.degraded || []).map((d) => `degraded: ${d}`)].join(" · ");
}

function fact(name, value) {
  return [el("dt", {}, name), el("dd", { "data-fact": name }, value)];
}

function card(r, now) {
  const links = el("p", { class: "links small" }, el("a", { href: r.view, class: "view" }, "view"));
  if (r.dashboard) links.append(" · ", el("a", { href: r.dashboard, class: "dashboard", target: "_blank", rel: "noopener" }, "live dashboard"));
  const facts = r.error ? [] : [
    ...fact("attempt", String(r.attempt)), ...fact("batch", batchText(r)), ...fact("failures", failuresText(r)),
    ...fact("checkpoint", checkpointText(r)), ...fact("progress", progressText(r, now)),
    ...fact("supervisor", supervisorText(r)),
  ];
  const state = el("span", { class: "state small-state", "data-state": r.state }, r.state);
  if (r.supervisor === "gone") state.dataset.gone = "true";
  return el("article", { class: "card run", "data-key": r.key, "data-state": r.state },
    el("div", { class: "run-head" }, r.error ? el("span", { class: "run-name" }, r.name)
      : el("a", { href: r.view, class: "run-name" }, r.name), state),
    el("p", { class: "why small" }, whyText(r)),
    el("dl", { class: "facts small" }, ...facts),
    r.error ? "" : links);
}

function render(doc) {
  const now = doc.time;
  $("host").textContent = `· ${doc.host}`;
  $("roots").textContent = `runs under ${doc.roots.join(", ")}`;
  const counts = {};
  for (const r of doc.runs) counts[r.state] = (counts[r.state] || 0) + 1;
  const parts = Object.entries(counts).sort().map(([s, n]) => `${n} ${s}`);
  const gone = doc.runs.filter((r) => r.supervisor === "gone").length;
  if (gone) parts.push(`${gone} with the supervisor gone`);
  const total = `${doc.runs.length} run${doc.runs.length === 1 ? "" : "s"}`;
  $("counts").textContent = doc.runs.length ? `${total}: ${parts.join(", ")}` : "No oomguard runs found yet.";
  $("runs").replaceChildren(...doc.runs.map((r) => card(r, now)));
  const attention = doc.runs.filter((r) => ATTENTION.has(r.state) || r.supervisor === "gone").length;
  document.title = attention ? `oomguard · ${attention} need a look` : `oomguard · ${total}`;
}

async function refresh() {
  const live = $("live");
  try {
    const response = await fetch("api/runs", { headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
    live.textContent = `live · ${new Date().toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" })}`;
    live.className = "live on";
  } catch (err) {
    live.textContent = `offline (${err.message})`;
    live.className = "live off";
  }
}

document.addEventListener("DOMContentLoaded", () => {
  refresh();
  setInterval(() => { if (!document.hidden) refresh(); }, POLL_MS);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) refresh(); });
});
