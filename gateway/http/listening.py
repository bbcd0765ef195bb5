"""Opening the public port, said plainly: whether it can be opened (checked before engines start or Redis is
dialled), the one-line error when it cannot, and the log line that says where the gateway listens."""

from __future__ import annotations

import errno
import logging
import socket
from typing import Any

from aiohttp import web

from gateway.app import GATEWAY
from gateway.user_errors import UserError

log = logging.getLogger("kvgate.server")

PORT_FLAG = "--port (or gateway.port)"  # how `kvgate serve` is told another port


def listen_error(host: str | None, port: int, exc: OSError, *, port_flag: str = PORT_FLAG) -> UserError:
    """A listening socket that could not be opened, said with its cause and what to do about it."""
    reason = exc.strerror or str(exc)
    if exc.errno == errno.EADDRINUSE:
        fix = "another process (another kvgate?) listens there: stop it, or choose another port with "
        fix += port_flag
    elif exc.errno in (errno.EACCES, errno.EPERM):
        fix = f"ports below 1024 need privileges: choose a port above 1023 with {port_flag}"
    elif exc.errno == errno.EADDRNOTAVAIL:
        fix = "that address is not one of this machine's: listen on 127.0.0.1 or 0.0.0.0 instead"
    else:
        fix = f"check the listen address, and the port ({port_flag})"
    return UserError(f"cannot listen on {host or '*'}:{port}: {reason}; {fix}")


def check_can_listen(host: str | None, port: int, *, port_flag: str = PORT_FLAG) -> None:
    """Raise ``listen_error`` now when ``host:port`` is taken (by anyone, SO_REUSEPORT listeners included),
    before engines start or Redis is dialled; the bind that serves can still fail later (a race), and says
    the same then."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError(
            f"cannot listen on {host}:{port}: {exc.strerror}; give an address or a name this machine resolves"
        ) from None
    for family, kind, proto, _, address in dict.fromkeys(addresses):
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:  # (e.g. IPv6 off on this machine: the server skips that family too)
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's server does
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise listen_error(host, port, exc, port_flag=port_flag) from exc


def listen_url(address: Any) -> str:
    host, port = address[0], address[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def log_listening(app: web.Application, runner: web.AppRunner) -> None:
    """Where the gateway listens, and where its dashboard opens (the operator port's, when it has one)."""
    gateway = app.get(GATEWAY)
    if gateway is None or not runner.addresses:
        return
    url = listen_url(runner.addresses[0])
    if gateway.operator_url is not None:
        dashboard = f"{gateway.operator_url}/dashboard (with /metrics and /health, on the operator port)"
    elif gateway.settings.auth.enabled:
        dashboard = f"{url}/dashboard (admin keys only; set gateway.operator_port to open it in a browser)"
    else:
        dashboard = f"{url}/dashboard"
    log.info("gateway %s listening on %s; dashboard: %s", gateway.state.gateway_id, url, dashboard)
