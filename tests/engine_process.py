"""``kvgate engine`` in a process of its own, for tests that talk to it as a client would (the OpenAI SDK)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def engine_process(
    model_dir: Path, *, kv_blocks: int, max_model_len: int, engine_core: str = "thread"
) -> Iterator[str]:
    """The engine on ``model_dir`` (CPU, 4-token blocks, its core on a thread unless ``engine_core`` is
    "process"), on a free port: its URL, once it says it is serving; stopped on exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    argv = [sys.executable, "-m", "engine", "engine", "--model", str(model_dir), "--port", str(port)]
    argv += [
        "--device",
        "cpu",
        "--kv-blocks",
        str(kv_blocks),
        "--block-size",
        "4",
        "--engine-core",
        engine_core,
    ]
    argv += ["--max-model-len", str(max_model_len)]
    server = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr is not None
        line = server.stderr.readline()  # said once it listens
        assert "serving" in line, line + server.stderr.read()
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(30)
