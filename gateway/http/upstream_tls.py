"""TLS to ``https://`` engines: the one client context that every connection to an engine verifies against
(``engine_tls_context``), and the words for a failed handshake."""

from __future__ import annotations

import functools
import os
import ssl

from region_map.config import ConfigError


def engine_tls_context(
    *, ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext:
    """The client context for TLS to engines: certificates and host names always verified, against the CAs
    in ``ca_file`` (PEM) or else the system's; ``cert_file``/``key_file``: the gateway's own certificate for
    engines that demand one (mutual TLS). Unusable files are a ``ConfigError`` naming the setting."""
    if ca_file is None and cert_file is None and key_file is None:
        return _system_context()
    files = {
        "engine_tls_ca_file": ca_file,
        "engine_tls_cert_file": cert_file,
        "engine_tls_key_file": key_file,
    }
    for setting, path in files.items():
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"gateway.{setting}: no such file: {path}")
    if key_file is not None and cert_file is None:
        raise ConfigError("gateway.engine_tls_key_file: needs gateway.engine_tls_cert_file (the certificate)")
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise ConfigError(
            f"gateway.engine_tls_ca_file: no CA certificates (PEM) in {ca_file}: {exc}"
        ) from None
    if cert_file is not None:
        try:
            context.load_cert_chain(cert_file, key_file)
        except (OSError, ValueError) as exc:
            key = f" with the key in {key_file}" if key_file else ""
            raise ConfigError(
                f"gateway.engine_tls_cert_file: cannot use {cert_file}{key} as the client certificate: {exc}"
            ) from None
    return context


@functools.cache
def _system_context() -> ssl.SSLContext:
    # Loading the system's CA store costs ~20 ms: once per process, shared by every gateway in it.
    return ssl.create_default_context(ssl.Purpose.SERVER_AUTH)


def tls_failure_reason(exc: ssl.SSLError) -> str:
    """Why a TLS handshake with an engine failed, in a few words (a refused certificate says why)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate refused: {exc.verify_message}"
    return exc.reason or str(exc)
