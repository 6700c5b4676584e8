// The ZML fleet page: polls /dashboard/state every second and redraws. No framework, no build
// step; every value is set with textContent (node ids and reasons come from operators' config).
"use strict";

const POLL_MS = 1000;
const $ = (id) => document.getElementById(id);

function key() {
  const fromHash = new URLSearchParams(location.hash.slice(1)).get("key");
  if (fromHash) {
    sessionStorage.setItem("zml-key", fromHash);
    history.replaceState(null, "", location.pathname);  // keep the key out of the address bar
  }
  return sessionStorage.getItem("zml-key") || "";
}

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function fmtS(v) {
  if (v === null || v === undefined) return "–";
  return v < 1 ? `${Math.round(v * 1000)} ms` : `${v.toFixed(2)} s`;
}

function pct(p) {
  return p && p.n ? `${fmtS(p.p50)} / ${fmtS(p.p90)} / ${fmtS(p.p99)}` : "–";
}

function replaceRows(tbody, rows) {
  tbody.replaceChildren(...rows);
}

function fmtAge(s) {
  if (s === null || s === undefined) return "";
  if (s < 90) return `${Math.round(s)} s`;
  if (s < 5400) return `${Math.round(s / 60)} min`;
  return `${Math.round(s / 3600)} h`;
}

function fmtTps(v) {
  if (!v) return "?";
  return v >= 10000 ? `${(v / 1000).toFixed(1)}k` : v >= 10 ? v.toFixed(0) : v.toFixed(1);
}

// Why a node is not up, and since when: its health service's probe said so.
function stateCell(n) {
  const st = el("td");
  const badge = el("span", n.status, `state ${n.status}`);
  st.append(badge);
  if (n.status !== "up") {
    const since = n.down_for_s !== null && n.down_for_s !== undefined ? ` (last answered ${fmtAge(n.down_for_s)} ago)` : "";
    if (n.reason || since) st.append(el("span", `${n.reason || "no reason given"}${since}`, "why"));
  }
  if (n.state_age_s !== null && n.state_age_s !== undefined) st.title = `polled by the health service ${fmtAge(n.state_age_s)} ago`;
  return st;
}

// The speeds the routers estimate with, where they come from and how old they are.
function speedCell(n) {
  const td = el("td", `${fmtTps(n.prefill_tps)} / ${fmtTps(n.decode_tps)}`, "speeds");
  let src = n.speeds_source;
  if (n.speeds_age_s !== null && n.speeds_age_s !== undefined) src += ` ${fmtAge(n.speeds_age_s)} ago`;
  if (n.speeds_confidence) src += ` (${Math.round(n.speeds_confidence * 100)}%)`;
  td.append(el("span", src, `src ${n.speeds_source}`));
  td.title = {measured: "measured from the engine's counters", learned: "learned from requests",
              default: "the accelerator type's profile: not measured yet"}[n.speeds_source] || "";
  return td;
}

function renderNodes(state) {
  const rates = state.decisions_per_s.by_node;
  const rows = state.nodes.map((n) => {
    const tr = el("tr");
    tr.dataset.node = n.node_id;
    tr.dataset.status = n.status;
    tr.append(el("td", n.node_id), el("td", n.accelerator_type), el("td", n.family), el("td", n.engine));
    tr.append(stateCell(n));
    const h = el("td");
    const bar = el("span", null, "health");
    const fill = el("div");
    const score = Math.max(0, Math.min(100, n.health_score));  // 0-100
    fill.style.width = `${Math.round(score)}%`;
    if (score < 50) fill.className = "low";
    bar.append(fill);
    h.append(bar, document.createTextNode(score.toFixed(0)));
    tr.append(h);
    const queue = el("td", n.queue_depth, "num queue");
    if (n.state_age_s !== null && n.state_age_s !== undefined) queue.title = `polled ${fmtAge(n.state_age_s)} ago`;
    tr.append(queue, el("td", n.in_flight, "num"));
    tr.append(el("td", n.cooldown_s > 0 ? `${n.cooldown_s.toFixed(1)} s` : "–", n.cooldown_s > 0 ? "num bad" : "num"));
    tr.append(el("td", n.saturated_s > 0 ? `${n.saturated_s.toFixed(1)} s` : "–", n.saturated_s > 0 ? "num warn" : "num"));
    tr.append(el("td", n.price_per_hour.toFixed(2), "num"));
    tr.append(speedCell(n));
    // How routers know the node's prefix cache, and the share of prompt tokens its engine served from it.
    const hit = typeof n.prefix_cache_hit_rate === "number" ? ` ${Math.round(n.prefix_cache_hit_rate * 100)}%` : "";
    const cache = el("td", `${n.cache_fidelity || "–"}${hit}`, "cache");
    cache.title = [n.kv_blocks && n.kv_block_size ? `${n.kv_blocks} blocks of ${n.kv_block_size} tokens` : "",
                   n.kv_events ? `KV events: ${n.kv_events}` : ""].filter(Boolean).join("; ");
    tr.append(cache);
    // Legs of a split request it takes, and the KV group it hands KV within (docs/disaggregation.md).
    const roles = (n.roles || []).length && n.roles.length < 2 ? n.roles.join(",") : "both";
    const leg = el("td", n.kv_group ? `${roles} @${n.kv_group}` : roles, "roles");
    if (n.kv_group) leg.title = `KV group ${n.kv_group}${n.kv_gbps ? `, link ${n.kv_gbps} Gbit/s` : ""}`;
    tr.append(leg);
    tr.append(el("td", (rates[n.node_id] || 0).toFixed(1), "num rate"));
    const missing = (n.missing_models || []).length && n.status === "up" ? `not serving: ${n.missing_models.join(", ")}` : "";
    tr.append(el("td", [n.note, missing].filter(Boolean).join("; "), "note"));
    return tr;
  });
  replaceRows($("nodes").tBodies[0], rows);
}

function renderBatches(batches) {
  const rows = (batches || []).map((b) => {
    const tr = el("tr");
    tr.dataset.batch = b.id;
    tr.dataset.status = b.status;
    const done = b.completed + b.failed;
    const share = b.total ? Math.min(100, (100 * done) / b.total) : 0;
    const prog = el("td");
    const bar = el("span", null, "health");
    const fill = el("div");
    fill.style.width = `${Math.round(share)}%`;
    bar.append(fill);
    prog.append(bar, document.createTextNode(`${Math.round(share)}%`));
    tr.append(el("td", b.id), el("td", b.status, `state ${b.status}`), prog, el("td", b.completed, "num"),
              el("td", b.failed, b.failed ? "num bad" : "num"), el("td", b.total, "num"),
              el("td", `${fmtAge(b.updated_s)} ago`, "num"));
    return tr;
  });
  if (!rows.length) {
    const tr = el("tr");
    tr.append(el("td", "no batches", "muted"));
    rows.push(tr);
  }
  replaceRows($("batches").tBodies[0], rows);
}

function renderFlow(f) {
  $("flow-none").hidden = !!f;
  $("flow").hidden = !f;
  if (!f) return;
  const rows = f.tenants.map((t) => {
    const tr = el("tr");
    tr.dataset.tenant = t.tenant;
    const share = el("td");
    const bar = el("span", null, "health");
    const fill = el("div");
    fill.style.width = `${Math.round(100 * t.share)}%`;
    bar.append(fill);
    share.append(bar, document.createTextNode(`${(100 * t.share).toFixed(1)}%`));
    tr.append(el("td", t.tenant), share, el("td", t.waiting, t.waiting ? "num warn" : "num"));
    return tr;
  });
  if (!rows.length) {
    const tr = el("tr");
    tr.append(el("td", "no tenant served lately", "muted"));
    rows.push(tr);
  }
  replaceRows($("tenants").tBodies[0], rows);
  const more = $("tenants-more");
  more.hidden = !f.tenants_not_shown;
  more.textContent = f.tenants_not_shown ? `${f.tenants_not_shown} more tenants` : "";
  renderTable($("bands").tBodies[0], f.waiting_by_band, "nothing waiting in any band");
}

function renderPlacement(p) {
  const plan = $("plan");
  if (!p) {
    plan.textContent = "no plan: the placement planner is off ([planner] mode in zml.toml, docs/placement.md)";
    plan.className = "muted";
    replaceRows($("moves").tBodies[0], []);
    return;
  }
  plan.className = "";
  plan.textContent = p.cost_now_per_h === null ? "moves without a plan heard yet" :
    `$${p.cost_now_per_h.toFixed(2)}/h now, $${p.cost_plan_per_h.toFixed(2)}/h planned, ` +
    `${p.moves_planned} move(s) (planned ${fmtAge(p.planned_s)} ago; zml plan shows them)`;
  const rows = p.moves.map((m) => {
    const tr = el("tr");
    tr.append(el("td", (m.kind || "").replace("_", " ")), el("td", m.node), el("td", m.name),
              el("td", m.phase.replace("move_", ""), m.phase === "move_failed" || m.phase === "blocked" ? "bad" : ""),
              el("td", `${fmtAge(m.age_s)} ago`, "num"), el("td", m.message || "", "muted"));
    return tr;
  });
  if (!rows.length) {
    const tr = el("tr");
    tr.append(el("td", "no moves", "muted"));
    rows.push(tr);
  }
  replaceRows($("moves").tBodies[0], rows);
}

function renderBars(target, values) {
  const max = Math.max(0.1, ...Object.values(values));
  const rows = Object.entries(values).map(([name, v]) => {
    const row = el("div", null, "row");
    const bar = el("div", null, "bar");
    bar.style.width = `${(v / max) * 100}%`;
    const track = el("div");
    track.append(bar);
    row.append(el("span", name), track, el("span", v.toFixed(1), "num"));
    return row;
  });
  if (!rows.length) rows.push(el("div", "no traffic", "muted"));
  target.replaceChildren(...rows);
}

function renderTable(tbody, values, empty, cls) {
  const rows = Object.entries(values).map(([k, v]) => {
    const tr = el("tr");
    tr.append(el("td", k, cls), el("td", v, "num"));
    return tr;
  });
  if (!rows.length) {
    const tr = el("tr");
    tr.append(el("td", empty, "muted"));
    rows.push(tr);
  }
  replaceRows(tbody, rows);
}

function render(state) {
  const d = state.decisions_per_s;
  $("rate").textContent = d.total.toFixed(1);
  $("served").textContent = state.served;
  const errs = Object.values(state.errors_by_code).reduce((a, b) => a + b, 0);
  $("errors").textContent = errs;
  $("errors").className = errs ? "value bad" : "value";
  $("ttft").textContent = pct(state.ttft_s);
  $("latency").textContent = pct(state.latency_s);
  const queued = Object.values(state.queue).reduce((a, b) => a + b, 0) + (state.queue_other_models || 0);
  $("queued").textContent = queued;
  $("queued").className = queued ? "value warn" : "value";
  renderNodes(state);
  renderBatches(state.batches);
  renderPlacement(state.placement);
  renderFlow(state.flow);
  renderBars($("families"), d.by_family);
  renderTable($("codes").tBodies[0], state.errors_by_code, "no errors", "bad");
  renderTable($("queue").tBodies[0], state.queue, "no model configured");
  const other = $("queue-other");
  other.hidden = !state.queue_other_models;
  other.textContent = state.queue_other_models ? `${state.queue_other_models} waiting for models not in this config` : "";
  $("updated").textContent = `updated ${new Date(state.ts * 1000).toLocaleTimeString()}`;
}

async function poll() {
  const headers = {};
  const k = key();
  if (k) headers.Authorization = `Bearer ${k}`;
  try {
    const r = await fetch("/dashboard/state", { headers, cache: "no-store" });
    if (r.status === 401) {
      $("keyform").hidden = false;
      $("keyerror").textContent = k ? "key refused" : "";
      $("status").textContent = "key needed";
      $("status").className = "status down";
      return;
    }
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    $("keyform").hidden = true;
    render(await r.json());
    $("status").textContent = "live";
    $("status").className = "status live";
  } catch (err) {
    $("status").textContent = `gateway unreachable (${err.message})`;
    $("status").className = "status down";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("keyform").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem("zml-key", $("key").value.trim());
    $("key").value = "";
  });
  poll();
});
