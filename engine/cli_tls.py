"""``--tls-cert``/``--tls-key``, shared by ``kvgate engine`` and ``kvgate sim-engine``: serve https://."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ssl  # imported when a certificate is loaded: the console script imports this module on every run


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tls-cert``/``--tls-key``: serve https:// (the gateway then reaches it over TLS)."""
    parser.add_argument(
        "--tls-cert", metavar="PEM", help="serve https:// with this certificate chain (PEM; may hold the key)"
    )
    parser.add_argument(
        "--tls-key", metavar="PEM", help="the certificate's private key (PEM; default: in --tls-cert)"
    )


def tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The server context of ``--tls-cert``/``--tls-key``, or None for plain http; exits on unusable files."""
    if args.tls_cert is None:
        if args.tls_key is not None:
            raise SystemExit("kvgate: --tls-key needs --tls-cert (the certificate it belongs to)")
        return None
    import ssl

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(args.tls_cert, args.tls_key)
    except (OSError, ValueError) as exc:  # a missing file, or not a PEM certificate with its key
        raise SystemExit(f"kvgate: cannot use --tls-cert {args.tls_cert}: {exc}") from None
    return context
