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

from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.http.errors import PermissionDenied
from gateway.service import Gateway
from gateway.tenancy.billing import Billing
from region_map.config import ConfigError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ADMIN_ONLY = ("/metrics", "/dashboard")  # and everything under /dashboard/


def access_middleware(billing: Billing) -> Middleware:
    """Keys for the operator endpoints of the public port (nothing changes with authentication off)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not billing.auth.enabled:
            return await handler(request)
        path = request.path
        authorization = request.headers.get("Authorization")
        if path == "/v1/models":
            await billing.identify(authorization)
        elif (path in ADMIN_ONLY or path.startswith("/dashboard/")) and not (
            await billing.identify(authorization)
        ).admin:
            raise PermissionDenied(f"{path} is for operators: it needs an admin key")
        return await handler(request)

    return middleware


def public_health(gateway: Gateway) -> Handler:
    """``/health`` on the public port: whole for admin keys (and with authentication off); the bare status
    for a load balancer's probe, which carries no key (a key that is there must be valid)."""
    billing = gateway.billing

    async def health(request: web.Request) -> web.Response:
        authorization = request.headers.get("Authorization")
        details = not billing.auth.enabled or (
            authorization is not None and (await billing.identify(authorization)).admin
        )
        return gateway.health_response(details)

    return health


async def start_operator_site(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serve ``app`` (the operator endpoints, no keys) on ``host:port``; the caller cleans the runner up."""
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        await runner.cleanup()
        reason = exc.strerror or exc
        raise ConfigError(f"gateway.operator_port: cannot listen on {host}:{port}: {reason}") from None
    return runner
