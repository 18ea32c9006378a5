"""`GET /`: the dashboard page, self-contained (inline CSS and JS, no external assets).

It fetches /v1/health and /v1/status every 2 s and draws: the CPU map (each online CPU a
cell; kept-back and not-allowed CPUs marked; the job holding each CPU named in its cell),
running jobs, the queue with waiting_on, disk free against floor and goal, the hourly
queue-wait p50/p90 as an inline SVG chart, per-repository totals and underused
reservations. Kept as a Python string (not a data file) so every install carries it.
"""

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>motor</title>
<style>
  :root { --bg:#0f1419; --panel:#171d24; --line:#2a333d; --fg:#d8dee6; --dim:#8a96a3;
          --free:#22303c; --kept:#4a3a1c; --off:#111; --warn:#e0a030; --bad:#e05050; --ok:#40b070; }
  * { box-sizing: border-box; }
  body { margin:0; font:14px/1.4 system-ui, sans-serif; background:var(--bg); color:var(--fg); }
  header { display:flex; gap:1.5em; align-items:baseline; padding:.8em 1.2em; border-bottom:1px solid var(--line); }
  header h1 { font-size:1.2em; margin:0; }
  .dim { color:var(--dim); }
  main { display:grid; grid-template-columns: repeat(auto-fit, minmax(420px, 1fr)); gap:1em; padding:1em; }
  section { background:var(--panel); border:1px solid var(--line); border-radius:6px; padding:.8em 1em; }
  h2 { font-size:1em; margin:0 0 .6em; color:var(--dim); text-transform:uppercase; letter-spacing:.05em; }
  #cpumap { display:grid; grid-template-columns: repeat(auto-fill, minmax(64px, 1fr)); gap:4px; }
  .cpu { border-radius:4px; padding:4px; min-height:46px; font-size:11px; background:var(--free);
         overflow:hidden; word-break:break-all; border:1px solid transparent; }
  .cpu b { display:block; font-size:12px; }
  .cpu.kept { background:var(--kept); }
  .cpu.notallowed { background:var(--off); color:var(--dim); }
  .cpu.busy { color:#fff; border-color:#fff3; }
  table { border-collapse:collapse; width:100%; font-size:13px; }
  th, td { text-align:left; padding:3px 6px; border-bottom:1px solid var(--line); white-space:nowrap; }
  th { color:var(--dim); font-weight:normal; }
  td.cmd { max-width:280px; overflow:hidden; text-overflow:ellipsis; }
  .bar { position:relative; height:22px; background:var(--free); border-radius:4px; overflow:hidden; margin:.4em 0; }
  .bar .fill { position:absolute; left:0; top:0; bottom:0; background:var(--ok); }
  .bar .mark { position:absolute; top:0; bottom:0; width:2px; }
  .legend span { margin-right:1em; }
  .sw { display:inline-block; width:10px; height:10px; border-radius:2px; vertical-align:middle; margin-right:4px; }
  svg text { fill:var(--dim); font-size:10px; }
  #error { color:var(--bad); }
  nav a { color:var(--dim); margin-right:1em; }
</style>
</head>
<body>
<header>
  <h1>motor</h1>
  <span id="summary" class="dim">loading…</span>
  <span id="error"></span>
  <nav class="dim" style="margin-left:auto">
    <a href="/v1/health">/v1/health</a><a href="/v1/status">/v1/status</a><a href="/v1/jobs">/v1/jobs</a><a href="/metrics">/metrics</a>
  </nav>
</header>
<main>
  <section style="grid-column: 1 / -1">
    <h2>CPU map</h2>
    <div id="cpumap"></div>
    <p class="legend dim">
      <span><i class="sw" style="background:var(--free)"></i>free</span>
      <span><i class="sw" style="background:var(--kept)"></i>kept back</span>
      <span><i class="sw" style="background:var(--off)"></i>not allowed</span>
      <span>coloured: held by the job named in the cell</span>
    </p>
  </section>
  <section>
    <h2>Running</h2>
    <table><thead><tr><th>job</th><th>workspace</th><th>claim</th><th>cpus</th><th>command</th></tr></thead>
      <tbody id="running"></tbody></table>
  </section>
  <section>
    <h2>Queue</h2>
    <table><thead><tr><th>job</th><th>workspace</th><th>claim</th><th>waiting on</th><th>wait</th></tr></thead>
      <tbody id="queue"></tbody></table>
  </section>
  <section>
    <h2>Disk</h2>
    <div class="bar" id="diskbar"><div class="fill" id="diskfill"></div>
      <div class="mark" id="floormark" style="background:var(--bad)"></div>
      <div class="mark" id="goalmark" style="background:var(--warn)"></div></div>
    <p id="disktext" class="dim"></p>
  </section>
  <section>
    <h2>Queue wait per hour (p50 / p90)</h2>
    <div id="chart"></div>
    <p class="legend dim"><span><i class="sw" style="background:#4a90d0"></i>p50</span>
      <span><i class="sw" style="background:#d0704a"></i>p90</span>
      <span>numbers: jobs started / refusals</span></p>
  </section>
  <section>
    <h2>Repositories (24 h)</h2>
    <table><thead><tr><th>repository</th><th>vCPU·h</th><th>jobs</th><th>by vCPUs</th><th>queue-wait refusals</th></tr></thead>
      <tbody id="repos"></tbody></table>
  </section>
  <section>
    <h2>Underused reservations</h2>
    <table><thead><tr><th>job</th><th>repository</th><th>claim</th><th>wall</th><th>use</th></tr></thead>
      <tbody id="underused"></tbody></table>
  </section>
</main>
<script>
"use strict";
const PALETTE = ["#3b7dd8","#d8553b","#3bb07a","#b03bd8","#d8b03b","#3bc4d8","#d83b8f","#7ad83b","#8f6bd8","#d88f3b"];
const ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
const $ = (id) => document.getElementById(id);
function esc(s) { return String(s == null ? "-" : s).replace(/[&<>"']/g, c => ENTITIES[c]); }
function short(id) { return String(id).slice(-8); }
function size(n) { if (typeof n !== "number") return "-"; const u = ["B","KiB","MiB","GiB","TiB","PiB"]; let i = 0;
  while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; } return (i ? n.toFixed(1) : n) + " " + u[i]; }
function dur(ms) { if (typeof ms !== "number") return "-"; if (ms < 1000) return ms + "ms"; const s = ms / 1000;
  if (s < 60) return s.toFixed(1) + "s"; if (s < 3600) return Math.floor(s / 60) + "m" + String(Math.floor(s % 60)).padStart(2, "0") + "s";
  return Math.floor(s / 3600) + "h" + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m"; }
function cpuList(c) { if (!c || !c.length) return "-"; const ids = c.slice().sort((a, b) => a - b); const out = []; let s = ids[0], p = ids[0];
  for (const x of ids.slice(1).concat([null])) { if (x !== null && x === p + 1) { p = x; continue; }
    out.push(s === p ? String(s) : s + "-" + p); if (x !== null) { s = p = x; } } return out.join(","); }
const colours = {};
function colourOf(job) { if (!(job in colours)) colours[job] = PALETTE[Object.keys(colours).length % PALETTE.length]; return colours[job]; }

function renderCpus(h) {
  const cpus = h.cpus || {}; const online = cpus.online || []; const allowed = new Set(cpus.allowed || []);
  const kept = new Set(cpus.kept_back || []); const owner = {};
  for (const [job, list] of Object.entries(cpus.jobs || {})) for (const c of list) owner[c] = job;
  $("cpumap").innerHTML = online.map(c => {
    const job = owner[c];
    const cls = ["cpu", kept.has(c) ? "kept" : "", allowed.has(c) ? "" : "notallowed", job ? "busy" : ""].join(" ");
    const style = job ? ` style="background:${colourOf(job)}"` : "";
    const label = job ? `<span class="job" data-job="${esc(job)}" title="${esc(job)}">${esc(job)}</span>`
                      : (kept.has(c) ? "kept back" : (allowed.has(c) ? "free" : "—"));
    return `<div class="${cls}" data-cpu="${c}"${style}><b>cpu ${c}</b>${label}</div>`;
  }).join("");
}
function renderStatus(s) {
  const running = s.running || []; const queued = s.queued || [];
  $("running").innerHTML = running.map(r => `<tr><td title="${esc(r.job_id)}">${esc(short(r.job_id))}</td><td>${esc(r.workspace)}</td>` +
    `<td>${esc(r.claim)}</td><td>${esc(cpuList(r.cpus))}</td><td class="cmd">${esc((r.command || []).join(" "))}</td></tr>`).join("")
    || `<tr><td colspan="5" class="dim">none</td></tr>`;
  $("queue").innerHTML = queued.map(r => `<tr><td title="${esc(r.job_id)}">${esc(short(r.job_id))}</td><td>${esc(r.workspace)}</td>` +
    `<td>${esc(r.claim)}</td><td>${esc(r.waiting_on)}${r.waiting_on_job ? " (" + esc(short(r.waiting_on_job)) + ")" : ""}</td>` +
    `<td>${esc(dur(r.queue_wait_ms))}</td></tr>`).join("") || `<tr><td colspan="5" class="dim">empty</td></tr>`;
}
function renderDisk(h) {
  const d = h.disk || {}; const total = d.total_bytes || Math.max(d.free_bytes || 0, d.goal_bytes || 0, 1);
  const pct = (x) => Math.max(0, Math.min(100, 100 * (x || 0) / total)) + "%";
  $("diskfill").style.width = pct(d.free_bytes);
  $("diskfill").style.background = (d.free_bytes < d.floor_bytes) ? "var(--bad)" : (d.free_bytes < d.goal_bytes ? "var(--warn)" : "var(--ok)");
  $("floormark").style.left = pct(d.floor_bytes); $("goalmark").style.left = pct(d.goal_bytes);
  $("disktext").textContent = `free ${size(d.free_bytes)} of ${size(d.total_bytes)} · floor ${size(d.floor_bytes)} · goal ${size(d.goal_bytes)}`;
}
function renderChart(h) {
  const b = h.queue_wait_hourly || []; const W = 480, H = 160, L = 42, B = 20, T = 14;
  const max = Math.max(1000, ...b.map(x => x.p90_ms || 0)); const n = Math.max(b.length, 1); const bw = (W - L) / n;
  let svg = `<svg id="qwchart" viewBox="0 0 ${W} ${H}" width="100%" role="img" aria-label="hourly queue wait">`;
  for (const f of [0, 0.5, 1]) { const y = T + (H - B - T) * (1 - f);
    svg += `<line x1="${L}" x2="${W}" y1="${y}" y2="${y}" stroke="#2a333d"/><text x="2" y="${y + 3}">${esc(dur(Math.round(max * f)))}</text>`; }
  b.forEach((x, i) => { const x0 = L + i * bw; const h90 = (H - B - T) * (x.p90_ms || 0) / max; const h50 = (H - B - T) * (x.p50_ms || 0) / max;
    svg += `<rect class="p90" x="${x0 + 1}" y="${H - B - h90}" width="${Math.max(bw - 2, 1)}" height="${h90}" fill="#d0704a"><title>${esc(new Date(x.hour_start_ms).toLocaleString())}: started ${x.started}, p50 ${dur(x.p50_ms)}, p90 ${dur(x.p90_ms)}, refusals ${x.refusals}</title></rect>`;
    svg += `<rect class="p50" x="${x0 + 1}" y="${H - B - h50}" width="${Math.max(bw - 2, 1)}" height="${h50}" fill="#4a90d0"/>`;
    if (x.started || x.refusals) svg += `<text x="${x0 + 1}" y="${T - 3}">${x.started}/${x.refusals}</text>`;
    if (i % 6 === 0 || i === b.length - 1) svg += `<text x="${x0}" y="${H - 6}">${new Date(x.hour_start_ms).getHours()}h</text>`; });
  $("chart").innerHTML = svg + "</svg>";
}
function renderRepos(h) {
  const r = h.repositories || {};
  $("repos").innerHTML = Object.entries(r).map(([name, t]) => `<tr><td>${esc(name)}</td><td>${(t.reserved_vcpu_seconds / 3600).toFixed(2)}</td>` +
    `<td>${esc(t.finished_jobs)}</td><td>${esc(Object.entries(t.jobs_by_vcpus || {}).map(([k, v]) => k + "×" + v).join(" "))}</td>` +
    `<td>${esc(t.queue_wait_refusals)}</td></tr>`).join("") || `<tr><td colspan="5" class="dim">none</td></tr>`;
  const u = h.underused || [];
  $("underused").innerHTML = u.map(j => `<tr><td title="${esc(j.job_id)}">${esc(short(j.job_id))}</td><td>${esc(j.repository)}</td>` +
    `<td>${esc(j.claim)}</td><td>${esc(dur(j.wall_time_ms))}</td><td>${(j.average_use_ppm / 10000).toFixed(1)}%</td></tr>`).join("")
    || `<tr><td colspan="5" class="dim">none</td></tr>`;
}
function renderSummary(h) {
  const c = h.capacity || {}; const host = h.host || {};
  const iso = typeof h.isolation === "object" && h.isolation ? (h.isolation.backend || h.isolation.name || "") : h.isolation;
  $("summary").textContent = `permits ${c.held_permits}/${c.max_weight} (setup ${c.setup_permits}) · pending ${c.pending_jobs}/${c.max_queue_depth}` +
    ` · claim limit ${c.claim_limit} · isolation ${iso || "-"}` +
    (host.load1 !== undefined ? ` · load ${host.load1} ${host.load5} ${host.load15}` : "") +
    (host.available_memory_bytes !== undefined ? ` · mem avail ${size(host.available_memory_bytes)}` : "");
}
async function refresh() {
  try {
    const [h, s] = await Promise.all([fetch("/v1/health", {cache: "no-store"}).then(r => r.json()),
                                      fetch("/v1/status", {cache: "no-store"}).then(r => r.json())]);
    renderSummary(h); renderCpus(h); renderStatus(s); renderDisk(h); renderChart(h); renderRepos(h);
    $("error").textContent = "";
    document.body.dataset.loaded = "1";
  } catch (e) { $("error").textContent = "refresh failed: " + e; }
}
refresh();
setInterval(refresh, 2000);
</script>
</body>
</html>
"""

PAGE_BYTES = PAGE.encode("utf-8")
