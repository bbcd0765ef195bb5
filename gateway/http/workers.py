"""``kvgate serve --workers N``: N gateway processes sharing the public port (SO_REUSEPORT), each with its
own gateway id, spool and operator port, stopped together. Without operator ports, the public port's
``/metrics`` answers for all of them (gateway.observability.worker_metrics)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from cache.journal import journal_holder, locked_message
from cache.parent_death import die_with_parent
from gateway.app import gateway_tokenizer
from gateway.config import KvgateConfig
from gateway.http.listening import check_can_listen
from gateway.http.server import run_gateway
from gateway.observability.worker_metrics import clear_snapshots
from gateway.state.private_redis import PrivateRedis
from gateway.tenancy.billing import spool_path
from gateway.user_errors import UserError
from region_map.config import ConfigError

log = logging.getLogger("kvgate.server")


def _run_worker(config: KvgateConfig, parent: int) -> None:
    """A worker process: its error in one line, as the command's would be. It stops (draining, as on
    SIGTERM) when ``kvgate serve`` dies, even killed, instead of holding the port alone."""
    die_with_parent()
    if os.getppid() != parent:  # (it died before that took effect)
        sys.exit(1)
    # Out of the terminal's process group: a Ctrl-C reaches kvgate serve alone, which forwards it once.
    # Reached by both, a worker took one Ctrl-C for two, and a second SIGINT ends its drain at once.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    try:
        run_gateway(config, reuse_port=True)
    except UserError as exc:
        print(f"kvgate serve: {config.gateway_id}: {exc}", file=sys.stderr)
        sys.exit(exc.status)
    except ConfigError as exc:
        print(f"kvgate serve: {config.gateway_id}: configuration error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # a Ctrl-C passed on while it started: it ends as that SIGINT's, silently
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


def worker_config(config: KvgateConfig, index: int) -> KvgateConfig:
    """Worker ``index``'s configuration: its own gateway id, ledger spool (and journal) and operator port
    (``operator_port + index``: each worker's metrics are its own to scrape), the same public port."""
    update: dict[str, object] = {
        "gateway_id": f"{config.gateway_id}-w{index}",
        "spool_path": f"{spool_path(config)}.w{index}",
    }
    if config.gateway.operator_port:
        update["operator_port"] = config.gateway.operator_port + index
    gateway = config.gateway.model_copy(update=update)
    # Without operator ports, a scrape of the public port reaches any worker: each answers for all.
    shared = None if config.gateway.operator_port else worker_metrics_dir(config)
    return dataclasses.replace(config, gateway=gateway, worker_metrics_dir=shared)


def run_workers(config: KvgateConfig, workers: int) -> int:
    """``workers`` gateway processes sharing the port (SO_REUSEPORT: the kernel spreads connections).
    Each follows every engine's KV events itself; sessions, the residency records of engines without
    events, the ledger and rate limits are shared through Redis: the configured one, or without one a
    private redis-server (``gateway.state.private_redis``) that lives as long as the workers. Stops all
    when one stops or on SIGINT/SIGTERM; a worker that stopped unasked makes the status non-zero."""
    check_can_listen(config.gateway.host, config.gateway.port)  # (none of its own holds it yet)
    check_operator_ports(config, workers)
    _check_state_directory(config)
    _check_journals_free(config, workers)
    gateway_tokenizer(config)  # (once here, not one configuration error per worker)
    if not config.gateway.operator_port:
        clear_snapshots(worker_metrics_dir(config))  # (an earlier run's counts are not this one's)
    if config.gateway.redis_url is not None:
        return _run_children(config, workers)
    private = PrivateRedis(private_redis_dir(config))
    url = private.start()
    log.info("%d workers share their state through a private redis-server at %s", workers, url)
    try:
        gateway = config.gateway.model_copy(update={"redis_url": url})
        return _run_children(dataclasses.replace(config, gateway=gateway), workers)
    finally:
        private.stop()


def check_operator_ports(config: KvgateConfig, workers: int) -> None:
    """Worker i's operator port is ``operator_port + i``: all of them must be ports, and none the public
    port. Unchecked, one that was the public port took it from the workers (which then failed with "another
    process listens there"), and one past 65535 wrapped round to a random port nobody scrapes."""
    first, public = config.gateway.operator_port, config.gateway.port
    if not first:  # (none, or 0: each worker's own ephemeral port)
        return
    last = first + workers - 1
    ports = f"operator_port + 0..{workers - 1}, here {first}..{last}"
    if last > 65535:
        raise ConfigError(
            f"gateway.operator_port: {workers} workers listen for the operator on {ports}, past 65535: "
            f"choose an operator_port of at most {65536 - workers}"
        )
    if first <= public <= last:
        raise ConfigError(
            f"gateway.operator_port: worker {public - first}'s operator port would be the public port "
            f"{public} ({workers} workers listen for the operator on {ports}): choose an operator_port "
            f"outside {public - workers + 1}..{public}"
        )


def _check_state_directory(config: KvgateConfig) -> None:
    """The directory of the spool, where the workers keep their spools and journals, their private Redis
    and their shared metrics, made now: an unusable one (a file in the way, a read-only mount) was a
    NotADirectoryError "unexpected error", or the same configuration error once per worker."""
    directory = spool_path(config).parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not directory.is_dir() or not os.access(directory, os.W_OK | os.X_OK):
            raise NotADirectoryError(f"{directory} is not a directory this user may write in")
    except OSError as exc:  # (mkdir says "File exists" of a file where the directory should be)
        reason = "not a directory" if isinstance(exc, FileExistsError) else exc.strerror or str(exc)
        raise ConfigError(
            f"gateway.spool_path: the workers cannot keep their spools, Redis and metrics in {directory}: "
            f"{reason}"
        ) from None


def _check_journals_free(config: KvgateConfig, workers: int) -> None:
    """No other process holds a worker's usage journal: the workers of the last ``kvgate serve`` on this
    spool path may still be draining (after it was killed, say). Each worker of this one then said so, one
    line each, with the first one's death logged as an error."""
    for index in range(workers):
        path = spool_path(worker_config(config, index))
        holder = journal_holder(path)
        if holder is not None:
            lock = path.with_name(path.name + ".journal.lock")
            raise ConfigError(f"gateway.spool_path: {locked_message(lock, holder)}")


def worker_metrics_dir(config: KvgateConfig) -> Path:
    """Where the workers share their metrics (gateway.observability.worker_metrics): beside their private
    Redis's directory, one per region and port."""
    return private_redis_dir(config).with_name(private_redis_dir(config).name + "-metrics")


def private_redis_dir(config: KvgateConfig) -> Path:
    """Where the workers' private Redis keeps its socket and log: beside the ledger spool (the state
    directory), one per region and port like the spool."""
    return spool_path(config).parent / f"workers-{config.topology.region}-{config.gateway.port}"


def _run_children(config: KvgateConfig, workers: int) -> int:
    context: Any = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    children: list[BaseProcess] = [
        context.Process(
            target=_run_worker, args=(worker_config(config, i), os.getpid()), name=f"kvgate-worker-{i}"
        )
        for i in range(workers)
    ]  # fmt: skip
    for child in children:
        child.start()

    asked_to_stop = False

    def forward(signum: int, frame: Any) -> None:
        for child in children:
            if child.is_alive() and child.pid is not None:
                os.kill(child.pid, signum)

    def stop(signum: int, frame: Any) -> None:
        nonlocal asked_to_stop
        asked_to_stop = True
        forward(signum, frame)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    first_ended: BaseProcess | None = None
    try:
        # (Woken each second to see whether it was asked to stop: the signal handler cannot end the wait.)
        while all(child.is_alive() for child in children) and not asked_to_stop:
            multiprocessing.connection.wait([child.sentinel for child in children], timeout=1.0)
        first_ended = next((child for child in children if not child.is_alive()), None)
        if first_ended is not None and not asked_to_stop:  # (said now: the others may drain for a while)
            log.error(
                "worker %s (pid %s) %s: stopping the other workers",
                first_ended.name,
                first_ended.pid,
                _how_it_ended(first_ended.exitcode or 0),
            )
    finally:
        forward(signal.SIGTERM, None)  # one ended: the service is not whole, stop the rest
        killed = _join_or_kill(children, config.gateway.resilience.drain_timeout_s + STOP_MARGIN_S)
    return 1 if killed else _exit_status(children, first_ended, asked_to_stop)


STOP_MARGIN_S = 10.0  # past the drain: the ledger's last write (5 s at most), Redis and the engines' sessions


def _join_or_kill(children: list[BaseProcess], within_s: float) -> bool:
    """Wait for the workers told to stop; kill any still running ``within_s`` seconds later (the drain and
    the ledger's last write), saying so. A worker stuck for good (a task that never ended, a stopped
    process) held ``kvgate serve`` for ever, and a supervisor's stop only ended it by its own SIGKILL.
    Whether one had to be killed."""
    deadline = time.monotonic() + within_s
    killed = False
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive() and child.pid is not None:
            log.error(
                "worker %s (pid %s) did not stop within %.0f s of SIGTERM: killing it (the usage records it "
                "still held are in its journal, billed at the next start)",
                child.name,
                child.pid,
                within_s,
            )
            os.kill(child.pid, signal.SIGKILL)
            child.join()
            killed = True
    return killed


def _exit_status(children: list[BaseProcess], first_ended: BaseProcess | None, asked_to_stop: bool) -> int:
    """``kvgate serve``'s status once its workers ended. A worker that ends unasked (killed, crashed, OOM
    killed) is a failure even when the others then drain cleanly: a worker killed by a signal used to leave
    a status of 0 (``max(-9, 0)``), so a supervisor restarting on failure left the service down, and
    nothing said which worker had died."""
    if first_ended is not None and not asked_to_stop:
        return max(1, first_ended.exitcode or 0)  # (its own status, or 1 for a signal or an exit 0)
    # Asked to stop: a worker that the forwarded SIGTERM/SIGINT caught before its handler was in is fine.
    stopping = (None, 0, -signal.SIGTERM, -signal.SIGINT)
    codes = [c.exitcode or 0 for c in children if c.exitcode not in stopping]
    return max([1 if code < 0 else code for code in codes] or [0])


def _how_it_ended(exitcode: int) -> str:
    if exitcode >= 0:
        return f"exited with status {exitcode}"
    try:
        return f"was killed by {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"was killed by signal {-exitcode}"
