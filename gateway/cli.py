"""The ``kvgate`` command. Each package contributes its subcommands through the ``kvgate.commands``
entry-point group, so the gateway never imports the engine (or the reverse)."""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from collections.abc import Sequence
from importlib.metadata import entry_points

from gateway.observability.logs import configure_logging
from gateway.user_errors import UserError
from region_map.config import ConfigError

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "text")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Each option's help ends with its default, unless it has none (None, or a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or default is None or default is False or default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="run the gateway from a deployment file",
        description="Run the OpenAI-compatible gateway described by a deployment file (TOML or YAML).",
    )
    serve.add_argument("--config", required=True, help="deployment file (regions, engines, [gateway])")
    serve.add_argument("--host", help="listen address (overrides gateway.host)")
    serve.add_argument("--port", type=int, help="listen port (overrides gateway.port)")
    serve.add_argument("--redis", metavar="URL", help="shared state in Redis, e.g. redis://127.0.0.1:6379/0")
    serve.add_argument(
        "--redis-cluster",
        action="store_const",
        const=True,
        help="--redis (or gateway.redis_url) is one node of a Redis Cluster (gateway.redis_cluster)",
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=None,  # (then KVGATE_WORKERS, else 1: read by _serve, where a typo in it is said)
        help="gateway processes sharing the port (default: KVGATE_WORKERS, else 1; more use more cores). "
        "They share sessions, the ledger and rate limits through --redis, or without it through a private "
        "redis-server they start",
    )
    serve.set_defaults(func=_serve)

    demo = subparsers.add_parser(
        "demo",
        help="start engines in several regions and a gateway in front of them",
        description="Start REGIONS x ENGINES engines on this machine (kvgate's engine on a tiny random "
        "model, or simulated ones) and a gateway on 127.0.0.1, print commands to try, and stop everything "
        "on Ctrl-C.",
    )
    demo.add_argument("--port", type=int, default=8080, help="gateway port (default 8080)")
    demo.add_argument("--regions", type=int, default=2, help="number of regions (default 2)")
    demo.add_argument("--engines-per-region", type=int, default=2, help="engines in each region (default 2)")
    demo.add_argument("--redis", metavar="URL", help="keep shared state in Redis instead of in process")
    demo.add_argument("--redis-cluster", action="store_true", help="--redis is one node of a Redis Cluster")
    demo.add_argument("--simulated", action="store_true", help="run simulated engines instead of real ones")
    demo.add_argument(
        "--model", metavar="DIR", help="serve this model directory (default: a tiny random one)"
    )
    demo.add_argument(
        "--pd", action="store_true", help="disaggregate: each region runs one prefill and one decode engine"
    )
    demo.add_argument(
        "--auth", action="store_true", help="require API keys; prints one for each of two demo tenants"
    )
    demo.set_defaults(func=_demo)

    sim = subparsers.add_parser(
        "simulate",
        help="replay a Mooncake trace through the gateway's routing on simulated regions",
        description="Replay a Mooncake-format trace through the gateway's real routing policies, with a "
        "discrete-event model of engines (prefill throughput, decode time, queues, LRU caches, RTTs).",
        formatter_class=DefaultsHelpFormatter,
    )
    sim.add_argument("--trace", required=True, help="Mooncake-format JSONL trace (.gz read as it is)")
    sim.add_argument("--regions", type=int, default=1, help="number of regions")
    sim.add_argument("--engines-per-region", type=int, default=8, help="engines in each region")
    sim.add_argument(
        "--capacity-blocks", type=int, default=2000, help="prefix cache per engine, in trace blocks"
    )
    sim.add_argument(
        "--policy",
        default="default",
        help="default, cache_aware (alias prefix), session, least_load, round_robin",
    )
    sim.add_argument("--rtt-ms", type=float, default=40.0, help="round trip between two regions")
    sim.add_argument(
        "--prefill-tokens-per-s", type=float, default=20_000.0, help="an engine's prefill throughput"
    )
    sim.add_argument("--decode-s-per-token", type=float, default=0.03, help="decode time per output token")
    sim.add_argument(
        "--kv-pull-tokens-per-s",
        type=float,
        default=85_000.0,
        help="K/V pulled from a peer in the same region (0: engines never pull)",
    )
    sim.add_argument(
        "--max-remote-share", type=float, default=0.2, help="cap on a region's traffic sent away"
    )
    sim.add_argument(
        "--limit", type=int, default=None, help="replay only the first N requests (default: all)"
    )
    sim.add_argument(
        "--profile",
        metavar="NAME",
        default=None,
        help="model each engine with perfmodel's batching cost model under this engine profile "
        "(llama3-8b-h100, llama3-70b-h100, ...) instead of the FIFO prefill model; "
        "--prefill-tokens-per-s and --decode-s-per-token then do not apply",
    )
    sim.add_argument(
        "--profile-overrides",
        metavar="K=V,...",
        default=None,
        help="with --profile: replace some of the profile's fields, e.g. max_batch_tokens=2048",
    )
    sim.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    sim.set_defaults(func=_simulate)

    from gateway.tenancy import accounts_cli

    accounts_cli.register(subparsers)


def _serve(args: argparse.Namespace) -> int:
    from gateway.compiled import check_fresh

    check_fresh()  # before the request path is imported: a stale compiled module would shadow its source
    from gateway.config import load_config
    from gateway.http.server import run_gateway
    from gateway.http.workers import run_workers

    workers = args.workers if args.workers is not None else _workers_from_environ()
    if workers < 1:
        raise ConfigError("--workers must be at least 1")
    cpus = usable_cpus()
    if workers > WORKERS_PER_CPU * cpus:
        # Each worker is a whole gateway process (some 70 MB) with one event loop: past the CPUs they add
        # memory, not throughput. Unchecked, a mistyped count built its workers until memory ran out, silent.
        raise ConfigError(
            f"--workers {workers}: more than {WORKERS_PER_CPU} per CPU this process may use ({cpus}); a "
            "worker is a whole gateway process, and workers past the CPUs add memory, not throughput: "
            f"choose at most {WORKERS_PER_CPU * cpus} (--workers {cpus} uses every CPU)"
        )
    overrides = {
        "host": args.host,
        "port": args.port,
        "redis_url": args.redis,
        "redis_cluster": args.redis_cluster,
    }
    config = load_config(args.config, environ=os.environ, overrides=overrides)
    if not any(region.engines for region in config.topology.regions):
        # The file is read once: a gateway without engines would answer 503 to everything until restarted.
        raise ConfigError(
            f"regions: no engine in any region of {args.config}; list each region's engines "
            '(engines = [{ name = "e0", url = "http://host:port" }])'
        )
    if workers > 1:
        if config.gateway.port == 0:
            raise ConfigError("--workers needs a fixed port: with port 0 every worker would get its own")
        return run_workers(config, workers)
    run_gateway(config)
    return 0


WORKERS_PER_CPU = 4  # the most ``--workers`` allows per usable CPU


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _workers_from_environ() -> int:
    """``KVGATE_WORKERS``, the default of ``--workers``. (It used to be read while the parser was built, so
    that a typo in it was a traceback for every command, ``--help`` too.)"""
    value = os.environ.get("KVGATE_WORKERS", "1")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(
            f"KVGATE_WORKERS={value!r}: not a whole number (the default of --workers)"
        ) from None


def _demo(args: argparse.Namespace) -> int:
    from gateway.demo import run_demo

    if args.regions < 1 or args.engines_per_region < 1:
        raise ConfigError("--regions and --engines-per-region must be at least 1")
    # Checked before any engine starts (the gateway's configuration is checked only after they are up);
    # port 0 would serve on some port while the tour printed :0.
    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: a port is 1 to 65535")
    if args.redis_cluster and args.redis is None:
        raise ConfigError("--redis-cluster: give --redis, the URL of one of the cluster's nodes")
    if args.redis is not None:
        from gateway.config import check_redis_url

        try:
            check_redis_url(args.redis)
        except ValueError as exc:
            raise ConfigError(f"--redis: {exc}") from None
    return run_demo(
        port=args.port,
        regions=args.regions,
        engines_per_region=args.engines_per_region,
        redis_url=args.redis,
        redis_cluster=args.redis_cluster,
        simulated=args.simulated,
        model_dir=args.model,
        pd=args.pd,
        auth=args.auth,
    )


def _check_simulate_numbers(args: argparse.Namespace) -> None:
    """Each number out of range is said with its flag before the trace is read: a prefill rate of 0 used to
    divide by zero deep in the model, and negative times and rates ran and printed figures."""
    counts = {"--regions": args.regions, "--engines-per-region": args.engines_per_region,
              "--capacity-blocks": args.capacity_blocks, "--limit": args.limit}  # fmt: skip
    for flag, count in counts.items():
        if count is not None and count < 1:
            raise ConfigError(f"{flag} {count}: must be a whole number of at least 1")
    if not 0 < args.prefill_tokens_per_s < math.inf:  # (also refuses NaN)
        rate = args.prefill_tokens_per_s
        raise ConfigError(f"--prefill-tokens-per-s {rate}: must be a finite number above 0")
    costs = {"--decode-s-per-token": args.decode_s_per_token, "--rtt-ms": args.rtt_ms,
             "--kv-pull-tokens-per-s": args.kv_pull_tokens_per_s}  # fmt: skip
    for flag, value in costs.items():
        if not 0 <= value < math.inf:
            raise ConfigError(f"{flag} {value}: must be a finite number of at least 0")
    if not 0 <= args.max_remote_share <= 1:
        raise ConfigError(f"--max-remote-share {args.max_remote_share}: must lie in [0, 1]")


def _simulate(args: argparse.Namespace) -> int:
    from gateway.simulate import main as simulate_main
    from region_map.simulation.trace import TraceError

    _check_simulate_numbers(args)
    try:
        return simulate_main(args)
    except (OSError, TraceError, ValueError) as exc:
        print(f"kvgate simulate: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate",
        description="kvgate: an edge gateway that routes LLM requests to where their KV cache lives.",
    )
    parser.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default=os.environ.get("KVGATE_LOG_LEVEL", "info"),
        help="debug, info, warning or error (default: info)",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=os.environ.get("KVGATE_LOG_FORMAT", "auto"),
        help="JSON lines, or text; auto: text on a terminal, JSON lines otherwise",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        default=os.environ.get("KVGATE_DEBUG", "") not in ("", "0"),
        help="show the traceback of an error (by default an error is one line: its cause and the fix)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    registered = False
    for ep in sorted(entry_points(group="kvgate.commands"), key=lambda e: e.name):
        try:
            ep.load()(subparsers)
        except ImportError as exc:  # e.g. an extra that is not installed: keep the other commands working
            print(f"kvgate: the {ep.name!r} commands are unavailable: {exc}", file=sys.stderr)
            continue
        registered = registered or ep.name == "gateway"
    if not registered:  # running from a source tree that was never installed
        register(subparsers)
    for command in subparsers.choices.values():  # `kvgate serve --debug` works too
        command.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # argparse checks the choices of a flag given, not of a default taken from the environment: a typo
    # there was a traceback (the log level) or silently text (the log format).
    for variable, value, choices in (
        ("KVGATE_LOG_LEVEL", args.log_level, LOG_LEVELS),
        ("KVGATE_LOG_FORMAT", args.log_format, LOG_FORMATS),
    ):
        if value not in choices:
            print(
                f"kvgate: configuration error: {variable}={value!r} is not one of {', '.join(choices)}",
                file=sys.stderr,
            )
            return 2
    configure_logging(args.log_level, args.log_format)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    command = f"kvgate {args.command}"
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        _say(args, f"kvgate: configuration error: {exc}")
        return 2
    except UserError as exc:
        _say(args, f"{command}: {exc}")
        return exc.status
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug: one line, and how to see where it came from
        if args.debug:
            raise
        print(
            f"{command}: unexpected error: {type(exc).__name__}: {exc} "
            f"(kvgate --debug {args.command} ... shows the traceback; please report it)",
            file=sys.stderr,
        )
        return 1


def _say(args: argparse.Namespace, line: str) -> None:
    """An error in one line on stderr; with --debug, its traceback before it."""
    if args.debug:
        traceback.print_exc()
    print(line, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
