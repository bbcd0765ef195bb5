// kvgate dashboard: polls /dashboard/data and draws SVG line charts (no libraries, no CDN).
// Every chart shares one time axis: the same wall-clock window, the same HH:MM:SS ticks.
"use strict";

const COLORS = ["#4cc2ff", "#f7b955", "#7ee787", "#ff7b72", "#d2a8ff", "#56d4dd", "#ffa657", "#e6edf3"];
const DASHES = ["", "7 4", "2 3", "10 3 2 3", "1 5", "14 5"];
const POLL_MS = 2000;
const MIN_SPAN_S = 60;  // a few samples are drawn over a minute, not stretched over the whole width
const TIME_STEPS_S = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200];
const HEIGHT = 190;
const PAD = { left: 54, right: 30, top: 10, bottom: 22 };
const SVG = "http://www.w3.org/2000/svg";

function node(name, attrs, text) {
  const e = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}

const two = (n) => String(n).padStart(2, "0");
const clock = (t) => {
  const d = new Date(t * 1000);
  return `${two(d.getHours())}:${two(d.getMinutes())}:${two(d.getSeconds())}`;
};

// Axis labels: as many decimals as the step needs, so that ticks read evenly.
const decimals = (step) => Math.max(0, Math.min(3, -Math.floor(Math.log10(step) + 1e-9)));
const UNITS = {
  pct: { tick: (v) => `${Math.round(v * 100)}%`, value: (v) => `${(v * 100).toFixed(1)}%`, fixedMax: 1 },
  ms: {
    tick: (v, step) => `${(v * 1000).toFixed(decimals(step * 1000))} ms`,
    value: (v) => `${(v * 1000).toFixed(v < 0.01 ? 2 : 1)} ms`,
  },
  num: { tick: (v, step) => v.toFixed(decimals(step)), value: (v) => (v >= 100 ? v.toFixed(0) : v.toFixed(1)) },
  int: { tick: (v) => v.toFixed(0), value: (v) => v.toFixed(0), integer: true },
};

function niceStep(max, count, integer) {
  const raw = max / count;
  const magnitude = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * magnitude).find((s) => s >= raw - 1e-12);
  return integer ? Math.max(1, Math.ceil(step)) : step;
}

function yAxis(max, unit) {
  if (unit.fixedMax) return { top: unit.fixedMax, step: unit.fixedMax / 4 };
  if (unit.integer) max = Math.max(max, 4);  // counts: at least 0 to 4, in whole steps
  if (!(max > 0)) return { top: 1, step: 0.25 };
  const step = niceStep(max, 4, unit.integer);
  return { top: step * Math.max(1, Math.ceil(max / step - 1e-9)), step };
}

// The window every chart shows: from the first sample (or a minute before the last) to the last sample.
function timeWindow(data) {
  const s = data.samples;
  if (!s.length) return null;
  const t1 = s[s.length - 1].t;
  return [Math.min(s[0].t, t1 - MIN_SPAN_S), t1];
}

function timeTicks([t0, t1], plotWidth) {
  const most = Math.max(2, Math.floor(plotWidth / 75));
  const step = TIME_STEPS_S.find((s) => (t1 - t0) / s <= most) || TIME_STEPS_S[TIME_STEPS_S.length - 1];
  const ticks = [];
  for (let t = Math.ceil(t0 / step) * step; t <= t1 + 1e-9; t += step) ticks.push(t);
  return ticks;
}

function draw(id, lines, unit, range, interval, empty) {
  const figure = document.getElementById(id);
  const svg = figure.querySelector("svg.plot");
  const legend = figure.querySelector(".legend");
  const width = Math.max(200, Math.round(svg.getBoundingClientRect().width) || 400);
  svg.setAttribute("viewBox", `0 0 ${width} ${HEIGHT}`);
  svg.replaceChildren();
  legend.replaceChildren();

  const valid = (p) => p[1] !== null && p[1] !== undefined;
  const shown = lines.filter((l) => l.points.some(valid));  // a series with nothing in the window is left out
  const points = shown.flatMap((l) => l.points.filter(valid));
  figure.dataset.points = String(points.length);
  shown.forEach((l, i) => {
    const item = document.createElement("span");
    item.className = "series";
    const swatch = node("svg", { width: 22, height: 8, "aria-hidden": "true" });
    swatch.appendChild(node("line", { x1: 0, y1: 4, x2: 22, y2: 4, stroke: COLORS[i % COLORS.length],
      "stroke-width": 2.5, "stroke-dasharray": DASHES[i % DASHES.length] }));
    item.appendChild(swatch);
    const last = l.points.filter(valid).pop();
    item.appendChild(document.createTextNode(`${l.name}: ${unit.value(last[1])}`));
    legend.appendChild(item);
  });
  const missing = lines.filter((l) => !shown.includes(l)).map((l) => l.name);
  if (missing.length && empty) {
    const note = document.createElement("span");
    note.className = "empty";
    note.textContent = `${empty}: ${missing.join(", ")}`;
    legend.appendChild(note);
  }
  if (!range) {
    svg.appendChild(node("text", { x: PAD.left, y: HEIGHT / 2, class: "note" }, "no data yet"));
    return;
  }

  const [t0, t1] = range;
  const plotWidth = width - PAD.left - PAD.right;
  const X = (t) => PAD.left + ((t - t0) / (t1 - t0)) * plotWidth;
  const { top, step } = yAxis(Math.max(0, ...points.map((p) => p[1])), unit);
  const Y = (v) => HEIGHT - PAD.bottom - (v / top) * (HEIGHT - PAD.top - PAD.bottom);

  const grid = node("g", { class: "grid" });
  for (let k = 0; k * step <= top + 1e-9; k++) {
    const v = k * step;
    grid.appendChild(node("line", { x1: PAD.left, x2: width - PAD.right, y1: Y(v), y2: Y(v) }));
    svg.appendChild(node("text", { class: "tick-y", x: PAD.left - 6, y: Y(v) + 4, "data-v": v }, unit.tick(v, step)));
  }
  for (const t of timeTicks(range, plotWidth)) {
    grid.appendChild(node("line", { x1: X(t), x2: X(t), y1: PAD.top, y2: HEIGHT - PAD.bottom }));
    svg.appendChild(node("text", { class: "tick-x", x: X(t), y: HEIGHT - 6, "data-t": t }, clock(t)));
  }
  svg.insertBefore(grid, svg.firstChild);
  if (!points.length) {
    svg.appendChild(node("text", { x: PAD.left + 8, y: HEIGHT / 2, class: "note" }, "no data in this window"));
    return;
  }

  // Series with equal values (engines at zero) are nudged apart by a pixel or two, so none hides another.
  shown.forEach((l, i) => {
    const nudge = shown.length > 1 ? (i - (shown.length - 1) / 2) * 2.5 : 0;
    const color = COLORS[i % COLORS.length];
    const g = node("g", { transform: `translate(0 ${-nudge})`, "data-series": l.name });
    let d = "", previous = null, run = [];
    const runs = [];
    for (const p of l.points) {
      const gap = previous === null || !valid(p) || p[0] - previous[0] > 2.5 * interval;
      if (gap && run.length) { runs.push(run); run = []; }
      if (valid(p)) run.push(p);
      previous = valid(p) ? p : null;
    }
    if (run.length) runs.push(run);
    for (const r of runs) d += r.map((p, k) => `${k ? "L" : "M"}${X(p[0]).toFixed(1)} ${Y(p[1]).toFixed(1)}`).join("");
    g.appendChild(node("path", { d, fill: "none", stroke: color, "stroke-width": 2,
      "stroke-dasharray": DASHES[i % DASHES.length], "stroke-linejoin": "round" }));
    for (const r of runs) {  // a lone sample is a dot, not an invisible zero-length line
      if (r.length === 1) g.appendChild(node("circle", { cx: X(r[0][0]), cy: Y(r[0][1]), r: 3, fill: color }));
    }
    svg.appendChild(g);
  });
}

const series = (samples, pick) => samples.map((s) => [s.t, pick(s)]);
let latest = null;

function render(data) {
  latest = data;
  const s = data.samples;
  const w = timeWindow(data);
  const dt = data.interval_s;
  draw("chart-hit", data.regions.map((r) => ({ name: r, points: series(s, (x) => x.hit_ratio[r]) })),
    UNITS.pct, w, dt, "no requests served");
  draw("chart-ttft", [
    { name: "p50", points: series(s, (x) => x.ttft_p50_s) },
    { name: "p90", points: series(s, (x) => x.ttft_p90_s) },
  ], UNITS.ms, w, dt, "no streamed requests");
  draw("chart-itl", [{ name: "p50", points: series(s, (x) => x.itl_p50_s) }], UNITS.ms, w, dt, "no streamed requests");
  draw("chart-rps", [{ name: "requests/s", points: series(s, (x) => x.requests_per_s) }], UNITS.num, w, dt);
  draw("chart-load", data.engines.map((e) => ({ name: e.id, points: series(s, (x) => x.engine_load[e.id]) })),
    UNITS.int, w, dt, "not sampled");
  draw("chart-sessions", [{ name: "sessions", points: series(s, (x) => x.sessions) }], UNITS.int, w, dt);
  const last = s[s.length - 1];
  document.getElementById("status").textContent = last
    ? `${s.length} sample${s.length === 1 ? "" : "s"}, every ${data.interval_s} s; ` +
      `window ${clock(w[0])}–${clock(w[1])}, last at ${clock(last.t)}`
    : "waiting for the first sample…";
}

async function poll() {
  try {
    const response = await fetch("/dashboard/data", { cache: "no-store" });
    if (response.ok) render(await response.json());
  } catch (err) {
    document.getElementById("status").textContent = `cannot reach the gateway: ${err}`;
  }
  setTimeout(poll, POLL_MS);
}

window.addEventListener("resize", () => { if (latest) render(latest); });
poll();
