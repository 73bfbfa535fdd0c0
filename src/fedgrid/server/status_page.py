"""The coordinator's status page (``GET /``): static HTML and one inline script, and the hold
that keeps the page's final state served after the run ends (``FinalStateHold``).

The page holds no data: its script polls ``/api/status`` every ``POLL_MS`` and draws the
current round, its progress, one inline SVG plot each of accuracy (%), loss and wire bytes
per round (a point per committed round; round numbers on the x axis, round values with
their unit on the y axis, e.g. ``117 kB``), the clients table (with each client's
running task's progress, as its heartbeats report it: steps, examples per second, time left;
its utilization: the compute share of its last fit task's window, its split in the cell's
tooltip) and the regions table (the sums of their clients' last splits). Before the first
round commits each plot says ``waiting for round 1``. A banner says when the run finished;
when ``/api/status`` can no longer be read (the coordinator exited) the page keeps what it
drew last and says so, with the time of that state.

It loads nothing from elsewhere: no CDN, font or image. Each response carries a fresh nonce
and a Content-Security-Policy that allows only this page's own script and style
(``'nonce-...'``) and requests to its own origin, so even a script injected into the page
would not run. Client names and regions are client text: the script sets them with
``textContent``, never as HTML.

Behind a bearer token (``fedgrid.webserve``) the page is opened as ``/#token=TOKEN``: the
script sends the fragment's token with its requests (a fragment never leaves the browser).
"""

from __future__ import annotations

import math
import secrets
import threading
from typing import Callable, Mapping

from fedgrid.clock import MONOTONIC, Clock
from fedgrid.webserve import Response, Route

__all__ = ["page_response", "FinalStateHold", "POLL_MS", "PLOTS", "STATUS_PATH"]

#: How often the page asks for ``/api/status``, milliseconds.
POLL_MS = 3000
#: The plots: element id suffix -> the ``/api/status`` history field drawn.
PLOTS = {"accuracy": "accuracy", "loss": "loss", "bytes": "bytes"}
#: The route the page polls, whose readers ``FinalStateHold`` waits for.
STATUS_PATH = "/api/status"


class FinalStateHold:
    """Keeps the status server up after the run finished until its watcher has read the final state.

    The page polls every ``POLL_MS``: a coordinator that stopped serving the moment its run
    finished would leave a watching page on the state before (the last round missing). The
    coordinator wraps its routes with ``routes`` and calls ``wait`` before it stops the
    server: when the run has finished, ``/api/status`` was read in the last ``limit_s``
    seconds (someone is watching) and no read has yet served the final state, it waits for
    such a read, at most ``limit_s`` from the call. A run that did not finish (stopped,
    failed), an unwatched one, or one whose watcher already saw the end never waits.

    Args:
        is_final: whether ``/api/status`` now serves the final state; asked before each read
            (a read that starts once it holds serves the final state).
        limit_s: the longest wait, and how recent a read must be to count as watching; 0: none.
        clock: the time reads are stamped and the wait ends in (``fedgrid.clock``; a test
            passes a ``ManualClock``).

    Raises:
        ValueError: ``limit_s`` is negative or not finite.
    """

    def __init__(self, is_final: Callable[[], bool], *, limit_s: float, clock: Clock = MONOTONIC) -> None:
        if not 0.0 <= limit_s < math.inf:
            raise ValueError(f"limit_s must be a finite number at least 0, got {limit_s}")
        self._is_final = is_final
        self.limit_s = limit_s
        self.clock = clock
        # Reentrant: release() may run in a signal handler on the thread waiting in wait().
        self._cond = threading.Condition(threading.RLock())
        self._last_read: float | None = None  # the clock's time of the last read served
        self._final_read = False
        self._released = False

    def routes(self, routes: Mapping[str, Route]) -> dict[str, Route]:
        """``routes`` with ``STATUS_PATH``'s handler noting each read it serves (200)."""
        wrapped = dict(routes)
        route = wrapped.get(STATUS_PATH)
        if route is None:
            return wrapped
        handler = route.handler

        def read() -> Response:
            final = self._is_final()  # before the read: the state never leaves the end
            response = handler()
            if response.status == 200:
                with self._cond:
                    self._last_read = self.clock.now()
                    self._final_read = self._final_read or final
                    self._cond.notify_all()
            return response

        wrapped[STATUS_PATH] = Route(read, public=route.public)
        return wrapped

    def watched(self) -> bool:
        """Whether the run has finished and a reader read ``STATUS_PATH`` within ``limit_s``
        but has not seen the final state."""
        with self._cond:
            return (
                self._is_final()
                and self._last_read is not None
                and self.clock.now() - self._last_read <= self.limit_s
                and not self._final_read
            )

    def wait(self) -> float:
        """Blocks while ``watched()``: until a read serves the final state, ``limit_s`` passed
        or ``release()``; returns the seconds waited."""
        start = self.clock.now()
        with self._cond:
            if not self.watched():
                return 0.0
            while not self._final_read and not self._released:
                if self.clock.now() >= start + self.limit_s:
                    break
                self.clock.wait_until(self._cond, start + self.limit_s)
        return self.clock.now() - start

    def release(self) -> None:
        """Ends a ``wait`` at once (a stop signal); later ones return at once too."""
        with self._cond:
            self._released = True
            self._cond.notify_all()


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; margin: 0 0 .4em 0; }
.plots { display: flex; gap: 1em; flex-wrap: wrap; }
figure { margin: 0; border: 1px solid #ccc; padding: .4em; }
figcaption { font-size: .9em; color: #555; }
table { border-collapse: collapse; margin-top: 1em; }
td, th { border-bottom: 1px solid #ddd; padding: .25em .8em; text-align: left; font-size: .9em; }
#error { color: #b00; }
#banner { font-weight: 600; min-height: 1.2em; }
#banner[data-state="finished"] { color: #1a6b2a; }
#banner[data-state="ended"] { color: #1a6b2a; }
#banner[data-state="unreachable"] { color: #a05a00; }
"""

_SCRIPT = """
"use strict";
// One plot: a W x H box, its data inside the margins (left: the y ticks and title; bottom: the rounds).
const BYTES = ["B", "kB", "MB", "GB", "TB"];
const W = 340, H = 180, ML = 62, MR = 12, MT = 12, MB = 36;
// Each plot's y axis: its title (with the unit) and how a value of it is written.
const AXES = {
  accuracy: {title: "accuracy (%)", tick: (v, step) => fixed(v * 100, step * 100) + "%", value: v => (v * 100).toFixed(1) + "%"},
  loss: {title: "loss (mean per example)", tick: (v, step, top) => scaled(v, step, top, ["", "k", "M", "G", "T"], ""), value: v => String(Number(v.toPrecision(4)))},
  bytes: {title: "bytes (up + down)", floor: 0, tick: (v, step, top) => scaled(v, step, top, BYTES, " "), value: v => human(v)},
};
let last = null;  // the last status read: kept, and shown, when the coordinator stops answering
function token() {
  const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
  return m ? decodeURIComponent(m[1]) : null;
}
function svg(tag, attrs, content) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const k in attrs) e.setAttribute(k, String(attrs[k]));
  if (content !== undefined) e.textContent = content;
  return e;
}
function places(step) {  // the decimals that write every multiple of step exactly
  let d = 0;
  while (d < 6 && Math.abs(Math.round(step * 10 ** d) - step * 10 ** d) > 1e-6) d++;
  return d;
}
function fixed(v, step) { return v.toFixed(places(step)); }
function scaled(v, step, top, units, sep) {  // 117000 (step 20000) -> "117 kB": in the unit of the axis' top value
  let k = 0;
  while (k < units.length - 1 && top >= 1000 ** (k + 1)) k++;
  return (v === 0 ? "0" : fixed(v / 1000 ** k, step / 1000 ** k)) + (units[k] ? sep + units[k] : "");
}
function human(v) {  // 117000 -> "117 kB"
  let k = 0;
  while (k < BYTES.length - 1 && Math.abs(v) >= 1000 ** (k + 1)) k++;
  return Number((v / 1000 ** k).toPrecision(3)) + " " + BYTES[k];
}
function ticks(lo, hi, count, steps) {  // round values at a round step covering [lo, hi]
  const raw = (hi - lo) / count, mag = 10 ** Math.floor(Math.log10(raw));
  const step = (steps.find(m => m * mag >= raw) || 10) * mag;
  const first = Math.floor(lo / step + 1e-9), end = Math.ceil(hi / step - 1e-9);
  const values = [];
  for (let i = first; i <= end; i++) values.push(Number((i * step).toPrecision(12)));
  return {step, values};
}
function yAxis(ys, axis) {  // the y ticks: the data's range (from the axis' floor, if it has one), widened to round values
  let lo = Math.min(...ys), hi = Math.max(...ys);
  if (axis.floor !== undefined) lo = Math.min(lo, axis.floor);
  if (hi - lo < 1e-12 * Math.max(1, Math.abs(hi))) { const pad = Math.abs(hi) / 10 || 1; lo -= pad; hi += pad; }
  return ticks(lo, hi, 4, [1, 2, 2.5, 5, 10]);
}
function xAxis(rounds) {  // whole rounds only
  const lo = Math.min(...rounds), hi = Math.max(...rounds);
  if (lo === hi) return {lo: lo - 1, hi: hi + 1, values: [lo]};
  const step = Math.max(1, ticks(lo, hi, 8, [1, 2, 5, 10]).step);
  const values = [];
  for (let r = Math.ceil(lo / step) * step; r <= hi; r += step) values.push(r);
  return {lo, hi, values};
}
function frame(box, id) {  // the empty box: background and the axis titles
  box.replaceChildren();
  box.appendChild(svg("rect", {x: 0, y: 0, width: W, height: H, fill: "#fafafa"}));
  box.appendChild(svg("text", {class: "axis-title", x: 12, y: MT + (H - MT - MB) / 2, transform: "rotate(-90 12 " + (MT + (H - MT - MB) / 2) + ")", "text-anchor": "middle", "font-size": 11, fill: "#333"}, AXES[id].title));
  box.appendChild(svg("text", {class: "axis-title", x: ML + (W - ML - MR) / 2, y: H - 4, "text-anchor": "middle", "font-size": 11, fill: "#333"}, "round"));
}
function empty(box, message) {
  box.appendChild(svg("text", {class: "empty", x: ML + (W - ML - MR) / 2, y: MT + (H - MT - MB) / 2, "text-anchor": "middle", "font-size": 13, fill: "#777"}, message));
}
function plot(id, rows, value, s) {
  const box = document.getElementById("plot-" + id), axis = AXES[id];
  frame(box, id);
  const pts = rows.map(r => [r.round, value(r)]).filter(p => typeof p[1] === "number" && isFinite(p[1]));
  box.setAttribute("data-points", String(pts.length));
  const latest = document.getElementById("last-" + id);
  latest.textContent = pts.length ? "(round " + pts[pts.length - 1][0] + ": " + axis.value(pts[pts.length - 1][1]) + ")" : "";
  if (!pts.length) {
    const ended = s.state === "finished" || s.state === "stopped";
    empty(box, rows.length ? "no " + id + " in rounds " + rows[0].round + "-" + rows[rows.length - 1].round : ended ? "no round committed" : "waiting for round 1");
    return;
  }
  const yt = yAxis(pts.map(p => p[1]), axis), xt = xAxis(pts.map(p => p[0]));
  const lo = yt.values[0], hi = yt.values[yt.values.length - 1];
  const x = r => (ML + (W - ML - MR) * (r - xt.lo) / (xt.hi - xt.lo)).toFixed(1);
  const y = v => (H - MB - (H - MT - MB) * (v - lo) / (hi - lo)).toFixed(1);
  for (const v of yt.values) {
    box.appendChild(svg("line", {x1: ML, x2: W - MR, y1: y(v), y2: y(v), stroke: "#ddd"}));
    box.appendChild(svg("text", {class: "tick", x: ML - 4, y: +y(v) + 4, "text-anchor": "end", "font-size": 10, fill: "#555"}, axis.tick(v, yt.step, Math.max(Math.abs(lo), Math.abs(hi)))));
  }
  for (const r of xt.values) {
    box.appendChild(svg("line", {x1: x(r), x2: x(r), y1: H - MB, y2: H - MB + 4, stroke: "#555"}));
    box.appendChild(svg("text", {class: "tick round", x: x(r), y: H - MB + 15, "text-anchor": "middle", "font-size": 10, fill: "#555"}, String(r)));
  }
  box.appendChild(svg("line", {x1: ML, x2: W - MR, y1: H - MB, y2: H - MB, stroke: "#555"}));
  box.appendChild(svg("polyline", {points: pts.map(p => x(p[0]) + "," + y(p[1])).join(" "), fill: "none", stroke: "#2a6fdb", "stroke-width": 2}));
  for (const p of pts) {
    const dot = svg("circle", {class: "pt", cx: x(p[0]), cy: y(p[1]), r: 3, fill: "#2a6fdb"});
    dot.appendChild(svg("title", {}, "round " + p[0] + ": " + axis.value(p[1])));
    box.appendChild(dot);
  }
}
function text(id, value) { document.getElementById(id).textContent = value; }
function device(c) {  // "cuda x2, 80.0 GiB memory": the device type, accelerators, memory
  return (c.device || "") + (c.accelerators ? " x" + c.accelerators : "") + (c.memory_bytes ? ", " + (c.memory_bytes / 1073741824).toFixed(1) + " GiB memory" : "");
}
function hms(s) {  // "0:01:05"; "?" when unknown (-1)
  if (typeof s !== "number" || s < 0) return "?";
  const t = Math.round(s);
  return Math.floor(t / 3600) + ":" + String(Math.floor(t / 60) % 60).padStart(2, "0") + ":" + String(t % 60).padStart(2, "0");
}
function task(p) {  // "step 120/500, 85.2 examples/s, 0:01:05 left": the client's running task, as it reports it
  if (!p) return "-";
  return "step " + p.steps_done + (p.steps_total ? "/" + p.steps_total : "") + ", " + p.examples_per_s.toFixed(1) + " examples/s" + (p.tokens_per_s ? ", " + Math.round(p.tokens_per_s) + " tokens/s" : "") + ", " + hms(p.eta_s) + " left";
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
function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }
function banner(s, failure) {  // the run's condition in words; with failure, the coordinator no longer answers
  let words = "", state = s.state;
  if (s.state === "finished") words = "run finished: " + s.committed + " of " + s.rounds + " rounds committed";
  else if (s.state === "stopped") words = "run stopped after " + s.committed + " of " + s.rounds + " rounds";
  else if (!s.committed) words = "waiting for round 1" + (s.progress ? "" : " (" + s.clients_total + (s.clients_total === 1 ? " client" : " clients") + " joined)");
  if (failure && s.state === "finished") {
    state = "ended";
    words += "; the coordinator no longer answers (it has exited): this is the run's final state, read at " + clock(s.time);
  } else if (failure) {
    state = "unreachable";
    words = "the coordinator stopped answering (the run may have ended): showing the last state read, at " + clock(s.time) + ", round " + s.round + " of " + s.rounds;
  }
  const b = document.getElementById("banner");
  b.textContent = words;
  b.setAttribute("data-state", state);
  document.title = "fedgrid: " + (state === "running" || state === "starting" ? "round " + s.round + " / " + s.rounds : state);
}
function render(s) {
  text("run", s.run_id);
  text("state", s.state + (s.phase && s.phase !== s.state ? " / " + s.phase : ""));
  text("round", s.round + " / " + s.rounds);
  const p = s.progress;
  text("progress", p ? p.phase + ": " + p.results + " of " + p.expected + " results, " + p.failures + " failed" + (p.closed ? " (closed)" : "") : "-");
  const h = s.history;
  plot("accuracy", h, r => r.accuracy, s);
  plot("loss", h, r => r.loss, s);
  plot("bytes", h, r => r.bytes_up + r.bytes_down, s);
  const body = document.getElementById("clients");
  body.replaceChildren();
  for (const c of s.clients) {
    const tr = document.createElement("tr");
    for (const v of [c.name, c.region, c.state, task(c.progress), device(c), ago(c.last_seen_s)]) cell(tr, v);
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
}
async function refresh() {
  const headers = {};
  const t = token();
  if (t) headers["Authorization"] = "Bearer " + t;
  try {
    const r = await fetch("/api/status", {headers: headers, cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    const s = await r.json();
    render(s);
    last = s;
    banner(s, null);
    text("error", "");
  } catch (e) {
    // What was drawn stays: a coordinator that exited leaves its last state on the page.
    text("error", "cannot read /api/status: " + e.message);
    if (last) banner(last, e);
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
<p id="banner" data-state="loading"></p>
<div class="plots">
<figure><svg id="plot-accuracy" width="340" height="180" viewBox="0 0 340 180"></svg><figcaption>accuracy per round <span id="last-accuracy"></span></figcaption></figure>
<figure><svg id="plot-loss" width="340" height="180" viewBox="0 0 340 180"></svg><figcaption>loss per round <span id="last-loss"></span></figcaption></figure>
<figure><svg id="plot-bytes" width="340" height="180" viewBox="0 0 340 180"></svg><figcaption>wire bytes (up + down) per round <span id="last-bytes"></span></figcaption></figure>
</div>
<p id="clients-total"></p>
<table><thead><tr><th>name</th><th>region</th><th>state</th><th>task progress</th><th>device</th><th>last seen</th><th>utilization</th><th>id</th></tr></thead>
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
