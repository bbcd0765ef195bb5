"""The workers' shared state without a Redis of the user's: ``kvgate serve --workers N`` with no Redis
configured starts a private ``redis-server`` that only its workers reach (a unix socket, mode 0700, under
the state directory), keeps nothing on disk, and stops after them. The workers then share sessions,
residency, the ledger and rate limits through the same code as gateways sharing a Redis do."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from cache.parent_death import die_with_parent
from gateway.user_errors import UserError

START_TIMEOUT_S = 10.0
MAX_SOCKET_PATH = 100  # bytes; Linux allows 107 in a unix socket's address, macOS 103


class PrivateRedis:
    def __init__(self, directory: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise UserError(
                "--workers N without Redis shares the workers' state through a private redis-server, and "
                "none is installed: install Redis (e.g. apt install redis-server, brew install redis), give "
                "--redis URL, or run one worker",
                status=2,
            )
        self.binary = binary
        self.directory = directory
        self._socket_dir: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        assert self._socket_dir is not None
        return self._socket_dir / "redis.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket}?db=0"

    def start(self) -> str:
        """Start the server; returns its URL once it answers."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise UserError(f"cannot keep the workers' private Redis in {self.directory}: {exc}") from None
        self._socket_dir = self.directory
        if len(str(self.socket).encode()) > MAX_SOCKET_PATH:  # too long for a socket: a private temp dir
            self._socket_dir = Path(tempfile.mkdtemp(prefix="kvgate-redis-"))
        log_file = self.directory / "redis.log"
        with log_file.open("wb") as log:
            self.process = subprocess.Popen(
                [self.binary, "--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700",
                 "--dir", str(self.directory), "--save", "", "--appendonly", "no", "--daemonize", "no"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C reaches the workers, which drain into it before it stops
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
            )  # fmt: skip
        client = redis.Redis(unix_socket_path=str(self.socket), socket_timeout=0.5)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while True:
                if self.process.poll() is not None:
                    said = log_file.read_text(errors="replace").strip().splitlines()
                    raise UserError(
                        f"the workers' private redis-server exited at start: {said[-1] if said else '?'}"
                    )
                with contextlib.suppress(redis.RedisError, OSError):
                    if client.ping():
                        return self.url
                if time.monotonic() > deadline:
                    self.stop()
                    raise UserError(
                        f"the workers' private redis-server did not answer within {START_TIMEOUT_S:g} s "
                        f"(its log: {log_file})"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        """SIGTERM (Redis exits at once: it has nothing to save), then remove its socket."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._socket_dir is not None:
            with contextlib.suppress(OSError):
                self.socket.unlink()
            if self._socket_dir != self.directory:
                with contextlib.suppress(OSError):
                    self._socket_dir.rmdir()
