"""The coordinator's status page (``GET /``): static HTML and one inline script.

The page holds no data: its script polls ``/api/status`` every ``POLL_MS`` and draws the
current round, its progress, one inline SVG plot each of accuracy, loss and bytes per round
(a point per committed round), the clients table (with each client's utilization: the
compute share of its last fit task's window, its split in the cell's tooltip) and the
regions table (the sums of their clients' last splits). It loads nothing from elsewhere: no
CDN, font or image. Each response carries a fresh nonce and a Content-Security-Policy that
allows only this page's own script and style (``'nonce-...'``) and requests to its own
origin, so even a script injected into the page would not run. Client names and regions
are client text: the script sets them with ``textContent``, never as HTML.

Behind a bearer token (``fedgrid.webserve``) the page is opened as ``/#token=TOKEN``: the
script sends the fragment's token with its requests (a fragment never leaves the browser).
"""

from __future__ import annotations

import secrets

from fedgrid.webserve import Response

__all__ = ["page_response", "POLL_MS", "PLOTS"]

#: How often the page asks for ``/api/status``, milliseconds.
POLL_MS = 3000
#: The plots: element id suffix -> the ``/api/status`` history field drawn.
PLOTS = {"accuracy": "accuracy", "loss": "loss", "bytes": "bytes"}

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; margin: 0 0 .4em 0; }
.plots { display: flex; gap: 1em; flex-wrap: wrap; }
figure { margin: 0; border: 1px solid #ccc; padding: .4em; }
figcaption { font-size: .9em; color: #555; }
table { border-collapse: collapse; margin-top: 1em; }
td, th { border-bottom: 1px solid #ddd; padding: .25em .8em; text-align: left; font-size: .9em; }
#error { color: #b00; }
"""

_SCRIPT = """
"use strict";
const W = 340, H = 160, PAD = 28;
function token() {
  const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
  return m ? decodeURIComponent(m[1]) : null;
}
function svg(tag, attrs) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const k in attrs) e.setAttribute(k, String(attrs[k]));
  return e;
}
function plot(id, values) {
  const box = document.getElementById("plot-" + id);
  box.replaceChildren();
  const pts = values.map((v, i) => [i, v]).filter(p => typeof p[1] === "number" && isFinite(p[1]));
  box.setAttribute("data-points", String(pts.length));
  box.appendChild(svg("rect", {x: 0, y: 0, width: W, height: H, fill: "#fafafa"}));
  if (!pts.length) return;
  const ys = pts.map(p => p[1]);
  let lo = Math.min(...ys), hi = Math.max(...ys);
  if (hi === lo) { hi += 1; lo -= 1; }
  const n = Math.max(values.length - 1, 1);
  const x = i => PAD + (W - 2 * PAD) * (values.length === 1 ? 0.5 : i / n);
  const y = v => H - PAD - (H - 2 * PAD) * (v - lo) / (hi - lo);
  box.appendChild(svg("polyline", {points: pts.map(p => x(p[0]) + "," + y(p[1])).join(" "),
                                   fill: "none", stroke: "#2a6fdb", "stroke-width": 2}));
  for (const p of pts) box.appendChild(svg("circle", {class: "pt", cx: x(p[0]), cy: y(p[1]), r: 3, fill: "#2a6fdb"}));
  const label = (text, yy) => { const t = svg("text", {x: 2, y: yy, "font-size": 10, fill: "#555"}); t.textContent = text; box.appendChild(t); };
  label(hi.toPrecision(4), PAD - 4);
  label(lo.toPrecision(4), H - PAD + 12);
}
function text(id, value) { document.getElementById(id).textContent = value; }
function device(c) {  // "cuda x2, 80.0 GiB": the device type, accelerators, memory
  return (c.device || "") + (c.accelerators ? " x" + c.accelerators : "") + (c.memory_bytes ? ", " + (c.memory_bytes / 1073741824).toFixed(1) + " GiB" : "");
}
function num(v, digits) { return typeof v === "number" ? v.toFixed(digits) : "-"; }
function split(r) {  // "compute 5.5 s, comm 27.6 s, wait 0.4 s"
  return typeof r.wall_s === "number" ? "compute " + num(r.compute_s, 1) + " s, comm " + num(r.comm_s, 1) + " s, wait " + num(r.wait_s, 1) + " s of " + num(r.wall_s, 1) + " s" : "";
}
function cell(tr, value, title) {
  const td = document.createElement("td");
  td.textContent = value;  // client text: never parsed as HTML
  if (title) td.title = title;
  tr.appendChild(td);
  return td;
}
function ago(s) { return s < 60 ? s.toFixed(1) + " s ago" : (s / 60).toFixed(1) + " min ago"; }
function render(s) {
  text("run", s.run_id);
  text("state", s.state + (s.phase && s.phase !== s.state ? " / " + s.phase : ""));
  text("round", s.round + " / " + s.rounds);
  const p = s.progress;
  text("progress", p ? p.phase + ": " + p.results + " of " + p.expected + " results, " + p.failures + " failed" + (p.closed ? " (closed)" : "") : "-");
  const h = s.history;
  plot("accuracy", h.map(r => r.accuracy));
  plot("loss", h.map(r => r.loss));
  plot("bytes", h.map(r => r.bytes_up + r.bytes_down));
  const body = document.getElementById("clients");
  body.replaceChildren();
  for (const c of s.clients) {
    const tr = document.createElement("tr");
    for (const v of [c.name, c.region, c.state, device(c), ago(c.last_seen_s)]) cell(tr, v);
    cell(tr, num(c.utilization, 2), split(c)).className = "utilization";
    cell(tr, c.id);
    body.appendChild(tr);
  }
  const regions = document.getElementById("regions");
  regions.replaceChildren();
  for (const r of s.regions || []) {
    const tr = document.createElement("tr");
    cell(tr, r.region || "(none)");
    cell(tr, String(r.clients));
    cell(tr, num(r.utilization, 2), split(r)).className = "utilization";
    for (const k of ["compute_s", "comm_s", "wait_s"]) cell(tr, num(r[k], 1));
    regions.appendChild(tr);
  }
  text("clients-total", s.clients_total + " clients" + (s.clients_total > s.clients.length ? " (first " + s.clients.length + " shown)" : ""));
  text("error", "");
}
async function refresh() {
  const headers = {};
  const t = token();
  if (t) headers["Authorization"] = "Bearer " + t;
  try {
    const r = await fetch("/api/status", {headers: headers, cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
  } catch (e) {
    text("error", "cannot read /api/status: " + e.message);
  }
}
refresh();
setInterval(refresh, POLL_MS_VALUE);
"""

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>fedgrid coordinator</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style nonce="{nonce}">{style}</style></head>
<body>
<h1>fedgrid coordinator</h1>
<p>run <span id="run">-</span> &middot; <span id="state">-</span></p>
<p>round <strong id="round">-</strong> &middot; <span id="progress">-</span> <span id="error"></span></p>
<div class="plots">
<figure><svg id="plot-accuracy" width="340" height="160" viewBox="0 0 340 160"></svg><figcaption>accuracy per round</figcaption></figure>
<figure><svg id="plot-loss" width="340" height="160" viewBox="0 0 340 160"></svg><figcaption>loss per round</figcaption></figure>
<figure><svg id="plot-bytes" width="340" height="160" viewBox="0 0 340 160"></svg><figcaption>bytes (up + down) per round</figcaption></figure>
</div>
<p id="clients-total"></p>
<table><thead><tr><th>name</th><th>region</th><th>state</th><th>device</th><th>last seen</th><th>utilization</th><th>id</th></tr></thead>
<tbody id="clients"></tbody></table>
<table><thead><tr><th>region</th><th>clients</th><th>utilization</th><th>compute s</th><th>comm s</th><th>wait s</th></tr></thead>
<tbody id="regions"></tbody></table>
<script nonce="{nonce}">{script}</script>
</body></html>
"""


def page_response() -> Response:
    """The page with a fresh nonce, and the Content-Security-Policy that names it."""
    nonce = secrets.token_urlsafe(18)
    body = _PAGE.format(nonce=nonce, style=_STYLE, script=_SCRIPT.replace("POLL_MS_VALUE", str(POLL_MS)))
    csp = (
        f"default-src 'self'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; img-src 'self'; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return Response(
        body.encode("utf-8"),
        content_type="text/html; charset=utf-8",
        headers={"Content-Security-Policy": csp, "X-Frame-Options": "DENY"},
    )
