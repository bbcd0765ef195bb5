"""The simulated engine's command: ``kvgate sim-engine`` and ``python -m engine.sim``.

Kept import-light like ``engine.cli``, which registers it: the simulator's server is imported only when the
command runs.
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.cli_args import non_negative_int, port_number, positive_int, seconds
from engine.cli_tls import add_tls_arguments, tls_context

if TYPE_CHECKING:
    from engine.sim.config import SimEngineConfig

SIM_ENGINE_HELP = (
    "run the SIMULATED engine: an OpenAI-compatible server with a cost model, for tests and benchmarks"
)


def add_sim_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulator's flags; shared by ``kvgate sim-engine`` and ``python -m engine.sim``."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument(
        "--port",
        type=port_number,
        required=True,
        help="port to listen on; 0 picks a free one (printed on stderr)",
    )
    parser.add_argument(
        "--capacity-blocks",
        type=non_negative_int,
        default=4096,
        help="prefix cache capacity in blocks (default: %(default)s)",
    )
    parser.add_argument(
        "--block-size", type=positive_int, default=16, help="tokens per KV block (default: %(default)s)"
    )
    parser.add_argument(
        "--model", default="kvgate-sim", help="the model name it serves (default: %(default)s)"
    )
    parser.add_argument(
        "--engine-id", default=None, help="its id in KV events and /health (default: sim-<port>)"
    )
    parser.add_argument(
        "--prefill-s-per-token",
        type=seconds,
        default=5e-5,
        help="simulated prefill cost per uncached prompt token, seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--decode-s-per-token",
        type=seconds,
        default=0.02,
        help="simulated decode cost per output token, seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--kv-pull-s-per-token",
        type=seconds,
        default=1.2e-5,
        help="simulated cost of sending a cached token's K/V to a peer that pulls it (default: %(default)s)",
    )
    parser.add_argument(
        "--profile",
        metavar="NAME",
        help="batching mode: requests share one step loop costed by this perfmodel engine profile "
        "(llama3-8b-h100, llama3-70b-h100, ...), so they queue behind each other's work; "
        "--prefill-s-per-token, --decode-s-per-token and --max-running are then not used "
        "(default: every request is costed on its own)",
    )
    parser.add_argument(
        "--profile-overrides",
        metavar="K=V,...",
        default="",
        help="replace some of the profile's constants, e.g. step_fixed_s=0.004,max_batch_tokens=2048",
    )
    parser.add_argument(
        "--max-running",
        type=positive_int,
        default=64,
        help="requests processed at once; more wait FIFO (default: %(default)s)",
    )
    parser.add_argument(
        "--max-model-len",
        type=positive_int,
        default=131072,
        help="largest prompt + max_tokens accepted (default: %(default)s)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="tokenize with this Hugging Face tokenizer directory (default: byte-level); reported as its "
        "model path to routers that ask",
    )
    add_tls_arguments(parser)


def run_sim_engine(args: argparse.Namespace) -> int:
    """Serve the simulator until SIGINT/SIGTERM; returns the exit status."""
    from engine.sim.run import serve

    ssl_context = tls_context(args)
    sock: socket.socket | None = None
    port: int = args.port
    if port == 0:
        # Bind first so that the default engine id can name the port actually used.
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        sock = socket.create_server((args.host, 0), family=family)
        port = sock.getsockname()[1]
    try:
        config = _sim_engine_config(args, port)
    except ValueError as exc:  # an unknown --profile or an unusable --profile-overrides
        raise SystemExit(f"kvgate sim-engine: {exc}") from None
    try:
        return serve(config, sock=sock, ssl_context=ssl_context)
    except OSError as exc:  # the address is taken, or not ours to bind: say so without a traceback
        print(f"kvgate sim-engine: cannot serve on {args.host}:{port}: {exc}", file=sys.stderr)
        return 1


def _sim_engine_config(args: argparse.Namespace, port: int) -> SimEngineConfig:
    from engine.sim.config import SimEngineConfig

    return SimEngineConfig(
        engine_id=args.engine_id or f"sim-{port}",
        model=args.model,
        block_size=args.block_size,
        capacity_blocks=args.capacity_blocks,
        prefill_s_per_token=args.prefill_s_per_token,
        decode_s_per_token=args.decode_s_per_token,
        kv_pull_s_per_token=args.kv_pull_s_per_token,
        max_running=args.max_running,
        host=args.host,
        port=port,
        max_model_len=args.max_model_len,
        tokenizer=args.tokenizer,
        profile=args.profile,
        profile_overrides=args.profile_overrides,
    )


def sim_engine_main(argv: Sequence[str] | None = None) -> int:
    """``python -m engine.sim``: the same simulator without the console script."""
    parser = argparse.ArgumentParser(prog="python -m engine.sim", description=SIM_ENGINE_HELP)
    add_sim_engine_arguments(parser)
    return run_sim_engine(parser.parse_args(argv))
