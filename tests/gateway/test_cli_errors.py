"""What a user can get wrong with the kvgate command is said in one line, naming the cause and the fix, with a
non-zero exit status and no traceback (unless ``kvgate --debug``); what a gateway starts without (an engine
that does not answer, Redis away) is logged and reported, and the gateway serves anyway."""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import redis

from gateway.demo import free_port
from region_map.config import ConfigError
from region_map.simulation.trace import TraceError, load_trace
from tests.redis_process import RedisProcess

KVGATE = [sys.executable, "-m", "gateway.cli"]
UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"


def run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVGATE, *args], capture_output=True, text=True, timeout=timeout)


def said_in_one_line(result: subprocess.CompletedProcess[str], *words: str) -> str:
    """The one line of stderr (a blank one after it is allowed), which must hold every word."""
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr
    lines = result.stderr.rstrip("\n").split("\n")
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.fixture(params=["plain", "reuse_port"])
def busy_port(request: pytest.FixtureRequest) -> Iterator[int]:
    """A port someone else listens on; with SO_REUSEPORT, as another ``kvgate serve --workers N`` does
    (whose workers a second one's would otherwise silently join)."""
    with socket.socket() as s:
        if request.param == "reuse_port":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def deployment(tmp_path: Path, port: int, *, engine_url: str, extra: str = "") -> Path:
    config = tmp_path / "deploy.toml"
    config.write_text(
        f'region = "r"\n[[regions]]\nname = "r"\nengines = [{{ name = "e0", url = "{engine_url}" }}]\n'
        f'[gateway]\nport = {port}\nspool_path = "{tmp_path / "spool"}"\n{extra}'
    )
    return config


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_on_a_busy_port(tmp_path: Path, busy_port: int, workers: str) -> None:
    config = deployment(tmp_path, busy_port, engine_url="http://127.0.0.1:9")
    result = run("serve", "--config", str(config), "--workers", workers)
    said_in_one_line(result, f"cannot listen on 127.0.0.1:{busy_port}", "already in use", "--port")
    assert result.returncode == 1


def test_debug_shows_the_traceback(tmp_path: Path, busy_port: int) -> None:
    config = deployment(tmp_path, busy_port, engine_url="http://127.0.0.1:9")
    for args in (("--debug", "serve"), ("serve", "--debug")):  # before or after the command
        result = run(*args, "--config", str(config))
        assert result.returncode == 1
        assert "Traceback" in result.stderr and "OSError" in result.stderr
        assert result.stderr.rstrip().splitlines()[-1].startswith("kvgate serve: cannot listen on")


def test_demo_on_a_busy_port(busy_port: int) -> None:
    started = time.monotonic()
    result = run("demo", "--simulated", "--port", str(busy_port))
    said_in_one_line(result, f"127.0.0.1:{busy_port}", "already in use", "--port")
    assert time.monotonic() - started < 10  # said before any engine started


def test_demo_with_a_model_directory_that_is_not_there() -> None:
    result = run("demo", "--model", "/nonexistent", "--port", str(free_port()))
    said_in_one_line(result, "--model /nonexistent: no such directory", "Hugging Face layout")
    assert result.returncode == 2


def test_engine_with_a_model_directory_that_is_not_there() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "engine", "engine", "--model", "/nonexistent", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    said_in_one_line(result, "--model /nonexistent: no such directory", "make-model")
    assert result.returncode == 2


def test_usage_with_redis_away() -> None:
    result = run("usage", "--redis", "redis://:secret@127.0.0.1:1/0")
    line = said_in_one_line(result, f"cannot reach Redis at {UNREACHABLE_REDIS}", "start Redis", "--redis")
    assert "secret" not in line


def test_keys_with_redis_away() -> None:
    said_in_one_line(run("keys", "list", "--redis", UNREACHABLE_REDIS), "cannot reach Redis", "start Redis")


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("http://127.0.0.1:1/0", "is not a Redis URL: redis://"),
        ("redis://127.0.0.1:1/O", "the database 'O' is not a number"),  # (the letter O: else database 0)
        ("unix:///run/redis.sock?db=x", "the database 'x' is not a number"),
        ("redis://127.0.0.1:63 79/0", "the port is not a number"),
    ],
)
@pytest.mark.parametrize("command", ["serve", "usage"])
def test_a_malformed_redis_url_is_a_configuration_error(
    tmp_path: Path, command: str, url: str, said: str
) -> None:
    config = deployment(tmp_path, free_port(), engine_url="http://127.0.0.1:9")
    result = run(command, "--config", str(config), "--redis", url)
    said_in_one_line(result, "configuration error", "--redis" if command == "usage" else "redis_url", said)
    assert result.returncode == 2


@pytest.mark.parametrize(
    ("credentials", "db", "said"),
    [
        (":wrong@", "0", "invalid username-password pair"),
        ("", "0", "authenticated"),  # no password given
        (":s3cret@", "99", "DB index is out of range"),
    ],
)
def test_serve_with_a_redis_that_refuses_its_url_stops_in_one_line(
    tmp_path: Path, private_redis: RedisProcess, credentials: str, db: str, said: str
) -> None:
    """Redis answers and says no (a wrong password, a database it does not have): no waiting fixes that, so
    the gateway does not start (a Redis that is away is waited for: above)."""
    redis.Redis(port=private_redis.port).config_set("requirepass", "s3cret")
    url = f"redis://{credentials}127.0.0.1:{private_redis.port}/{db}"
    config = deployment(tmp_path, free_port(), engine_url="http://127.0.0.1:9")
    result = run("serve", "--config", str(config), "--redis", url)
    line = said_in_one_line(result, "configuration error", f"Redis at redis://127.0.0.1:{private_redis.port}")
    assert said in line and "wrong" not in line and "s3cret" not in line
    assert result.returncode == 2


class _Refusing(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"error": {"message": "invalid API key", "type": "authentication_error"}}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def refusing_gateway() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_usage_with_a_refused_key(refusing_gateway: str) -> None:
    result = run("usage", "--url", refusing_gateway, "--key", "kvg-wrong")
    line = said_in_one_line(result, "refused the key: 401", "invalid API key", "kvgate keys create")
    assert "configuration error" not in line
    result = subprocess.run(
        [*KVGATE, "usage", "--url", refusing_gateway],
        capture_output=True,
        text=True,
        timeout=30,
        env={k: v for k, v in os.environ.items() if k != "KVGATE_API_KEY"},
    )
    said_in_one_line(result, "401", "--key or KVGATE_API_KEY")


def test_usage_with_no_gateway_there() -> None:
    said_in_one_line(
        run("usage", "--url", f"http://127.0.0.1:{free_port()}"), "cannot reach a gateway", "--url"
    )


def test_simulate_help_shows_the_defaults() -> None:
    result = run("simulate", "--help")
    assert result.returncode == 0
    assert "(default: 8)" in result.stdout and "(default: 85000.0)" in result.stdout


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--regions", "0"), "--regions 0: must be a whole number of at least 1"),
        (("--engines-per-region", "-2"), "--engines-per-region -2: must be a whole number of at least 1"),
        (("--capacity-blocks", "0"), "--capacity-blocks 0: must be a whole number of at least 1"),
        (("--limit", "0"), "--limit 0: must be a whole number of at least 1"),
        (("--prefill-tokens-per-s", "0"), "--prefill-tokens-per-s 0.0: must be a finite number above 0"),
        (("--prefill-tokens-per-s", "nan"), "--prefill-tokens-per-s nan: must be a finite number above 0"),
        (("--decode-s-per-token", "-1"), "--decode-s-per-token -1.0: must be a finite number of at least 0"),
        (("--rtt-ms", "-5"), "--rtt-ms -5.0: must be a finite number of at least 0"),
        (
            ("--kv-pull-tokens-per-s", "inf"),
            "--kv-pull-tokens-per-s inf: must be a finite number of at least 0",
        ),
        (("--max-remote-share", "2"), "--max-remote-share 2.0: must lie in [0, 1]"),
    ],
)
def test_simulate_numbers_out_of_range_are_said_with_their_flag(
    tmp_path: Path, args: tuple[str, ...], said: str
) -> None:
    """Each was taken: a prefill rate of 0 was 'unexpected error: ZeroDivisionError ... please report it',
    a negative --rtt-ms a pydantic report of several lines, --max-remote-share 2 named the router's internal
    max_share, and a negative decode time, pull rate or --limit ran and printed figures. (Checked in this
    process, the command's own line once below: a process each costs seconds.)"""
    from gateway.cli import _simulate, build_parser

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n')
    with pytest.raises(ConfigError) as refused:
        _simulate(build_parser().parse_args(["simulate", "--trace", str(trace), *args]))
    assert str(refused.value) == said


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("", "t.jsonl holds no request"),
        ("\n\n", "t.jsonl holds no request"),
        ('{"timestamp": 0, "input_length": -10, "output_length": 5, "hash_ids": [1]}\n', "t.jsonl:1"),
        ('{"timestamp": 0, "input_length": 10, "output_length": -5, "hash_ids": [1]}\n', "t.jsonl:1"),
    ],
)
def test_simulate_refuses_a_trace_with_nothing_to_replay(tmp_path: Path, text: str, said: str) -> None:
    """An empty trace printed TTFT 0.000 s and load max/mean 0.00, and negative token counts were replayed."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(text)
    with pytest.raises(TraceError, match=re.escape(said)):
        load_trace(trace)


def test_simulate_says_a_number_or_a_trace_it_refuses_in_one_line(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n")
    said_in_one_line(run("simulate", "--trace", str(trace)), "kvgate simulate:", "t.jsonl holds no request")
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n')
    result = run("simulate", "--trace", str(trace), "--prefill-tokens-per-s", "0")
    said_in_one_line(
        result, "configuration error", "--prefill-tokens-per-s 0.0: must be a finite number above 0"
    )
    assert result.returncode == 2


def _read_until(process: subprocess.Popen[str], text: str, timeout: float = 20) -> str:
    """stderr of ``process`` up to and including the line holding ``text``. Read a byte at a time from the
    pipe itself: the text wrapper's readline reads ahead, and lines it buffered are never signalled again
    by ``select``, so a line written together with the one before it (a busy machine reads late) was
    waited for until the timeout. Nothing is read past that line: a later read of ``process.stderr`` starts
    there."""
    assert process.stderr is not None
    fd = process.stderr.fileno()
    selector = selectors.DefaultSelector()
    selector.register(fd, selectors.EVENT_READ)
    read, line = "", b""
    deadline = time.monotonic() + timeout
    while text not in read:
        assert time.monotonic() < deadline, f"no {text!r} in:\n{read}{line.decode(errors='replace')}"
        assert process.poll() is None, f"it exited ({process.returncode}):\n{read}"
        if selector.select(timeout=0.5):
            byte = os.read(fd, 1)
            line += byte
            if byte == b"\n":
                read, line = read + line.decode(), b""
    selector.close()
    return read


def test_read_until_sees_a_line_written_with_the_one_before() -> None:
    """The helper's own defect: two lines in one write, then silence (as a gateway logs its start)."""
    child = "import sys, time; sys.stderr.write('first\\nlistening on x\\n'); sys.stderr.flush(); "
    child += "time.sleep(9)"
    process = subprocess.Popen([sys.executable, "-c", child], stderr=subprocess.PIPE, text=True)
    try:
        assert _read_until(process, "listening on", timeout=10) == "first\nlistening on x\n"
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize("operator", [False, True])
def test_serve_starts_without_its_engine_and_redis_and_says_so(tmp_path: Path, operator: bool) -> None:
    """An engine down since start is logged with its reason (no transition would say it), Redis away is
    logged and reported by /health, and the log says where the gateway and its dashboard listen."""
    port, engine_port, operator_port = free_port(), free_port(), free_port()
    extra = f'redis_url = "{UNREACHABLE_REDIS}"\n' + (
        f"operator_port = {operator_port}\n" if operator else ""
    )
    config = deployment(tmp_path, port, engine_url=f"http://127.0.0.1:{engine_port}", extra=extra)
    gateway = subprocess.Popen(
        [*KVGATE, "--log-format", "text", "serve", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        log = _read_until(gateway, "listening on")
        assert "engine r/e0 is unhealthy since the gateway started: Cannot connect to host" in log
        assert f"WARNING kvgate.app: redis unreachable at {UNREACHABLE_REDIS}: Error 111" in log
        assert f"engines healthy, redis unreachable at {UNREACHABLE_REDIS}\n" in log  # (the startup line)
        dashboard = f"http://127.0.0.1:{operator_port if operator else port}/dashboard"
        assert f"listening on http://127.0.0.1:{port}; dashboard: {dashboard}" in log
        try:
            urllib.request.urlopen(
                f"http://127.0.0.1:{operator_port if operator else port}/health", timeout=5
            )
            raise AssertionError("a gateway without a healthy engine answered 200")
        except urllib.error.HTTPError as exc:  # 503: no healthy engine
            assert exc.code == 503
            health = json.loads(exc.read())
        assert health["redis"] == "unreachable"
        assert "Cannot connect to host" in health["engines"][0]["last_error"]
        with urllib.request.urlopen(dashboard, timeout=5) as r:
            assert r.status == 200
        gateway.send_signal(signal.SIGINT)
        assert gateway.wait(30) == 0
        assert gateway.stderr is not None
        assert "Traceback" not in log + gateway.stderr.read()
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("KVGATE_WORKERS", "two", "KVGATE_WORKERS='two': not a whole number"),
        ("KVGATE_LOG_LEVEL", "Verbose", "KVGATE_LOG_LEVEL='verbose' is not one of debug, info, warning"),
        ("KVGATE_LOG_FORMAT", "xml", "KVGATE_LOG_FORMAT='xml' is not one of auto, json, text"),
    ],
)
def test_a_bad_environment_variable_is_named_in_one_line(
    tmp_path: Path, variable: str, value: str, said: str
) -> None:
    """The environment variables that stand for flags are checked as the flags are: a typo used to be a
    traceback (KVGATE_WORKERS, KVGATE_LOG_LEVEL: for every command, --help too) or silently ignored
    (KVGATE_LOG_FORMAT, which fell back to text)."""
    config = deployment(tmp_path, free_port(), engine_url="http://127.0.0.1:9")
    result = subprocess.run(
        [*KVGATE, "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, variable: value},
    )
    said_in_one_line(result, said)
    assert result.returncode == 2


@pytest.mark.parametrize(
    ("days", "said"),
    [
        (
            ("--start", "2026-13-01"),
            "--start: start must be a day (YYYY-MM-DD) or Unix seconds, not '2026-13-01'",
        ),
        (
            ("--start", "2026-12-05", "--end", "2026-11-01"),
            "--start: invalid range 2026-12-05 .. 2026-11-01: end is before start",
        ),
    ],
)
@pytest.mark.parametrize("source", ["redis", "url"])
def test_usage_with_days_it_cannot_read_is_an_argument_error(
    days: tuple[str, ...], said: str, source: str
) -> None:
    """A mistyped day is the operator's mistake, said as such before Redis or a gateway is asked (it used to
    be 'unexpected error: InvalidRequest ... please report it', status 1)."""
    where = (
        ["--redis", UNREACHABLE_REDIS] if source == "redis" else ["--url", f"http://127.0.0.1:{free_port()}"]
    )
    line = said_in_one_line(run("usage", *days, *where), "configuration error", said)
    assert "unexpected" not in line and "report it" not in line
    assert run("usage", *days, *where).returncode == 2


@pytest.mark.parametrize("regions", ["engines = []\n", '[[regions]]\nname = "s"\n'], ids=["empty", "omitted"])
def test_serve_with_no_engine_at_all_is_refused(tmp_path: Path, regions: str) -> None:
    """A deployment file whose regions list no engine (an empty list, the engines left out) cannot serve a
    single request, and the file is not re-read: kvgate serve used to start and answer 503 to everything."""
    config = tmp_path / "deploy.toml"
    config.write_text(f'region = "r"\n[[regions]]\nname = "r"\n{regions}[gateway]\nport = {free_port()}\n')
    result = run("serve", "--config", str(config), timeout=20)
    said_in_one_line(result, "configuration error", "regions", "no engine")
    assert result.returncode == 2


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--port", "70000"), "--port 70000: a port is 1 to 65535"),
        (("--port", "-5"), "--port -5: a port is 1 to 65535"),
        (("--port", "0"), "--port 0: a port is 1 to 65535"),
        (("--redis", "http://127.0.0.1:6379"), "--redis: 'http://127.0.0.1:6379' is not a Redis URL"),
        (("--redis-cluster",), "--redis-cluster: give --redis, the URL of one of the cluster's nodes"),
    ],
)
def test_demo_arguments_are_checked_before_any_engine_starts(args: tuple[str, ...], said: str) -> None:
    """A demo port out of range (or 0: the tour would print :0) or a --redis that is no Redis URL is said
    at once, as a busy port is: it used to start every engine first (their start-up lines, then the error),
    and --port -5 was 'Servname not supported for ai_socktype' with status 1."""
    started = time.monotonic()
    result = run("demo", "--simulated", "--regions", "1", "--engines-per-region", "1", *args)
    said_in_one_line(result, "configuration error", said)
    assert result.returncode == 2
    assert "engine" not in result.stdout + result.stderr
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("what", ["no-directory", "no-tokenizer-json", "broken-tokenizer-json"])
def test_serve_with_a_tokenizer_it_cannot_load_names_gateway_tokenizer(
    tmp_path: Path, what: str, workers: str
) -> None:
    """gateway.tokenizer naming a directory without a readable tokenizer.json is the operator's mistake: it
    was 'unexpected error: TokenizerError ... please report it', status 1."""
    model = tmp_path / "model"
    if what != "no-directory":
        model.mkdir()
    if what == "broken-tokenizer-json":
        (model / "tokenizer.json").write_text("{ not json")
    config = tmp_path / "deploy.toml"
    config.write_text(
        f'region = "r"\n[[regions]]\nname = "r"\nengines = [{{ name = "e0", url = "http://127.0.0.1:9" }}]\n'
        f'[gateway]\nport = {free_port()}\ntokenizer = "{model}"\nspool_path = "{tmp_path / "spool"}"\n'
    )
    result = run("serve", "--config", str(config), "--workers", workers, timeout=60)
    line = said_in_one_line(result, "configuration error", "gateway.tokenizer", str(model))
    assert "unexpected" not in line and "report it" not in line
    assert result.returncode == 2


@pytest.mark.parametrize(
    ("name", "content", "said"),
    [
        ("deploy.toml", 'region = "r"\n'.encode("utf-16"), "not UTF-8"),  # (a Windows editor's, with its BOM)
        ("deploy.toml", 'region = "r\xe9gion"\n'.encode("latin-1"), "not UTF-8"),
        ("deploy.yaml", b"region: r\nregions:\n  - name: r\n    engines: [{name: e0\n", "not valid yaml"),
    ],
    ids=["utf-16", "latin-1", "yaml"],
)
def test_a_deployment_file_that_cannot_be_parsed_is_named_in_one_line(
    tmp_path: Path, name: str, content: bytes, said: str
) -> None:
    """A deployment file saved in another encoding was an "unexpected error: UnicodeDecodeError ... please
    report it" (status 1), and a YAML syntax error took seven lines (PyYAML's marks with their carets)."""
    config = tmp_path / name
    config.write_bytes(content)
    result = run("serve", "--config", str(config), timeout=20)
    said_in_one_line(result, "configuration error", name, said)
    assert result.returncode == 2


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_more_workers_than_the_cpus_can_hold_is_refused_in_one_line(tmp_path: Path, how: str) -> None:
    """A mistyped --workers (one zero too many, a pasted number) built its worker processes until memory ran
    out, saying nothing: 99999999999999999999 never got to its first fork, a few thousand would have."""
    config = deployment(tmp_path, free_port(), engine_url="http://127.0.0.1:9")
    for workers in ("99999999999999999999", str(4 * len(os.sched_getaffinity(0)) + 1)):
        args = ["serve", "--config", str(config)]
        env = dict(os.environ)
        if how == "flag":
            args += ["--workers", workers]
        else:
            env["KVGATE_WORKERS"] = workers
        result = subprocess.run([*KVGATE, *args], capture_output=True, text=True, timeout=60, env=env)
        said_in_one_line(result, "configuration error", f"--workers {workers}", "per CPU", "choose at most")
        assert result.returncode == 2
