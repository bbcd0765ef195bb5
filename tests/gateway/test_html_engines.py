"""An engine URL that answers a web page (a proxy's default site, the wrong service behind the address) as a
real ``kvgate serve`` sees it: it is unhealthy in ``/health`` and ``/metrics``, and a stream sent there is
not billed and not started towards the client."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gateway.demo import free_port
from tests.gateway.test_cli_errors import KVGATE, _read_until

PAGE = b"<html><body><h1>Welcome to nginx!</h1></body></html>"


class _WebPage(BaseHTTPRequestHandler):
    """200 and the same HTML page for every GET and POST, as a web server's default site answers."""

    def _page(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    do_GET = do_POST = _page

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def web_page() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _WebPage)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _serve(tmp_path: Path, engine: str) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    config = tmp_path / "deploy.toml"
    config.write_text(
        f'region = "r"\n[[regions]]\nname = "r"\nengines = [{engine}]\n'
        f'[gateway]\nport = {port}\nspool_path = "{tmp_path / "spool"}"\n'
    )
    gateway = subprocess.Popen(
        [*KVGATE, "--log-format", "text", "serve", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return gateway, port


def _stop(gateway: subprocess.Popen[str]) -> None:
    if gateway.poll() is None:
        gateway.send_signal(signal.SIGTERM)
        try:
            gateway.wait(30)
        except subprocess.TimeoutExpired:
            gateway.kill()
            gateway.wait()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_an_engine_that_answers_a_web_page_is_unhealthy_in_health_and_metrics(
    tmp_path: Path, web_page: str
) -> None:
    """Its /health (200, HTML: no kvgate fields, so its model is asked of /v1/models, HTML too) made each
    poll count it alive and then failed once, short of ``unhealthy_after``: /health said "ok" (200) and
    kvgate_engine_healthy 1 for an engine nothing could be routed to, while the log said it was unhealthy."""
    gateway, port = _serve(tmp_path, f'{{ name = "e0", url = "{web_page}" }}')
    try:
        log = _read_until(gateway, "listening on")
        assert "engine r/e0 is unhealthy since the gateway started" in log
        status, body = _get(f"http://127.0.0.1:{port}/health")
        health = json.loads(body)
        engine = health["engines"][0]
        assert "/v1/models" in engine["last_error"]  # (its first probe is done)
        assert (status, health["status"], engine["healthy"]) == (503, "no_healthy_engine", False)
        _, metrics = _get(f"http://127.0.0.1:{port}/metrics")
        assert 'kvgate_engine_healthy{engine="r/e0",region="r"} 0.0' in metrics
    finally:
        _stop(gateway)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_answered_with_a_web_page_is_a_502_and_is_not_billed(
    tmp_path: Path, web_page: str, stream: bool
) -> None:
    """With its model written in the deployment file, the engine is routed to. A whole answer was already a
    502 before anything reached the client, unbilled; a stream was started towards the client at the page's
    first byte: a 200 whose only event was an error, billed as a failed request of its prompt."""
    gateway, port = _serve(tmp_path, f'{{ name = "e0", url = "{web_page}", model = "kvgate-sim" }}')
    try:
        _read_until(gateway, "listening on")
        body = {"model": "kvgate-sim", "prompt": "hello there", "max_tokens": 4, "stream": stream}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                answered: tuple[int, str] = (r.status, r.read().decode())
        except urllib.error.HTTPError as exc:
            answered = (exc.code, exc.read().decode())
        assert answered[0] == 502, answered
        said = "answered the stream with a web page (text/html)" if stream else "no JSON object"
        assert said in answered[1], answered
        status, usage = _get(f"http://127.0.0.1:{port}/v1/usage")
        assert status == 200
        assert json.loads(usage)["total"]["requests"] == 0
    finally:
        _stop(gateway)
