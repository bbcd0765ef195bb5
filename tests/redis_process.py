"""A Redis server of the test's own (a real ``redis-server`` process) that a test may stop and restart.

It keeps its data in an append-only file with ``appendfsync always``, so a restart brings back everything
written before the stop, as a production Redis with persistence would.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import redis


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisProcess:
    def __init__(self, directory: Path, args: Sequence[str] = ()) -> None:
        """``args``: more of redis-server's options (``--maxmemory-policy allkeys-lru``)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/test installs it)")
        self.binary = binary
        self.directory = directory
        self.port = _free_port()
        self.args = list(args)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", *self.args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        client = redis.Redis(port=self.port, socket_timeout=0.5)
        while True:
            try:
                if client.ping():
                    break
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                if time.monotonic() > deadline:
                    raise RuntimeError("the test's redis-server did not start") from None
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        """SIGTERM: Redis fsyncs its append-only file and exits; clients then get refused connections."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        self.process = None
