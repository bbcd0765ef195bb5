"""The dashboard: its sampler, its routes, and the page itself rendered by headless Chromium over a demo."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gateway.demo import free_port
from gateway.observability.dashboard import DashboardSampler
from region_map.config import TopologyConfig
from region_map.fleet import Fleet
from tests.harness import MODEL, ClusterFactory

ARTIFACTS = Path(
    os.environ.get("KVGATE_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts")
)
CHARTS = ("chart-hit", "chart-ttft", "chart-itl", "chart-rps", "chart-load", "chart-sessions")


def test_a_window_becomes_one_sample() -> None:
    topology = TopologyConfig.model_validate(
        {"region": "eu", "regions": [{"name": "eu", "engines": [{"name": "e0", "url": "http://h:1"}]},
                                     {"name": "us", "engines": [{"name": "e0", "url": "http://h:2"}]}]}
    )  # fmt: skip
    now = [100.0]
    sampler = DashboardSampler(Fleet(topology), lambda: 7, interval_s=2.0, clock=lambda: now[0])
    for i in range(10):
        sampler.observe("eu", 100, 80, 0.01 * (i + 1), 0.02)
    sampler.observe("us", 100, 0, None, None)
    now[0] = 102.0
    s = sampler.sample_now()
    assert s["requests_per_s"] == pytest.approx(11 / 2.0)
    assert s["hit_ratio"] == {"eu": 0.8, "us": 0.0}
    assert s["ttft_p50_s"] == pytest.approx(0.06) and s["ttft_p90_s"] == pytest.approx(0.1)
    assert s["itl_p50_s"] == pytest.approx(0.02) and s["sessions"] == 7
    assert set(s["engine_load"]) == {"eu/e0", "us/e0"}
    now[0] = 104.0
    empty = sampler.sample_now()  # a quiet window: no traffic, no made-up figures
    assert empty["requests_per_s"] == 0 and empty["hit_ratio"] == {} and empty["ttft_p50_s"] is None
    assert len(sampler.data()["samples"]) == 2


async def test_the_dashboard_is_served_from_the_package(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 2}, dashboard_interval_s=0.1)
    assert cluster.session is not None
    for i in range(4):
        messages = [{"role": "user", "content": f"hi {i}" * 30}]
        await cluster.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 3, "messages": messages})
    async with cluster.session.get(cluster.url + "/dashboard") as r:
        page = await r.text()
        assert r.status == 200 and r.content_type == "text/html"
        # Its own script and style only, framed by no other site (the browser test below runs it so).
        policy = r.headers["Content-Security-Policy"]
        assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
        assert "unsafe-inline" not in policy and r.headers["X-Frame-Options"] == "DENY"
        assert r.headers["X-Content-Type-Options"] == "nosniff"
    scripts = re.findall(r'src="([^"]+)"', page) + re.findall(r'href="([^"]+)"', page)
    assert scripts and all(s.startswith("/dashboard/assets/") for s in scripts)  # nothing from a CDN
    for src in scripts:
        async with cluster.session.get(cluster.url + src) as r:
            assert r.status == 200 and len(await r.read()) > 500
            assert r.headers["X-Content-Type-Options"] == "nosniff"
    deadline = time.monotonic() + 5
    while True:
        async with cluster.session.get(cluster.url + "/dashboard/data") as r:
            data = await r.json()
            assert r.headers["Cache-Control"] == "no-store"  # (live data: a proxy must not keep it)
        if any(s["requests_per_s"] > 0 for s in data["samples"]) or time.monotonic() > deadline:
            break
    busy = [s for s in data["samples"] if s["requests_per_s"] > 0]
    assert busy and busy[0]["ttft_p50_s"] is None  # non-streaming answers have no first token time
    assert data["regions"] == ["eu-west"] and len(data["engines"]) == 2
    async with cluster.session.get(cluster.url + "/dashboard/assets/nope.js") as r:
        assert r.status == 404


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(
    _chromium() is None, reason="no Chromium on this machine (scripts/test installs Debian's)"
)
def test_the_dashboard_shows_live_data_in_a_browser(tmp_path: Path) -> None:
    browser = _chromium()
    assert browser is not None
    port = free_port()
    demo = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "demo", "--simulated", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_for(base + "/health")
        with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
            model = json.loads(r.read())["data"][0]["id"]
        for turn in range(3):  # conversations over several sampling windows: later turns hit the cache
            time.sleep(1.0 if turn else 0.0)
            for conversation in range(4):
                messages = [
                    {"role": "system", "content": "be brief " * 60},
                    {"role": "user", "content": f"conversation {conversation} turn {turn}"},
                ]
                body = {"model": model, "messages": messages, "max_tokens": 8, "stream": True}
                request = urllib.request.Request(
                    base + "/v1/chat/completions",
                    data=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json", "x-session-affinity": f"c{conversation}"},
                )
                with urllib.request.urlopen(request, timeout=10) as r:
                    assert r.status == 200 and r.read().endswith(b"data: [DONE]\n\n")
        deadline = time.monotonic() + 10
        while _samples_with_traffic(base) < 2 and time.monotonic() < deadline:
            time.sleep(0.3)
        flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=6000"]  # fmt: skip
        dom = subprocess.run(
            [*flags, "--dump-dom", base + "/dashboard"], capture_output=True, text=True, timeout=60
        )
        points = {
            chart: int(match.group(1))
            for chart in CHARTS
            if (match := re.search(rf'id="{chart}"[^>]*data-points="(\d+)"', dom.stdout))
        }
        assert set(points) == set(CHARTS), dom.stdout[:2000]
        assert all(n > 0 for n in points.values()), points  # every chart has data on it
        assert "samples, every" in dom.stdout and all(n >= 2 for n in points.values())
        axes = {chart: _axes(dom.stdout, chart) for chart in CHARTS}
        for chart, (times, values, legend) in axes.items():
            labels = [label for _, _, label in times]
            assert len(times) >= 2 and all(re.fullmatch(r"\d\d:\d\d:\d\d", x) for x in labels), (chart, times)
            assert _even([t for t, _, _ in times]) and _even([x for _, x, _ in times]), (chart, times)
            assert len(values) >= 3 and _even(values) and values[0] == 0, (chart, values)
            assert "–" not in legend, (chart, legend)  # a series without data is named as such, or left out
        first = next(iter(axes.values()))[0]
        assert all(times == first for times, _, _ in axes.values())  # one time axis shared by every chart
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        subprocess.run([*flags, "--window-size=1400,1000", f"--screenshot={shot}", base + "/dashboard"],
                       capture_output=True, timeout=60, check=True)  # fmt: skip
        assert shot.stat().st_size > 10_000
    finally:
        demo.send_signal(signal.SIGINT)
        try:
            demo.wait(30)
        except subprocess.TimeoutExpired:
            demo.kill()


def _axes(dom: str, chart: str) -> tuple[list[tuple[float, float, str]], list[float], str]:
    """A chart's time ticks (time, x, label), its value ticks, and its legend's text, from the page's DOM."""
    figure = re.search(rf'id="{chart}".*?</figure>', dom, re.S)
    assert figure is not None, chart
    html = figure.group(0)
    times = [
        (float(t), float(x), label)
        for x, t, label in re.findall(
            r'<text class="tick-x" x="([\d.]+)"[^>]*data-t="([\d.]+)">([^<]*)</text>', html
        )
    ]
    values = [float(v) for v in re.findall(r'<text class="tick-y"[^>]*data-v="([\d.e-]+)"', html)]
    legend = re.search(r'class="legend">(.*?)</div>', html, re.S)
    return times, values, re.sub(r"<[^>]+>", " ", legend.group(1)) if legend else ""


def _even(xs: list[float]) -> bool:
    steps = [b - a for a, b in itertools.pairwise(xs)]
    return bool(steps) and all(s > 0 and abs(s - steps[0]) < 0.05 for s in steps)


def _wait_for(url: str, within_s: float = 60) -> None:
    deadline = time.monotonic() + within_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _samples_with_traffic(base: str) -> int:
    with urllib.request.urlopen(base + "/dashboard/data", timeout=5) as r:
        samples = json.loads(r.read())["samples"]
    return sum(1 for s in samples if s["requests_per_s"] > 0 and s["ttft_p50_s"] is not None)
