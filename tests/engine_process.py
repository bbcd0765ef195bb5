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
    model_dir: Path,
    *,
    kv_blocks: int,
    max_model_len: int,
    engine_core: str = "thread",
    host: str = "127.0.0.1",
) -> Iterator[str]:
    """The engine on ``model_dir`` (CPU, 4-token blocks, its core on a thread unless ``engine_core`` is
    "process"), on a free port of ``host``: the URL its serving line says, once it says it; stopped on
    exit."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    argv = [sys.executable, "-m", "engine", "engine", "--model", str(model_dir), "--port", str(port)]
    argv += ["--host", host]
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
        yield line.rsplit(" on ", 1)[1].strip()
    finally:
        server.terminate()
        server.wait(30)
