"""``kvgate serve --workers N`` as real processes: every worker routes on the same state, with Redis and
without it (the workers' private redis-server)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway.test_cli import KVGATE, _distinct_ports, _port_open
from tests.redis_prefixes import REDIS_URL, new_prefix

MODEL = "kvgate-sim"


def _post(port: int, prompt: str, session: str) -> tuple[str, str]:
    """(engine, route reason) of one completion, on a new connection (the kernel picks the worker)."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json", "x-session-affinity": session},
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        return r.headers["x-kvgate-engine"], r.headers["x-kvgate-route"]


def _routed(operator_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{operator_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(r"^kvgate_routing_decisions_total\{.*\} (\S+)$", text, re.M))


@pytest.fixture
def two_sim_engines() -> Iterator[list[int]]:
    ports = [_distinct_ports()[0] for _ in range(2)]
    while ports[0] == ports[1]:
        ports[1] = _distinct_ports()[0]
    engines = [
        subprocess.Popen(
            [sys.executable, "-m", "engine.sim", "--port", str(p), "--model", MODEL],
            stderr=subprocess.DEVNULL,
        )
        for p in ports
    ]
    yield ports
    for engine in engines:
        engine.kill()
        engine.wait()


@pytest.mark.parametrize("redis", [False, True], ids=["embedded", "redis"])
def test_the_next_turn_on_another_worker_follows_the_session(
    tmp_path: Path, two_sim_engines: list[int], redis: bool
) -> None:
    _, port, operator = _distinct_ports()
    engines = ", ".join(
        f'{{ name = "e{i}", url = "http://127.0.0.1:{p}" }}' for i, p in enumerate(two_sim_engines)
    )
    shared = f'redis_url = "{REDIS_URL}"\nredis_prefix = "{new_prefix()}"\n' if redis else ""
    config = tmp_path / "deploy.toml"
    config.write_text(
        f'region = "r"\n[[regions]]\nname = "r"\nengines = [{engines}]\n'
        f'[gateway]\nport = {port}\nspool_path = "{tmp_path / "spool"}"\noperator_port = {operator}\n'
        f'{shared}[gateway.routing]\npolicy = "session"\n'
    )
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as log_file:
        gateway = subprocess.Popen(
            [*KVGATE, "serve", "--config", str(config), "--workers", "2"], stderr=log_file
        )
    try:
        deadline = time.monotonic() + 60
        while not all(_port_open(p) for p in (port, operator, operator + 1)):
            assert gateway.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        for p in (operator, operator + 1):  # both workers see both engines healthy
            while _engines_healthy(p) != 2:  # (a 503 until the first probes are in)
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.1)
        for n in range(16):  # each turn on a new connection: about half the next turns reach the other worker
            session = f"conversation-{n}"
            engine, _ = _post(port, f"turn one of {session}", session)
            started = time.monotonic()
            assert _post(port, f"turn one of {session} and two", session) == (engine, "session"), n
            assert time.monotonic() - started < 5
        assert _routed(operator) > 0 and _routed(operator + 1) > 0  # both workers answered
        if redis:  # killed: its workers stop by themselves rather than hold the port
            gateway.kill()
            gateway.wait()
            deadline = time.monotonic() + 15
            while _port_open(port):
                assert time.monotonic() < deadline, "the workers outlived kvgate serve"
                time.sleep(0.1)
        else:  # stopped: the private redis-server is gone with the workers, its socket too
            assert _stopped(gateway, log_path) == 0, log_path.read_text()
            assert not list((tmp_path / f"workers-r-{port}").glob("*.sock"))
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()


def test_workers_without_redis_need_redis_server_installed(tmp_path: Path) -> None:
    config = tmp_path / "deploy.toml"
    config.write_text(
        f'region = "r"\n[[regions]]\nname = "r"\nengines = [{{ name = "e0", url = "http://h:1" }}]\n'
        f'[gateway]\nport = {_distinct_ports()[1]}\nspool_path = "{tmp_path / "spool"}"\n'
    )
    environ = {**os.environ, "PATH": str(tmp_path)}  # no redis-server on it
    result = subprocess.run(
        [*KVGATE, "serve", "--config", str(config), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=30,
        env=environ,
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "redis-server" in line and "--redis" in line and "Traceback" not in line


def test_a_response_made_on_one_worker_is_found_at_once_on_another(tmp_path: Path) -> None:
    """Each request on a new connection (the kernel picks the worker): retrieving or continuing a response
    at once found it on the other worker only once its binding had gone through the workers' Redis behind
    their write backlog (about half of them were 404s)."""
    ports = [_distinct_ports()[0] for _ in range(2)]
    while ports[0] == ports[1]:
        ports[1] = _distinct_ports()[0]
    engines = [
        subprocess.Popen([sys.executable, "-m", "tests.responses_engine", str(p), f"e{i}"])
        for i, p in enumerate(ports)
    ]
    _, port, operator = _distinct_ports()
    listed = ", ".join(
        f'{{ name = "e{i}", url = "http://127.0.0.1:{p}", kv_events = false }}' for i, p in enumerate(ports)
    )
    config = tmp_path / "deploy.toml"
    config.write_text(
        f'region = "r"\n[[regions]]\nname = "r"\nengines = [{listed}]\n'
        f'[gateway]\nport = {port}\nspool_path = "{tmp_path / "spool"}"\noperator_port = {operator}\n'
        '[gateway.routing]\npolicy = "least_load"\n'
    )
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as log_file:
        gateway = subprocess.Popen(
            [*KVGATE, "serve", "--config", str(config), "--workers", "2"], stderr=log_file
        )
    try:
        deadline = time.monotonic() + 60
        while not all(_port_open(p) for p in (port, operator, operator + 1)):
            assert gateway.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        for p in (operator, operator + 1):
            while _engines_healthy(p) != 2:
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.1)
        for n in range(16):
            made = _responses(port, "POST", "", {"model": MODEL, "input": f"question {n}"})
            assert _responses(port, "GET", "/" + made["id"])["id"] == made["id"], n
            body = {"model": MODEL, "input": "and then?", "previous_response_id": made["id"]}
            assert _responses(port, "POST", "", body)["previous_response_id"] == made["id"], n
        assert _routed(operator) > 0 and _routed(operator + 1) > 0  # both workers answered
    finally:
        _stopped(gateway, log_path)
        for engine in engines:
            engine.kill()
            engine.wait()


def _responses(port: int, method: str, path: str, body: object = None) -> dict[str, object]:
    """A /v1/responses request on a new connection; its answer (urllib raises for an error status)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/responses{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        answer: dict[str, object] = json.loads(r.read())
        return answer


def _engines_healthy(operator_port: int) -> int:
    """The engines a worker's /health counts healthy; it answers 503 while none is, with the same body."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{operator_port}/health", timeout=5) as r:
            body = r.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
    return int(json.loads(body).get("engines_healthy", 0))


def _scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """The public port's /metrics (a new connection: the kernel picks the worker), parsed as Prometheus
    does: sample name -> labels -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = tuple(sorted(s.labels.items()))
            assert key not in samples.get(s.name, {}), f"{s.name}{s.labels} twice"
            samples.setdefault(s.name, {})[key] = s.value
    return samples


def _completions_answered(samples: dict[str, dict[tuple[tuple[str, str], ...], float]]) -> float:
    return sum(
        value
        for labels, value in samples.get("kvgate_requests_total", {}).items()
        if ("endpoint", "/v1/completions") in labels and ("status", "200") in labels
    )


def test_the_public_metrics_of_workers_count_every_workers_requests(
    tmp_path: Path, two_sim_engines: list[int]
) -> None:
    """Without operator ports a scrape of the public port reaches either worker; each answers for both, so
    the counts neither split between scrapes nor go back, and an earlier run's counts are not added in."""
    _, port, _ = _distinct_ports()
    engines = ", ".join(
        f'{{ name = "e{i}", url = "http://127.0.0.1:{p}" }}' for i, p in enumerate(two_sim_engines)
    )
    config = tmp_path / "deploy.toml"
    config.write_text(
        f'region = "r"\n[[regions]]\nname = "r"\nengines = [{engines}]\n'
        f'[gateway]\nport = {port}\nspool_path = "{tmp_path / "spool"}"\n'
    )
    earlier = tmp_path / f"workers-r-{port}-metrics"  # (beside the spool, as the workers' Redis directory)
    earlier.mkdir()
    old = [{"name": "kvgate_requests", "type": "counter", "help": "h", "unit": "", "samples": [
        ["kvgate_requests_total", {"endpoint": "/v1/completions", "status": "200"}, 1000.0]]}]  # fmt: skip
    (earlier / "r-old-w0.metrics.json").write_text(json.dumps(old))
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as log_file:
        gateway = subprocess.Popen(
            [*KVGATE, "serve", "--config", str(config), "--workers", "2"], stderr=log_file
        )
    try:
        deadline = time.monotonic() + 60
        while not _port_open(port) or any(_engines_healthy(port) != 2 for _ in range(8)):
            assert gateway.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        seen, sent = 0.0, 0
        for n in range(24):  # interleaved: a scrape after each request, on either worker
            _post(port, f"prompt {n}", f"s{n}")
            sent += 1
            count = _completions_answered(_scrape(port))
            assert seen <= count <= sent, (n, seen, count)
            seen = count
        time.sleep(1.5)  # every worker has written its snapshot since its last request
        workers = set()
        for _ in range(8):
            samples = _scrape(port)
            assert _completions_answered(samples) == sent
            assert sum(samples["kvgate_request_duration_seconds_count"].values()) == sent  # (summed too)
            for labels in samples["kvgate_sessions"]:  # a gauge: each worker's own view, labelled
                workers.add(dict(labels)["worker"])
        assert len(workers) == 2, workers
    finally:
        _stopped(gateway, log_path)


def _stopped(gateway: subprocess.Popen[bytes], log_path: Path) -> int:
    """SIGTERM to kvgate serve, and its exit status once it stopped, with its log if it did not in 30 s."""
    gateway.terminate()
    try:
        return gateway.wait(30)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"kvgate serve did not stop in 30 s:\n{log_path.read_text()[-20000:]}") from None


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux's /proc: each thread's list of children)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(p) for p in (task / "children").read_text().split()]
    return found


def _two_workers_serving(
    tmp_path: Path, engine_port: int, more_config: str = ""
) -> tuple[subprocess.Popen[bytes], Path, int]:
    """``kvgate serve --workers 2`` in front of one engine, each worker with its operator port and serving
    (its SIGTERM handler is in place once it answers): the process, its log and the public port."""
    _, port, operator = _distinct_ports()
    config = tmp_path / "deploy.toml"
    config.write_text(
        f'region = "r"\n[[regions]]\nname = "r"\n'
        f'engines = [{{ name = "e0", url = "http://127.0.0.1:{engine_port}" }}]\n'
        f'[gateway]\nport = {port}\nspool_path = "{tmp_path / "spool"}"\noperator_port = {operator}\n'
        f'redis_url = "{REDIS_URL}"\nredis_prefix = "{new_prefix()}"\n{more_config}'
    )
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as log_file:
        gateway = subprocess.Popen(
            [*KVGATE, "--log-format", "text", "serve", "--config", str(config), "--workers", "2"],
            stderr=log_file,
        )
    try:
        deadline = time.monotonic() + 60
        while not all(_port_open(p) for p in (port, operator, operator + 1)):
            assert gateway.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        for p in (operator, operator + 1):
            while _engines_healthy(p) != 1:
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.1)
    except BaseException:
        gateway.kill()
        gateway.wait()
        raise
    return gateway, log_path, port


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the workers in /proc")
def test_a_worker_killed_stops_kvgate_serve_with_a_failure_that_names_it(
    tmp_path: Path, two_sim_engines: list[int]
) -> None:
    """A worker that dies (kill -9, the OOM killer) takes the others down, as documented; kvgate serve
    must then exit non-zero and say which worker died and how, so that a supervisor (systemd
    Restart=on-failure, a container's restart policy) restarts it. It used to exit 0 without a word."""
    gateway, log_path, port = _two_workers_serving(tmp_path, two_sim_engines[0])
    try:
        workers = _children(gateway.pid)
        assert len(workers) == 2, workers
        os.kill(workers[0], signal.SIGKILL)
        assert gateway.wait(60) != 0, log_path.read_text()
        assert not _port_open(port)  # the other worker stopped too
        log = log_path.read_text()
        assert f"(pid {workers[0]}) was killed by SIGKILL: stopping the other workers" in log, log
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the workers in /proc")
def test_a_worker_that_does_not_stop_is_killed_once_its_drain_is_over(
    tmp_path: Path, two_sim_engines: list[int]
) -> None:
    """A worker stuck for good (here stopped by SIGSTOP; in CI once, a task that never ended) held kvgate
    serve for ever after SIGTERM: a supervisor's stop ended only with its own SIGKILL, of everything. It is
    killed once its drain and the ledger's last write are over, named, and the exit status says so."""
    gateway, log_path, port = _two_workers_serving(
        tmp_path, two_sim_engines[0], "[gateway.resilience]\ndrain_timeout_s = 1\n"
    )
    stuck = 0
    try:
        stuck = _children(gateway.pid)[0]
        os.kill(stuck, signal.SIGSTOP)
        gateway.terminate()
        try:
            status = gateway.wait(60)  # (1 s of drain and 10 of margin)
        except subprocess.TimeoutExpired:
            raise AssertionError("kvgate serve waited on its stuck worker") from None
        assert status == 1
        assert not _port_open(port)
        log = log_path.read_text()
        assert f"(pid {stuck}) did not stop within 11 s of SIGTERM: killing it" in log, log
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()
        if stuck:  # (a stopped process ignores the SIGTERM its parent's death sends it)
            with contextlib.suppress(ProcessLookupError):
                os.kill(stuck, signal.SIGKILL)


@pytest.mark.parametrize("operator", [False, True], ids=["shared-metrics", "operator-port"])
@pytest.mark.parametrize("redis", [False, True], ids=["private-redis", "redis"])
def test_workers_with_a_spool_path_they_cannot_use_stop_in_one_line(
    tmp_path: Path, operator: bool, redis: bool
) -> None:
    """The workers keep their spools, their private Redis and their shared metrics beside gateway.spool_path:
    where no directory can be made (a file in the way, a read-only mount), kvgate serve says so once, naming
    the key, as a single gateway does. It used to be 'unexpected error: NotADirectoryError ... please report
    it', or one line per worker."""
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    _, port, operator_port = _distinct_ports()
    config = tmp_path / "deploy.toml"
    config.write_text(
        f'region = "r"\n[[regions]]\nname = "r"\nengines = [{{ name = "e0", url = "http://127.0.0.1:9" }}]\n'
        f'[gateway]\nport = {port}\nspool_path = "{in_the_way / "ledger.spool"}"\n'
        + (f"operator_port = {operator_port}\n" if operator else "")
        + (f'redis_url = "{REDIS_URL}"\nredis_prefix = "{new_prefix()}"\n' if redis else "")
    )
    line = _the_one_configuration_error(config, "gateway.spool_path")
    assert str(in_the_way) in line and "Traceback" not in line


def _the_one_configuration_error(config: Path, key: str) -> str:
    """``kvgate serve --workers 2`` on ``config`` exits 2 with one line, a configuration error naming ``key``:
    that line."""
    result = subprocess.run(
        [*KVGATE, "serve", "--config", str(config), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"kvgate: configuration error: {key}:"), line
    return line


@pytest.mark.parametrize(
    ("operator_port", "said"),
    [
        (-1, "would be the public port"),  # operator_port = port - 1: worker 1's is the public port
        (65535, "past 65535"),
    ],
    ids=["overlaps-the-public-port", "past-the-last-port"],
)
def test_workers_whose_operator_ports_cannot_all_be_opened_stop_in_one_line(
    tmp_path: Path, operator_port: int, said: str
) -> None:
    """Worker i listens for the operator on operator_port + i. With operator_port one below the public
    port, worker 1's operator port was the public port: it took it, and a worker then failed to open the
    public port with "another process (another kvgate?) listens there", stopping the service. Past 65535,
    a worker could not listen either. Both are configuration errors said once, before any worker starts."""
    _, port, _ = _distinct_ports()
    operator = port + operator_port if operator_port < 0 else operator_port
    config = tmp_path / "deploy.toml"
    config.write_text(
        f'region = "r"\n[[regions]]\nname = "r"\nengines = [{{ name = "e0", url = "http://127.0.0.1:9" }}]\n'
        f'[gateway]\nport = {port}\nspool_path = "{tmp_path / "ledger.spool"}"\n'
        f"operator_port = {operator}\n"
    )
    line = _the_one_configuration_error(config, "gateway.operator_port")
    assert said in line, line
    assert not _port_open(port)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the workers in /proc")
def test_workers_whose_journals_another_process_holds_stop_in_one_line_naming_it(
    tmp_path: Path, two_sim_engines: list[int]
) -> None:
    """A ``kvgate serve --workers 2`` started while the last one's workers still hold their journals (they
    drain on after it is killed; here they serve on): each worker said "another gateway process is using the
    usage journal ...", one line each, and the first one's end was logged as a dead worker."""
    first, log_path, _ = _two_workers_serving(tmp_path, two_sim_engines[0])
    try:
        config = (tmp_path / "deploy.toml").read_text()
        again = tmp_path / "again.toml"
        _, port, operator = _distinct_ports()
        again.write_text(
            re.sub(
                r"operator_port = \d+",
                f"operator_port = {operator}",
                re.sub(r"port = \d+", f"port = {port}", config),
            )
        )
        result = subprocess.run(
            [*KVGATE, "serve", "--config", str(again), "--workers", "2"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = result.stderr.rstrip("\n").split("\n")
        assert (result.returncode, len(lines)) == (2, 1), result.stderr
        holders = {f"process {pid} is using the usage journal" for pid in _children(first.pid)}
        assert any(holder in lines[0] for holder in holders), (lines[0], holders)
    finally:
        assert _stopped(first, log_path) == 0
