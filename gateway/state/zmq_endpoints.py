"""Where a vLLM or SGLang engine's KV event sockets are, in the engines' own endpoint notation.

``tcp://host:port`` is an address the engine binds and the gateway connects to; ``tcp://*:port`` (any
wildcard host) means the engine connects and the gateway binds, as vLLM decides for its own PUB socket;
``ipc://`` is always bound by the engine. Data-parallel rank r publishes on the endpoint's port + r.
"""

from __future__ import annotations

from urllib.parse import urlsplit

_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Where data-parallel rank ``rank`` publishes: the endpoint's port + rank (vLLM's and SGLang's rule)."""
    if rank == 0:
        return endpoint
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"data-parallel ranks need tcp:// endpoints (port + rank), not {endpoint!r}")
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


def gateway_binds(endpoint: str) -> bool:
    """Whether the gateway binds ``endpoint``: a wildcard host means the engine connects to us (vLLM's PUB
    connects when its own endpoint names a host); any other address is the engine's, bound by it."""
    if not endpoint.startswith("tcp://"):
        return False  # ipc:// is always bound by the engine
    host = endpoint[len("tcp://") :].rpartition(":")[0]
    return host in _WILDCARD_HOSTS


def replay_address(endpoint: str, engine_url: str) -> str:
    """The replay ROUTER is always bound by the engine. Written in the engine's own notation
    (``tcp://*:5558``), it is reached at the host of the engine's URL."""
    if not gateway_binds(endpoint):
        return endpoint
    host = urlsplit(engine_url).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{endpoint.rpartition(':')[2]}"
