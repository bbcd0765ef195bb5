"""The operator's endpoints (``/metrics``, ``/dashboard``, ``/health``, ``/v1/models``) and who may read them.

They tell whoever reads them every tenant's token counts, the engines' addresses and their load. So with
authentication on, the public port serves them only to keys: ``/v1/models`` to any valid key (as OpenAI
does), ``/metrics`` and ``/dashboard`` to admin keys, and ``/health`` whole to admin keys but as a bare
``{"status": ...}`` (with its 200/503) to anyone else, load balancers included.

The Prometheus convention is a port of their own: with ``gateway.operator_port`` set, the gateway also listens
on ``operator_host:operator_port`` (loopback by default) for ``/metrics``, ``/health`` and ``/dashboard``
without keys, and the public port no longer serves ``/metrics`` and ``/dashboard`` at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from gateway.config import GatewaySettings
from gateway.http.edge import ConnectionLimits, Edge
from gateway.http.errors import PermissionDenied
from gateway.http.lean_http import LeanConnection
from gateway.http.lean_request import LeanRequest
from gateway.http.lean_routes import LeanHandler, Routes
from gateway.service import Gateway
from gateway.tenancy.billing import Billing
from region_map.config import ConfigError

ADMIN_ONLY = ("/metrics", "/dashboard")  # and everything under /dashboard/


def guarded(billing: Billing, path: str, handler: LeanHandler) -> LeanHandler:
    """``handler`` behind the keys its endpoint of the public port needs (nothing changes with
    authentication off): any valid key for ``/v1/models`` and ``/v1/models/{model}``, an admin key for
    ``/metrics`` and ``/dashboard``."""
    if not billing.auth.enabled:
        return handler
    admin_only = path in ADMIN_ONLY or path.startswith("/dashboard/")

    async def checked(request: LeanRequest) -> web.StreamResponse:
        caller = await billing.identify(request.headers.get("Authorization"))
        if admin_only and not caller.admin:
            raise PermissionDenied(f"{request.path} is for operators: it needs an admin key")
        return await handler(request)  # type: ignore[return-value]  # (these endpoints answer whole)

    return checked if admin_only or path.startswith("/v1/models") else handler  # (one model's card too)


def public_health(gateway: Gateway) -> LeanHandler:
    """``/health`` on the public port: whole for admin keys (and with authentication off); the bare status
    for a load balancer's probe, which carries no key (a key that is there must be valid)."""
    billing = gateway.billing

    async def health(request: LeanRequest) -> web.Response:
        authorization = request.headers.get("Authorization")
        details = not billing.auth.enabled or (
            authorization is not None and (await billing.identify(authorization)).admin
        )
        return gateway.health_report.response(details)

    return health


class OperatorSite:
    """The operator's port, served by ``gateway.http.lean_http`` as the public port is (its own caps, the
    public port's read deadlines), without keys."""

    def __init__(self, server: asyncio.Server, connections: set[LeanConnection]) -> None:
        self.server = server
        self.connections = connections

    @property
    def url(self) -> str:
        return "http://{}:{}".format(*self.server.sockets[0].getsockname()[:2])

    async def close(self, grace_s: float) -> None:
        """Stop accepting; let answers in progress finish for ``grace_s``; close every connection."""
        self.server.close()
        await asyncio.gather(*(c.shutdown(grace_s) for c in list(self.connections)))
        await self.server.wait_closed()


async def start_operator_site(
    routes: Routes, host: str, port: int, *, settings: GatewaySettings, answered: Callable[[str, int], None]
) -> OperatorSite:
    """Serve ``routes`` (the operator endpoints, no keys) on ``host:port``; the caller closes the site."""
    cap = settings.edge.max_connections
    edge = Edge(settings.edge, ConnectionLimits(max_total=cap, max_per_client=cap))
    connections: set[LeanConnection] = set()

    def connection() -> LeanConnection:
        return LeanConnection(
            routes, max_body_bytes=settings.max_body_bytes, registry=connections, answered=answered, edge=edge
        )

    try:
        server = await asyncio.get_running_loop().create_server(connection, host, port)
    except OSError as exc:
        reason = exc.strerror or exc
        raise ConfigError(f"gateway.operator_port: cannot listen on {host}:{port}: {reason}") from None
    return OperatorSite(server, connections)
