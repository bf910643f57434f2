"""`GET /dashboard`: one self-contained HTML page (inline CSS and JS, no external assets) that polls
`/v1/stats` and draws throughput and latency-percentile charts, queue / slot / KV-page / prefix-hit
gauges, one row per engine and the recent requests (counts and times only: /v1/stats never holds
request text).

The page fetches `v1/stats` relative to its own URL (so it works behind a path prefix), every
`?interval=S` seconds (default 1). With an API key, open it as `/dashboard#key=KEY`: the key is
read from the fragment (never sent to the server in the URL) and sent as `Authorization: Bearer`
on the polls. Throughput is computed from counter deltas over the server's uptime delta, as in
`trnrt top`; the first poll shows the server's 1-minute rates.

The HTML is a Python string (no package-data glob needed). A Content-Security-Policy header lets
the page load nothing but itself and connect only to its own origin.
"""

from __future__ import annotations

import falcon

# The /v1/stats keys the page reads (tests check each is in a real snapshot and in the page).
READS = (
    "version", "uptime_s", "engines", "live", "counters", "rates", "latency", "prefix_hit_rate",
    "running", "queued", "pages_used", "pages_total", "slots_used", "slots_total",
    "requests_finished_total", "generation_tokens", "prompt_tokens", "cached_tokens",
    "errors", "aborts", "ttft_ms", "itl_ms", "e2e_ms", "queue_ms", "p50", "p90", "p99",
    "generation_tokens_per_s", "prompt_tokens_per_s", "requests_finished_per_s", "recent_requests",
    "finished_at_s", "finish_reason", "output_tokens", "info", "served_model_name", "preset", "backend",
    "compiled", "state",
)

CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>trnrt dashboard</title>
<style>
:root { --bg:#0f1216; --panel:#171b21; --line:#2a3038; --fg:#d8dee6; --dim:#8590a0; --ok:#3fb950;
        --warn:#d29922; --bad:#f85149; --a:#58a6ff; --b:#bc8cff; --c:#3fb950; --d:#f0883e; --e:#ff7b72; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--fg); font:13px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; }
header { display:flex; align-items:baseline; gap:16px; padding:10px 16px; border-bottom:1px solid var(--line); }
header h1 { font-size:16px; margin:0; }
#sub { color:var(--dim); }
#status { margin-left:auto; font-size:12px; color:var(--dim); }
#status.err { color:var(--bad); font-weight:600; }
main { padding:12px 16px; display:grid; gap:12px; grid-template-columns: repeat(12, 1fr); }
.panel { background:var(--panel); border:1px solid var(--line); border-radius:6px; padding:10px 12px; min-width:0; }
.panel h2 { font-size:12px; font-weight:600; color:var(--dim); text-transform:uppercase; letter-spacing:.05em; margin:0 0 8px; }
.tiles { grid-column: span 12; display:grid; grid-template-columns: repeat(8, 1fr); gap:12px; }
.tile .v { font-size:22px; font-weight:600; font-variant-numeric: tabular-nums; }
.tile .k { color:var(--dim); font-size:12px; }
.chart { grid-column: span 6; }
.chart canvas { width:100%; height:180px; display:block; }
.legend { display:flex; gap:12px; font-size:12px; color:var(--dim); margin-top:4px; flex-wrap:wrap; }
.legend i { display:inline-block; width:10px; height:10px; border-radius:2px; margin-right:4px; vertical-align:-1px; }
.gauges { grid-column: span 4; }
.g { display:grid; grid-template-columns: 90px 1fr 110px; gap:8px; align-items:center; margin:6px 0; }
.bar { height:10px; background:#0b0e12; border:1px solid var(--line); border-radius:5px; overflow:hidden; }
.bar > div { height:100%; width:0; background:var(--ok); transition: width .3s; }
.g .t { text-align:right; font-variant-numeric: tabular-nums; color:var(--dim); }
.lat { grid-column: span 8; }
table { width:100%; border-collapse:collapse; font-variant-numeric: tabular-nums; }
th, td { text-align:right; padding:3px 6px; border-bottom:1px solid var(--line); white-space:nowrap; }
th:first-child, td:first-child { text-align:left; }
th { color:var(--dim); font-weight:500; font-size:12px; }
.engines, .recent { grid-column: span 12; }
.down { color:var(--bad); font-weight:600; }
.muted { color:var(--dim); }
</style>
</head>
<body>
<header><h1>trnrt</h1><span id="sub">waiting for /v1/stats …</span><span id="status">connecting</span></header>
<main>
  <section class="tiles">
    <div class="panel tile"><div class="v" id="t-running">-</div><div class="k">running</div></div>
    <div class="panel tile"><div class="v" id="t-queued">-</div><div class="k">queued</div></div>
    <div class="panel tile"><div class="v" id="t-done">-</div><div class="k">finished</div></div>
    <div class="panel tile"><div class="v" id="t-errors">-</div><div class="k">errors · aborts</div></div>
    <div class="panel tile"><div class="v" id="t-gen">-</div><div class="k">output tok/s</div></div>
    <div class="panel tile"><div class="v" id="t-prompt">-</div><div class="k">prompt tok/s</div></div>
    <div class="panel tile"><div class="v" id="t-rps">-</div><div class="k">requests/s</div></div>
    <div class="panel tile"><div class="v" id="t-tokens">-</div><div class="k">output tokens total</div></div>
  </section>
  <section class="panel chart"><h2>Throughput</h2><canvas id="c-tput"></canvas>
    <div class="legend"><span><i style="background:var(--a)"></i>output tok/s</span>
    <span><i style="background:var(--b)"></i>prompt tok/s</span><span><i style="background:var(--c)"></i>requests/s ×100</span></div></section>
  <section class="panel chart"><h2>Latency percentiles (ms)</h2><canvas id="c-lat"></canvas>
    <div class="legend"><span><i style="background:var(--a)"></i>TTFT p50</span><span><i style="background:var(--b)"></i>TTFT p99</span>
    <span><i style="background:var(--c)"></i>ITL p50</span><span><i style="background:var(--d)"></i>ITL p99</span>
    <span><i style="background:var(--e)"></i>E2E p50</span></div></section>
  <section class="panel gauges"><h2>Queue and cache</h2>
    <div class="g"><span>queue</span><div class="bar"><div id="g-queue"></div></div><span class="t" id="gt-queue">-</span></div>
    <div class="g"><span>slots</span><div class="bar"><div id="g-slots"></div></div><span class="t" id="gt-slots">-</span></div>
    <div class="g"><span>KV pages</span><div class="bar"><div id="g-pages"></div></div><span class="t" id="gt-pages">-</span></div>
    <div class="g"><span>prefix hit</span><div class="bar"><div id="g-hit"></div></div><span class="t" id="gt-hit">-</span></div>
  </section>
  <section class="panel lat"><h2>Latency over the server's window</h2>
    <table><thead><tr><th>metric</th><th>p50</th><th>p90</th><th>p99</th><th>samples</th></tr></thead><tbody id="lat"></tbody></table></section>
  <section class="panel engines"><h2>Engines</h2>
    <table><thead><tr><th>engine</th><th>state</th><th>run</th><th>queue</th><th>done</th><th>errors</th>
    <th>TTFT p50</th><th>TTFT p99</th><th>ITL p50</th><th>E2E p50</th><th>KV pages</th><th>slots</th><th>prefix hit</th></tr></thead>
    <tbody id="engines"></tbody></table></section>
  <section class="panel recent"><h2>Recent requests <span class="muted">(counts and times only)</span></h2>
    <table><thead><tr><th>finished</th><th>engine</th><th>reason</th><th>prompt</th><th>cached</th><th>output</th>
    <th>queue</th><th>TTFT</th><th>ITL</th><th>E2E</th></tr></thead><tbody id="recent"></tbody></table></section>
</main>
<script>
"use strict";
(function () {
  const params = new URLSearchParams(location.search);
  const interval = Math.max(0.1, parseFloat(params.get("interval") || "1")) * 1000;
  const key = new URLSearchParams(location.hash.slice(1)).get("key");
  const headers = { "Accept": "application/json" };
  if (key) headers["Authorization"] = "Bearer " + key;
  const HISTORY = 120;
  const hist = { gen: [], prompt: [], rps: [], ttft50: [], ttft99: [], itl50: [], itl99: [], e2e50: [] };
  let prev = null, polls = 0, inflight = false;
  const $ = (id) => document.getElementById(id);
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  const num = (v) => (typeof v === "number" && isFinite(v)) ? v : null;
  function fmtMs(v) { v = num(v); if (v === null) return "-"; if (v >= 1000) return (v / 1000).toFixed(2) + "s"; if (v >= 10) return v.toFixed(0) + "ms"; return v.toFixed(1) + "ms"; }
  function fmtRate(v) { v = num(v); if (v === null) return "-"; return v >= 1000 ? (v / 1000).toFixed(1) + "k" : v.toFixed(1); }
  function fmtPct(v) { v = num(v); return v === null ? "-" : (100 * v).toFixed(0) + "%"; }
  function fmtDur(s) { s = Math.floor(num(s) || 0); if (s < 60) return s + "s"; if (s < 3600) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
    if (s < 86400) return Math.floor(s / 3600) + "h" + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m"; return Math.floor(s / 86400) + "d" + String(Math.floor(s % 86400 / 3600)).padStart(2, "0") + "h"; }
  function usedOf(u, t) { u = u || 0; t = t || 0; return t ? u + "/" + t + " " + (100 * u / t).toFixed(0) + "%" : u + "/" + t; }
  function push(a, v) { a.push(v); if (a.length > HISTORY) a.shift(); }

  // Throughput from counter deltas over the server's uptime delta (trnrt top's instant_rates);
  // the server's 1-minute rates on the first poll or after a restart.
  function rates(p, s) {
    const c1 = s.counters || {}, r = (s.rates || {})["1m"] || {};
    if (p) {
      const c0 = p.counters || {}, dt = (s.uptime_s || 0) - (p.uptime_s || 0);
      const d = { gen: (c1.generation_tokens || 0) - (c0.generation_tokens || 0),
                  prompt: (c1.prompt_tokens || 0) - (c0.prompt_tokens || 0),
                  rps: (c1.requests_finished_total || 0) - (c0.requests_finished_total || 0) };
      if (dt > 0 && d.gen >= 0 && d.prompt >= 0 && d.rps >= 0) return { gen: d.gen / dt, prompt: d.prompt / dt, rps: d.rps / dt };
    }
    return { gen: r.generation_tokens_per_s || 0, prompt: r.prompt_tokens_per_s || 0, rps: r.requests_finished_per_s || 0 };
  }

  function gauge(id, ratio, text) {
    const r = Math.min(Math.max(num(ratio) || 0, 0), 1), el = $("g-" + id);
    el.style.width = (100 * r).toFixed(1) + "%";
    el.style.background = r < 0.7 ? "var(--ok)" : r < 0.9 ? "var(--warn)" : "var(--bad)";
    $("gt-" + id).textContent = text;
  }

  function chart(id, series, opts) {
    const cv = $(id), dpr = window.devicePixelRatio || 1, w = cv.clientWidth, h = cv.clientHeight;
    if (cv.width !== w * dpr || cv.height !== h * dpr) { cv.width = w * dpr; cv.height = h * dpr; }
    const g = cv.getContext("2d"); g.setTransform(dpr, 0, 0, dpr, 0, 0); g.clearRect(0, 0, w, h);
    const pad = { l: 46, r: 8, t: 8, b: 18 }, iw = w - pad.l - pad.r, ih = h - pad.t - pad.b;
    let max = 0; for (const s of series) for (const v of s.data) if (num(v) !== null && v * (s.scale || 1) > max) max = v * (s.scale || 1);
    max = max > 0 ? max * 1.15 : 1;
    g.strokeStyle = "#2a3038"; g.fillStyle = "#8590a0"; g.font = "11px system-ui, sans-serif"; g.lineWidth = 1;
    for (let i = 0; i <= 4; i++) { const y = pad.t + ih * i / 4; g.beginPath(); g.moveTo(pad.l, y); g.lineTo(w - pad.r, y); g.stroke();
      g.fillText(opts.fmt(max * (4 - i) / 4), 2, y + 4); }
    g.fillText(opts.xlabel, pad.l, h - 4);
    for (const s of series) {
      g.strokeStyle = s.color; g.lineWidth = 1.6; g.beginPath(); let started = false;
      s.data.forEach((v, i) => { if (num(v) === null) { started = false; return; }
        const x = pad.l + iw * (HISTORY - s.data.length + i) / (HISTORY - 1), y = pad.t + ih * (1 - v * (s.scale || 1) / max);
        if (started) g.lineTo(x, y); else { g.moveTo(x, y); started = true; } });
      g.stroke();
    }
  }

  function css(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }

  function render(s) {
    const eng = s.engines || [], live = s.live || {}, c = s.counters || {}, lat = s.latency || {};
    const info = (eng.find((e) => e.state !== "down") || {}).info || {};
    $("sub").textContent = (info.served_model_name || info.model || "?") + " · preset " + (info.preset || "?") + " · " +
      (info.backend || "?") + (info.compiled ? " compiled" : " eager") + " · up " + fmtDur(s.uptime_s) + " · " + eng.length + " engine(s)";
    const r = rates(prev, s); prev = s;
    $("t-running").textContent = live.running || 0; $("t-queued").textContent = live.queued || 0;
    $("t-done").textContent = c.requests_finished_total || 0; $("t-errors").textContent = (c.errors || 0) + " · " + (c.aborts || 0);
    $("t-gen").textContent = fmtRate(r.gen); $("t-prompt").textContent = fmtRate(r.prompt); $("t-rps").textContent = fmtRate(r.rps);
    $("t-tokens").textContent = c.generation_tokens || 0;
    push(hist.gen, r.gen); push(hist.prompt, r.prompt); push(hist.rps, r.rps);
    const p = (k, q) => num((lat[k] || {})[q]);
    push(hist.ttft50, p("ttft_ms", "p50")); push(hist.ttft99, p("ttft_ms", "p99")); push(hist.itl50, p("itl_ms", "p50"));
    push(hist.itl99, p("itl_ms", "p99")); push(hist.e2e50, p("e2e_ms", "p50"));
    chart("c-tput", [{ data: hist.gen, color: css("--a") }, { data: hist.prompt, color: css("--b") }, { data: hist.rps, color: css("--c"), scale: 100 }],
          { fmt: fmtRate, xlabel: "last " + HISTORY + " polls" });
    chart("c-lat", [{ data: hist.ttft50, color: css("--a") }, { data: hist.ttft99, color: css("--b") }, { data: hist.itl50, color: css("--c") },
                    { data: hist.itl99, color: css("--d") }, { data: hist.e2e50, color: css("--e") }], { fmt: fmtMs, xlabel: "last " + HISTORY + " polls" });
    const slots = live.slots_total || 0, queued = live.queued || 0;
    gauge("queue", slots ? Math.min(queued / slots, 1) : 0, queued + " queued");
    gauge("slots", slots ? (live.slots_used || 0) / slots : 0, usedOf(live.slots_used, slots));
    gauge("pages", live.pages_total ? (live.pages_used || 0) / live.pages_total : 0, usedOf(live.pages_used, live.pages_total));
    gauge("hit", s.prefix_hit_rate, fmtPct(s.prefix_hit_rate));
    $("lat").innerHTML = [["TTFT", "ttft_ms"], ["ITL", "itl_ms"], ["E2E", "e2e_ms"], ["queue", "queue_ms"]].map(([n, k]) => {
      const x = lat[k] || {}; return "<tr><td>" + n + "</td><td>" + fmtMs(x.p50) + "</td><td>" + fmtMs(x.p90) + "</td><td>" + fmtMs(x.p99) + "</td><td>" + (x.count || 0) + "</td></tr>"; }).join("");
    const rows = eng.map((e) => {
      const l = e.live || {}, k = e.counters || {}, t = e.latency || {}, m = (a, q) => fmtMs((t[a] || {})[q]);
      if (e.state === "down") return "<tr><td>" + esc(e.id) + '</td><td class="down">down</td>' + "<td>-</td>".repeat(11) + "</tr>";
      return "<tr><td>" + esc(e.id) + "</td><td>" + esc(e.state) + "</td><td>" + (l.running || 0) + "</td><td>" + (l.queued || 0) + "</td><td>" +
        (k.requests_finished_total || 0) + "</td><td>" + (k.errors || 0) + "</td><td>" + m("ttft_ms", "p50") + "</td><td>" + m("ttft_ms", "p99") +
        "</td><td>" + m("itl_ms", "p50") + "</td><td>" + m("e2e_ms", "p50") + "</td><td>" + usedOf(l.pages_used, l.pages_total) + "</td><td>" +
        usedOf(l.slots_used, l.slots_total) + "</td><td>" + fmtPct(e.prefix_hit_rate) + "</td></tr>"; });
    if (eng.length > 1) rows.push("<tr><td><b>total</b></td><td>" + eng.filter((e) => e.state !== "down").length + "/" + eng.length + " ok</td><td>" +
      (live.running || 0) + "</td><td>" + queued + "</td><td>" + (c.requests_finished_total || 0) + "</td><td>" + (c.errors || 0) + "</td><td>" +
      fmtMs(p("ttft_ms", "p50")) + "</td><td>" + fmtMs(p("ttft_ms", "p99")) + "</td><td>" + fmtMs(p("itl_ms", "p50")) + "</td><td>" +
      fmtMs(p("e2e_ms", "p50")) + "</td><td>" + usedOf(live.pages_used, live.pages_total) + "</td><td>" + usedOf(live.slots_used, slots) +
      "</td><td>" + fmtPct(s.prefix_hit_rate) + "</td></tr>");
    $("engines").innerHTML = rows.join("");
    const recent = [];
    for (const e of eng) for (const q of (e.recent_requests || [])) recent.push([e.id, q]);
    recent.sort((a, b) => (b[1].finished_at_s || 0) - (a[1].finished_at_s || 0));
    $("recent").innerHTML = recent.slice(0, 20).map(([id, q]) => "<tr><td>" + new Date((q.finished_at_s || 0) * 1000).toLocaleTimeString() +
      "</td><td>" + esc(id) + "</td><td>" + esc(q.finish_reason) + "</td><td>" + (q.prompt_tokens || 0) + "</td><td>" + (q.cached_tokens || 0) +
      "</td><td>" + (q.output_tokens || 0) + "</td><td>" + fmtMs(q.queue_ms) + "</td><td>" + fmtMs(q.ttft_ms) + "</td><td>" + fmtMs(q.itl_ms) +
      "</td><td>" + fmtMs(q.e2e_ms) + "</td></tr>").join("") || '<tr><td class="muted" colspan="10">none yet</td></tr>';
  }

  async function poll() {
    if (inflight) return;  // at most one fetch in flight; a slow server still gets its answers shown
    inflight = true;
    try {
      const resp = await fetch("v1/stats", { headers, cache: "no-store" });
      if (!resp.ok) throw new Error("HTTP " + resp.status + (resp.status === 401 ? " (open /dashboard#key=KEY)" : ""));
      const s = await resp.json();
      if (s.version !== 1) throw new Error("unsupported stats schema version " + s.version);
      render(s); polls++;
      const st = $("status"); st.className = ""; st.textContent = "live · poll " + polls + " · every " + interval / 1000 + "s";
      document.body.dataset.polls = polls;
    } catch (err) {
      const st = $("status"); st.className = "err"; st.textContent = "unreachable: " + err.message + " · retrying";
    } finally { inflight = false; }
  }
  window.trnrtDashboard = { render, rates };
  poll(); setInterval(poll, interval);
})();
</script>
</body>
</html>
"""


class Dashboard:
    """GET /dashboard: the page (no data in it; the data comes from /v1/stats)."""

    def on_get(self, req, resp) -> None:
        resp.content_type = "text/html; charset=utf-8"
        resp.set_header("Cache-Control", "no-cache")
        resp.set_header("Content-Security-Policy", CSP)
        resp.set_header("X-Content-Type-Options", "nosniff")
        resp.text = PAGE


def routes() -> dict:
    return {"/dashboard": Dashboard()}
