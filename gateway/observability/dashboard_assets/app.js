// kvgate dashboard: polls /dashboard/data and draws line charts on canvases (no libraries, no CDN).
"use strict";

const COLORS = ["#4cc2ff", "#f7b955", "#7ee787", "#ff7b72", "#d2a8ff", "#79c0ff", "#ffa657", "#56d4dd"];
const POLL_MS = 2000;

function series(samples, pick) {
  return samples.map((s) => [s.t, pick(s)]);
}

function draw(id, lines, format) {
  const figure = document.getElementById(id);
  const canvas = figure.querySelector("canvas");
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 400, height = canvas.clientHeight || 190;
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  ctx.clearRect(0, 0, width, height);

  const points = lines.flatMap((l) => l.points.filter((p) => p[1] !== null && p[1] !== undefined));
  figure.dataset.points = String(points.length);
  const legend = figure.querySelector(".legend");
  legend.innerHTML = "";
  lines.forEach((l, i) => {
    const span = document.createElement("span");
    span.style.setProperty("--c", COLORS[i % COLORS.length]);
    const last = [...l.points].reverse().find((p) => p[1] !== null && p[1] !== undefined);
    span.textContent = `${l.name}: ${last ? format(last[1]) : "–"}`;
    legend.appendChild(span);
  });
  if (!points.length) {
    ctx.fillStyle = "#8b98a5";
    ctx.fillText("no data yet", 12, height / 2);
    return;
  }
  const pad = { left: 46, right: 8, top: 8, bottom: 18 };
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  const y1 = format === pct ? 1 : Math.max(...ys) * 1.1 || 1;  // a ratio's axis ends at 100 %
  const X = (x) => pad.left + ((x - x0) / (x1 - x0)) * (width - pad.left - pad.right);
  const Y = (y) => height - pad.bottom - (y / y1) * (height - pad.top - pad.bottom);

  ctx.strokeStyle = "#263241";
  ctx.fillStyle = "#8b98a5";
  ctx.font = "11px system-ui, sans-serif";
  for (let i = 0; i <= 4; i++) {
    const y = (y1 * i) / 4;
    ctx.beginPath();
    ctx.moveTo(pad.left, Y(y));
    ctx.lineTo(width - pad.right, Y(y));
    ctx.stroke();
    ctx.fillText(format(y), 2, Y(y) + 4);
  }
  lines.forEach((l, i) => {
    ctx.strokeStyle = COLORS[i % COLORS.length];
    ctx.lineWidth = 2;
    ctx.beginPath();
    let drawing = false;
    for (const [x, y] of l.points) {
      if (y === null || y === undefined) { drawing = false; continue; }
      if (drawing) ctx.lineTo(X(x), Y(y)); else ctx.moveTo(X(x), Y(y));
      drawing = true;
    }
    ctx.stroke();
    ctx.fillStyle = COLORS[i % COLORS.length];
    for (const [x, y] of l.points) {  // markers: a single sample is visible too
      if (y === null || y === undefined) continue;
      ctx.beginPath();
      ctx.arc(X(x), Y(y), 2.5, 0, 2 * Math.PI);
      ctx.fill();
    }
  });
}

const pct = (v) => `${(v * 100).toFixed(1)}%`;
const ms = (v) => `${(v * 1000).toFixed(v < 0.01 ? 2 : 0)} ms`;
const num = (v) => (v >= 100 ? v.toFixed(0) : v.toFixed(1));

function render(data) {
  const s = data.samples;
  draw("chart-hit", data.regions.map((r) => ({ name: r, points: series(s, (x) => x.hit_ratio[r]) })), pct);
  draw("chart-ttft", [
    { name: "p50", points: series(s, (x) => x.ttft_p50_s) },
    { name: "p90", points: series(s, (x) => x.ttft_p90_s) },
  ], ms);
  draw("chart-itl", [{ name: "p50", points: series(s, (x) => x.itl_p50_s) }], ms);
  draw("chart-rps", [{ name: "requests/s", points: series(s, (x) => x.requests_per_s) }], num);
  draw("chart-load", data.engines.map((e) => ({ name: e.id, points: series(s, (x) => x.engine_load[e.id]) })), num);
  draw("chart-sessions", [{ name: "sessions", points: series(s, (x) => x.sessions) }], num);
  const last = s[s.length - 1];
  document.getElementById("status").textContent = last
    ? `${s.length} sample${s.length === 1 ? "" : "s"}, every ${data.interval_s} s; last at ${new Date(last.t * 1000).toLocaleTimeString()}`
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

poll();
