"""The ``sim-engine`` subcommand and ``python -m engine.sim`` (a real subprocess, stopped by SIGTERM)."""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from engine.cli import register
from engine.sim.cli import run_sim_engine

REPO_ROOT = Path(__file__).resolve().parents[2]


def kvgate_parser() -> argparse.ArgumentParser:
    """What the console script builds: a parser whose subcommands come from ``register`` functions."""
    parser = argparse.ArgumentParser(prog="kvgate")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def test_register_adds_sim_engine_with_defaults() -> None:
    args = kvgate_parser().parse_args(["sim-engine", "--port", "9000"])
    assert args.func is run_sim_engine
    assert (args.host, args.port, args.capacity_blocks, args.block_size) == ("127.0.0.1", 9000, 4096, 16)
    assert (args.model, args.engine_id, args.max_running) == ("kvgate-sim", None, 64)
    assert (args.prefill_s_per_token, args.decode_s_per_token) == (5e-5, 0.02)


def test_flags_are_parsed_and_checked() -> None:
    parser = kvgate_parser()
    args = parser.parse_args(
        ["sim-engine", "--port", "1", "--engine-id", "e7", "--decode-s-per-token", "0", "--max-running", "2"]
    )
    assert (args.engine_id, args.decode_s_per_token, args.max_running) == ("e7", 0.0, 2)
    for bad in (
        [],  # --port is required
        ["--port", "70000"],
        ["--port", "1", "--block-size", "0"],
        ["--port", "1", "--max-running", "0"],
        ["--port", "1", "--decode-s-per-token", "-1"],
        ["--port", "1", "--prefill-s-per-token", "nan"],
        ["--port", "1", "--decode-s-per-token", "inf"],  # every request would wait forever
        ["--port", "1", "--capacity-blocks", "-5"],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(["sim-engine", *bad])


def test_a_bad_profile_override_is_one_line_not_a_traceback() -> None:
    for override, reason in (("max_running=inf", "max_running must be a finite number"),
                             ("step_fixed_s=nan", "step_fixed_s must be a finite number")):  # fmt: skip
        args = kvgate_parser().parse_args(
            ["sim-engine", "--port", "1", "--profile", "llama3-8b-h100", "--profile-overrides", override]
        )
        with pytest.raises(SystemExit, match=f"kvgate sim-engine: EngineProfile.{reason}"):
            run_sim_engine(args)


def test_help_says_it_is_simulated(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        kvgate_parser().parse_args(["--help"])
    assert "SIMULATED" in capsys.readouterr().out


def test_python_m_engine_sim_serves_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine.sim",
            "--port",
            "0",
            "--decode-s-per-token",
            "0",
            "--capacity-blocks",
            "64",
        ],
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # the ready line names the port it bound
        match = re.search(r"SIMULATED.* on http://127\.0\.0\.1:(\d+)", line)
        assert match, line
        port = int(match.group(1))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            health = json.load(resp)
        assert health["simulated"] is True
        assert health["engine_id"] == f"sim-{port}"  # the default names the port actually bound
        assert health["load"]["kv_blocks_total"] == 64
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
