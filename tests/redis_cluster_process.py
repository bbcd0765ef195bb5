"""A real Redis Cluster of the test's own: three ``redis-server`` masters (no replicas) on free ports, joined
by ``redis-cli --cluster create``, every slot covered before it is handed out. Nothing persists: the
servers run without RDB or AOF in a temporary directory."""

from __future__ import annotations

import contextlib
import random
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis
from redis.crc import key_slot

from tests.serving import bindable

MASTERS = 3
BUS_OFFSET = 10_000  # a cluster node also listens on its port + 10000 (the cluster bus)


def cluster_ports(count: int) -> list[int]:
    """Ports whose bus ports are free too, below the kernel's ephemeral range (a free port from bind(0)
    there may have no room for its bus port under 65536, and may be taken by an outgoing connection)."""
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randrange(12_000, 20_000)
        if port not in ports and bindable(port) and bindable(port + BUS_OFFSET):
            ports.append(port)
    return ports


def tools_missing() -> str | None:
    """Why no cluster can be started here (None: it can)."""
    missing = [tool for tool in ("redis-server", "redis-cli") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not installed (scripts/test installs redis-server)" if missing else None


class RedisClusterProcesses:
    """``replicas``: replicas per master, each promoted ``node_timeout_ms`` after its master falls silent."""

    def __init__(self, directory: Path, replicas: int = 0, node_timeout_ms: int = 15_000) -> None:
        self.directory = directory
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.ports = cluster_ports(MASTERS * (1 + replicas))
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def urls(self) -> list[str]:
        return [f"redis://127.0.0.1:{port}" for port in self.ports]

    def start(self) -> None:
        for port in self.ports:
            args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                    "--cluster-config-file", f"nodes-{port}.conf", "--save", "", "--appendonly", "no",
                    "--cluster-node-timeout", str(self.node_timeout_ms), "--repl-diskless-sync-delay", "0",
                    "--dir", str(self.directory)]  # fmt: skip
            self.processes.append(
                subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        for port in self.ports:
            self._wait(port, lambda client: bool(client.ping()))
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
             "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=30,
        )  # fmt: skip
        for port in self.ports:  # every node knows every slot's owner: no CLUSTERDOWN at the first command
            self._wait(
                port, lambda client: client.execute_command("CLUSTER INFO").get("cluster_state") == "ok"
            )
        for port in self.ports:  # and every replica holds its master's data: one that never synced is
            # never promoted
            self._wait(
                port, lambda client: client.info("replication").get("master_link_status", "up") == "up"
            )

    def master_of(self, key: str) -> int:
        """The port of the node that serves ``key``'s slot now."""
        slot = key_slot(key.encode())
        for port in self.ports:
            if self.processes[self.ports.index(port)].poll() is not None:
                continue  # (killed: a client would retry its refused connection for seconds)
            with (
                contextlib.suppress(redis.ConnectionError, redis.TimeoutError),
                redis.Redis(port=port, socket_timeout=0.5) as client,
            ):
                for start, end, (_, owner, *_), *_ in client.execute_command("CLUSTER SLOTS"):
                    if start <= slot <= end:
                        return int(owner)
        raise RuntimeError(f"no node of the test's cluster serves slot {slot}")

    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port``, as a crash would end it."""
        process = self.processes[self.ports.index(port)]
        process.kill()
        process.wait(10)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            process.wait(10)
        self.processes = []

    @staticmethod
    def _wait(port: int, ready: Callable[[redis.Redis], bool]) -> None:
        client = redis.Redis(port=port, socket_timeout=0.5, decode_responses=True)
        deadline = time.monotonic() + 20
        try:
            while True:
                try:
                    if ready(client):
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the test's Redis Cluster node on port {port} did not get ready")
                time.sleep(0.05)
        finally:
            client.close()
