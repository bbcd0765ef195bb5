"""The optional compiled build of the gateway's hot path: the modules every request runs through, compiled by
mypyc into extension modules beside their sources (Python imports an extension module before the .py of the
same name, and without one runs the source: removing them is the fallback).

    python -m gateway.compiled build    # mypyc, ~1.5 min on 2 cores; needs a C compiler and kvgate[dev]
    python -m gateway.compiled clean    # back to pure Python
    python -m gateway.compiled status   # which build is in use, and whether it is stale

The build writes a manifest of its sources' digests. A source edited after the build would otherwise be
shadowed by its stale extension without a word, so ``kvgate serve`` (and the test suite) refuse to start
on a stale build (``check_fresh``). Measured with ``tests/bench/bench_gateway_cpu.py`` against a pure tree:
see the README.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from gateway.user_errors import UserError

ROOT = Path(__file__).resolve().parents[1]
MANIFEST_NAME = ".kvgate-compiled.json"  # beside the packages, in the root of the tree built

# The request path, by the profile of a completion at c=32 (tests/bench/profile_gateway.py; on a compiled
# build it lists what still runs as Python). Left out: the pydantic models (settings). A compiled class's
# methods cannot be replaced on an instance: tests that count calls wrap a Python collaborator instead (the
# Authenticator behind Billing.identify).
HOT_MODULES = (
    "cache/hashing.py",
    "cache/ledger.py",
    "cache/residency_memory.py",
    "cache/chat_template.py",
    "cache/tokens.py",
    "gateway/http/answer_usage.py",
    "gateway/http/engine_body.py",
    "gateway/http/http_wire.py",
    "gateway/http/lean_http.py",
    "gateway/http/lean_http_answering.py",
    "gateway/http/lean_http_deadlines.py",
    "gateway/http/lean_http_head.py",
    "gateway/http/lean_http_state.py",
    "gateway/http/lean_request.py",
    "gateway/http/lean_routes.py",
    "gateway/http/relay.py",
    "gateway/http/upstream.py",
    "gateway/http/upstream_response.py",
    "gateway/observability/loop_metrics.py",
    "gateway/observability/metrics.py",
    "gateway/prepare.py",
    "gateway/prepared.py",
    "gateway/request_body.py",
    "gateway/request_limits.py",
    "gateway/routing/base.py",
    "gateway/routing/cache_aware.py",
    "gateway/routing/default.py",
    "gateway/routing/disaggregation.py",
    "gateway/routing/regional.py",
    "gateway/routing/route.py",
    "gateway/routing/router.py",
    "gateway/routing/session.py",
    "gateway/service.py",
    "gateway/session_key.py",
    "gateway/state/shared_state.py",
    "gateway/tenancy/accounting.py",
    "gateway/tenancy/billing.py",
    "gateway/tenancy/ledger_writer.py",
    "gateway/waits.py",
    "region_map/breaker.py",
    "region_map/fleet.py",
    "region_map/prefill_queue.py",
)


def extensions_of(source: str, root: Path | None = None) -> list[Path]:
    """The extension modules built from ``source`` (a path relative to ``root``) present beside it."""
    path = (root or ROOT) / source
    return [p for suffix in EXTENSION_SUFFIXES if (p := path.with_suffix(suffix)).exists()]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stale_modules(root: Path | None = None) -> list[str]:
    """Hot modules whose extension module was not built from their source as it is now (no manifest, an
    entry missing, or a digest that differs). Empty when nothing is compiled."""
    root = root or ROOT
    compiled = [s for s in HOT_MODULES if extensions_of(s, root)]
    if not compiled:
        return []
    manifest_path = root / MANIFEST_NAME
    try:
        built = json.loads(manifest_path.read_text())["sources"]
    except (OSError, ValueError, KeyError, TypeError):
        return compiled
    return [s for s in compiled if built.get(s) != digest(root / s)]


def in_use(root: Path | None = None) -> bool:
    return any(extensions_of(s, root) for s in HOT_MODULES)


def check_fresh(root: Path | None = None) -> None:
    """Raise a UserError naming the stale modules, if the compiled build no longer matches its sources."""
    stale = stale_modules(root)
    if stale:
        raise UserError(
            f"the compiled build is stale: {', '.join(stale)} changed since `python -m gateway.compiled "
            "build`; rebuild it, or run `python -m gateway.compiled clean` to use the sources"
        )


def clean(root: Path | None = None) -> int:
    """Remove the extension modules, mypyc's shared library and the manifest; returns the files removed."""
    root = root or ROOT
    removed = [p for s in HOT_MODULES for p in extensions_of(s, root)]
    removed += [p for suffix in EXTENSION_SUFFIXES for p in root.glob(f"*__mypyc{suffix}")]
    for path in [*removed, root / MANIFEST_NAME]:
        path.unlink(missing_ok=True)
    return len(removed)


def build(root: Path | None = None) -> None:
    """Compile ``HOT_MODULES`` in place with mypyc, then record their digests."""
    root = root or ROOT
    clean(root)
    env = {**os.environ, "MYPYPATH": str(root)}
    command = [sys.executable, "-m", "mypyc", "--explicit-package-bases", *HOT_MODULES]
    ran = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    if ran.returncode != 0:
        tail = "\n".join((ran.stdout + ran.stderr).splitlines()[-20:])
        clean(root)
        raise UserError(f"mypyc failed (the sources stay in use):\n{tail}")
    sources = {s: digest(root / s) for s in HOT_MODULES}
    (root / MANIFEST_NAME).write_text(json.dumps({"sources": sources}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    action = args[0] if args else "status"
    try:
        if action == "build":
            build()
            print(f"compiled {len(HOT_MODULES)} modules with mypyc")
        elif action == "clean":
            print(f"removed {clean()} compiled files: the sources are in use")
        elif action == "status":
            if not in_use():
                print("pure Python (no compiled modules)")
            else:
                check_fresh()
                print(f"compiled: {sum(1 for s in HOT_MODULES if extensions_of(s))} modules, up to date")
        else:
            print("usage: python -m gateway.compiled [build | clean | status]", file=sys.stderr)
            return 2
    except UserError as exc:
        print(f"gateway.compiled: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a tree it may not write (an installed package, a read-only mount)
        print(f"gateway.compiled: cannot {action} the tree at {ROOT}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
